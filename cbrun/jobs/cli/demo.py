"""A tiny random-weight Llama and a no-download tokenizer, for `cbrun demo` and for tests.

The model is built from a seed in well under a second and needs no network: a byte-level tokenizer (one token per
UTF-8 byte, plus ``<s>``, ``</s>``, ``<unk>``) made with the ``tokenizers`` library, and a 2-layer Llama of hidden
size 64 with random weights. Its completions are noise; it exists to exercise the whole job pipeline.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
NUM_BYTES = 256

DEMO_TOPICS = (
    "a lighthouse keeper",
    "a lost kitten",
    "the first snow",
    "a robot gardener",
    "an old map",
    "a quiet library",
    "a brave little boat",
    "the moon festival",
)


def build_byte_tokenizer():
    """A byte-level BPE tokenizer without merges: ids 0..255 are the 256 byte symbols, then <s>, </s>, <unk>.

    Returns:
        A ``PreTrainedTokenizerFast`` that prepends ``<s>`` to every encoded text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    assert len(alphabet) == NUM_BYTES
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    for token in (BOS, EOS, UNK):
        vocab[token] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS, UNK])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, unk_token=UNK)


def build_demo_model(out_dir: str | Path, *, seed: int = 0, max_position_embeddings: int = 256) -> Path:
    """Save a tiny random Llama (hidden 64, 2 layers) with the byte tokenizer to ``out_dir``.

    Args:
        out_dir: directory to create (or reuse); gets config.json, model.safetensors, generation_config.json and
            the tokenizer files.
        seed: torch seed of the random weights; the same seed gives the same model.
        max_position_embeddings: the model's maximum total length (prompt + completion tokens).

    Returns:
        ``out_dir`` as a Path.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def write_demo_prompts(path: str | Path, num_rows: int = 64) -> Path:
    """Write a small Parquet file of story prompts with columns ``id`` and ``prompt``, two row groups."""
    path = Path(path)
    ids = [f"demo-{i:04d}" for i in range(num_rows)]
    prompts = [f"Tell a short story about {DEMO_TOPICS[i % len(DEMO_TOPICS)]} (#{i})." for i in range(num_rows)]
    table = pa.table({"id": pa.array(ids, pa.string()), "prompt": pa.array(prompts, pa.string())})
    pq.write_table(table, path, row_group_size=max(1, num_rows // 2))
    return path


def demo_manifest(work_dir: str | Path, *, output_dir: str | Path | None = None):
    """The manifest of the demo job over a model and prompts already written to ``work_dir``."""
    from cbrun.engine.config import EngineConfig
    from cbrun.engine.sampling_params import SamplingParams
    from cbrun.jobs.config.manifest import JobManifest
    from cbrun.jobs.config.settings import InputSettings, ModelSettings, OutputSettings

    work_dir = Path(work_dir)
    return JobManifest(
        model=ModelSettings(path=str(work_dir / "model")),
        input=InputSettings(path=str(work_dir / "prompts.parquet"), prompt_column="prompt", id_column="id"),
        sampling=SamplingParams(max_new_tokens=32, temperature=0.0),
        engine=EngineConfig(page_size=16, max_batch_tokens=512, max_requests_per_batch=32, device="cpu", num_threads=1),
        output=OutputSettings(path=str(output_dir or work_dir / "output"), commit_every_rows=16, overwrite=True),
    )


def run_demo(work_dir: str | Path, *, output_dir: str | Path | None = None, num_rows: int = 64, progress: bool = True):
    """Build the demo model and prompts in ``work_dir`` and run the demo job into ``output_dir``.

    Args:
        work_dir: where the model (``model/``) and the prompts (``prompts.parquet``) are written.
        output_dir: the job's output directory (default ``work_dir/output``).

    Returns:
        The job's ``JobSummary``; its ``output_dir`` holds the parts.
    """
    from cbrun.jobs.run.job import run_job

    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    build_demo_model(work_dir / "model")
    write_demo_prompts(work_dir / "prompts.parquet", num_rows)
    return run_job(demo_manifest(work_dir, output_dir=output_dir), progress=progress)
