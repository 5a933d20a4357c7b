"""The rows every backend of ``cbrun bench`` runs.

Rows are the first ``--rows`` GSM8K test questions. Per-row ``max_new_tokens`` is drawn uniformly from
``--max-new-tokens`` with ``--seed`` and capped so prompt plus completion fit the model's context, except in
``gsm8k-long``:

- ``gsm8k-stories260k``: each question as the prompt of stories260K (512-token context).
- ``gsm8k-long``: the same prompts, greedy, stop token 1, ``max_new_tokens = min(256, 512 - prompt)``: long rows of
  near-equal limits, the workload of issue 19's "fast by default" table (256 rows by default).
- ``random-llama-30m``: a random-init Llama of about 40M parameters on random ids, one prompt per question with the
  length stories260K's tokenizer gives it.
- ``vllm-random-llama``: issue 19's peer workload (section 0b), the one ``--backends ...,vllm`` compares with vLLM's
  CPU backend: a random Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, head_dim 64, vocab 512; stories260K's
  head_dim of 8 is one vLLM's CPU attention does not support) on 128 rows of random prompt ids of 40..300 tokens,
  per-row ``max_new_tokens`` uniform in ``--max-new-tokens`` (16..256), ``ignore_eos``, all drawn from ``--seed``.
  It reads no shared data.
- ``random-llama-100m``: issue 30's sampler workload: a random Llama of about 100M parameters (hidden 768, 12
  layers, 12 heads, 4 KV heads, vocab 32000, tied embeddings) on 256 rows of random prompt ids of 16..48 tokens,
  per-row ``max_new_tokens`` uniform in ``--max-new-tokens``, ``ignore_eos`` (every row generates exactly its limit,
  whatever it samples), all drawn from ``--seed``. Run it with ``cbrun-sampled`` and ``cbrun-sampled-full``. It
  reads no shared data.
- ``gsm8k-fewshot``: stories260K, each question after the same 1-shot exemplar (GSM8K train row 0, question and
  answer), the prompt of manifests/gsm8k-fewshot.toml: every row shares a prefix of about 217 tokens, which
  cbrun's prefix cache serves. Questions whose prompt leaves no room to generate (>= 512 tokens) are left out; the
  workload description says how many.

The data (GSM8K parquet files, the llama2.c stories260K checkpoint) is read from the shared folder: ``--shared DIR``,
else ``$CBRUN_SHARED``, else ``shared/`` beside the checkout (see ``shared_dir``).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

#: Environment variable naming the shared data folder (GSM8K, stories260K) when ``--shared`` is not given.
SHARED_ENV = "CBRUN_SHARED"
#: stories260K's context: prompt plus completion tokens.
STORIES_CONTEXT = 512
#: Train exemplars before each test question in ``gsm8k-fewshot``, as in manifests/gsm8k-fewshot.toml (k = 2 would
#: push most prompts past stories260K's context).
FEWSHOT_EXEMPLARS = 1
#: ``gsm8k-long``: each row generates up to this many tokens, capped by the context.
LONG_MAX_NEW_TOKENS = 256

WORKLOADS = (
    "gsm8k-stories260k",
    "gsm8k-long",
    "random-llama-30m",
    "gsm8k-fewshot",
    "vllm-random-llama",
    "random-llama-100m",
    "host-bound",
)
#: Rows per workload when --rows is not given, chosen so every backend ends in a few minutes on 2 CPU cores.
DEFAULT_ROWS = {
    "gsm8k-stories260k": 512,
    "gsm8k-long": 256,
    "random-llama-30m": 64,
    "gsm8k-fewshot": 512,
    "vllm-random-llama": 128,
    "random-llama-100m": 256,
    "host-bound": 512,
}


def llama_shape(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> dict[str, int]:
    """A Llama config's size fields: hidden size, layers, attention and key-value heads, MLP width."""
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
    )


#: Shape of the random Llama of the ``random-llama-30m`` workload (about 40M parameters with tied embeddings).
RANDOM_LLAMA = dict(
    **llama_shape(512, 8, 8, 4, 1408),
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

#: Shape of the ``vllm-random-llama`` workload's model: ``RANDOM_LLAMA`` with a 512-token vocabulary (head_dim 64).
VLLM_RANDOM_LLAMA = {**RANDOM_LLAMA, "vocab_size": 512}
#: ``vllm-random-llama``: prompt lengths are drawn uniformly from this range (inclusive).
VLLM_PROMPT_LENGTHS = (40, 300)
#: Shape of the ``random-llama-100m`` workload's model (about 100M parameters with tied embeddings).
RANDOM_LLAMA_100M = {**RANDOM_LLAMA, **llama_shape(768, 12, 12, 4, 2048)}
#: ``random-llama-100m``: prompt lengths are drawn uniformly from this range (inclusive).
SAMPLER_PROMPT_LENGTHS = (16, 48)
#: Shape of the ``host-bound`` workload's model (issue 39): so small (0.2M parameters, head_dim 64 as vLLM's CPU
#: attention takes) that a decode step's arithmetic is negligible and the engine's host cost per step is what is
#: timed.
HOST_BOUND_LLAMA = {**RANDOM_LLAMA, **llama_shape(128, 2, 2, 1, 256), "vocab_size": 512, "max_position_embeddings": 512}


def shared_dir(shared: str | Path | None = None) -> Path:
    """The shared data folder: ``shared`` when given, else ``$CBRUN_SHARED``, else ``shared/`` beside the checkout
    (the layout of this project's machines: the repository and ``shared/`` side by side)."""
    if shared:
        return Path(shared)
    if os.environ.get(SHARED_ENV):
        return Path(os.environ[SHARED_ENV])
    return Path(__file__).resolve().parents[3] / "shared"


def gsm8k_path(split: str, shared: Path | None = None) -> Path:
    """The GSM8K ``split`` ("test" or "train") parquet file in the shared folder."""
    return shared_dir(shared) / "data" / f"gsm8k_{split}.parquet"


def stories260k_path(shared: Path | None = None) -> Path:
    """The folder with llama2.c's stories260K checkpoint and tokenizer."""
    return shared_dir(shared) / "models" / "stories260K"


@dataclass
class Workload:
    """The rows every backend runs.

    Attributes:
        name: the workload name.
        model_dir: transformers model directory.
        prompts: per row, prompt token ids.
        max_new_tokens: per row, most tokens to generate (prompt + completion <= ``max_model_len``).
        stop_token_ids: ids that end a row (kept in its output).
        max_model_len: the model's maximum total length.
        description: one line for the report.
        ignore_eos: rows do not stop at the model's EOS token (vLLM's ``SamplingParams.ignore_eos``); every row
            then generates exactly its ``max_new_tokens`` unless a ``stop_token_ids`` id comes.
    """

    name: str
    model_dir: Path
    prompts: list[list[int]]
    max_new_tokens: list[int]
    stop_token_ids: tuple[int, ...]
    max_model_len: int
    description: str
    ignore_eos: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


#: Workloads of random prompt ids on a random Llama: name -> (its config, its description).
RANDOM_IDS_WORKLOADS = {
    "random-llama-100m": (RANDOM_LLAMA_100M, "issue 30's sampler workload"),
    "host-bound": (HOST_BOUND_LLAMA, "issue 39's host-cost workload"),
}


def build_workload(
    name: str,
    rows: int,
    new_tokens: tuple[int, int],
    seed: int,
    model_dir: Path | None,
    scratch: Path,
    shared: Path | None = None,
) -> Workload:
    """Build a workload by name.

    Args:
        name: one of ``WORKLOADS``.
        rows: number of GSM8K test questions, from the first (``gsm8k-fewshot`` leaves out those too long);
            ``vllm-random-llama``: number of random prompts.
        new_tokens: (low, high) bounds of the uniform per-row ``max_new_tokens`` draw.
        seed: seed of that draw and of random prompt ids.
        model_dir: a model directory to reuse (built there when it has no config.json); None builds in ``scratch``.
        scratch: a temporary directory for models built on the fly.
        shared: the shared data folder (see ``shared_dir``); None takes the default.

    Raises:
        ValueError: for an unknown workload, more rows than GSM8K's test split holds, or no row that fits.
    """
    if name == "vllm-random-llama":
        return _vllm_random_llama_workload(rows, new_tokens, seed, model_dir or scratch / "vllm-random-llama")
    if name in RANDOM_IDS_WORKLOADS:
        config, description = RANDOM_IDS_WORKLOADS[name]
        return _random_ids_workload(
            name, config, SAMPLER_PROMPT_LENGTHS, rows, new_tokens, seed, model_dir or scratch / name, description
        )
    shared = shared_dir(shared)
    if name == "gsm8k-stories260k":
        return _stories_workload(rows, new_tokens, seed, model_dir or scratch / "stories260k", shared)
    if name == "gsm8k-long":
        return _long_workload(rows, model_dir or scratch / "stories260k", shared)
    if name == "random-llama-30m":
        return _random_llama_workload(rows, new_tokens, seed, model_dir or scratch / "random-llama-30m", shared)
    if name == "gsm8k-fewshot":
        return _fewshot_workload(rows, new_tokens, seed, model_dir or scratch / "stories260k", shared)
    raise ValueError(f"unknown workload {name!r}; choose one of {WORKLOADS}")


def gsm8k_questions(rows: int, shared: Path | None = None) -> list[str]:
    """The first ``rows`` questions of the GSM8K test split."""
    import pyarrow.parquet as pq

    questions = pq.read_table(gsm8k_path("test", shared), columns=["question"]).column("question").to_pylist()
    if rows > len(questions):
        raise ValueError(f"--rows {rows} exceeds the {len(questions)} GSM8K test questions")
    return questions[:rows]


def draw_max_new_tokens(
    prompts: list[list[int]], new_tokens: tuple[int, int], max_model_len: int, seed: int
) -> list[int]:
    """Per row, uniform in ``new_tokens`` (inclusive) from ``seed``, capped so prompt + completion fit the model."""
    rng = random.Random(seed)
    low, high = new_tokens
    return [min(rng.randint(low, high), max_model_len - len(p)) for p in prompts]


def gsm8k_exemplars(k: int, shared: Path | None = None) -> list[dict]:
    """The first ``k`` rows of the GSM8K train split as ``{"question", "answer"}`` dicts (few-shot exemplars)."""
    import pyarrow.parquet as pq

    return pq.read_table(gsm8k_path("train", shared), columns=["question", "answer"]).slice(0, k).to_pylist()


def fewshot_template(exemplars: list[dict]) -> str:
    """A ``str.format`` template: each exemplar's question and answer, then ``{question}``.

    Braces in the exemplar text are doubled so that only ``{question}`` is a field. With GSM8K train row 0 it is
    manifests/gsm8k-fewshot.toml's ``input.template``.
    """

    def escape(text: str) -> str:
        return text.replace("{", "{{").replace("}", "}}")

    shots = "".join(f"Question: {escape(e['question'])}\nAnswer: {escape(e['answer'])}\n\n" for e in exemplars)
    return shots + "Question: {question}\nAnswer:"


def _stories_workload(rows: int, new_tokens: tuple[int, int], seed: int, model_dir: Path, shared: Path) -> Workload:
    tokenizer = _stories_model(model_dir, shared)
    prompts = tokenizer(gsm8k_questions(rows, shared))["input_ids"]
    return Workload(
        "gsm8k-stories260k",
        model_dir,
        prompts,
        draw_max_new_tokens(prompts, new_tokens, STORIES_CONTEXT, seed),
        (1,),
        STORIES_CONTEXT,
        f"stories260K on the first {rows} GSM8K test questions, {_stories_limits(new_tokens, seed)}",
    )


def _long_workload(rows: int, model_dir: Path, shared: Path) -> Workload:
    """Long rows: every question generates ``min(LONG_MAX_NEW_TOKENS, context - prompt)`` tokens unless it stops."""
    tokenizer = _stories_model(model_dir, shared)
    prompts = tokenizer(gsm8k_questions(rows, shared))["input_ids"]
    limits = [min(LONG_MAX_NEW_TOKENS, STORIES_CONTEXT - len(p)) for p in prompts]
    return Workload(
        "gsm8k-long",
        model_dir,
        prompts,
        limits,
        (1,),
        STORIES_CONTEXT,
        f"stories260K on the first {rows} GSM8K test questions, greedy, stop token 1, max_new_tokens = "
        f"min({LONG_MAX_NEW_TOKENS}, {STORIES_CONTEXT} - prompt)",
    )


def _fewshot_workload(rows: int, new_tokens: tuple[int, int], seed: int, model_dir: Path, shared: Path) -> Workload:
    tokenizer = _stories_model(model_dir, shared)
    template = fewshot_template(gsm8k_exemplars(FEWSHOT_EXEMPLARS, shared))
    # verbose=False: prompts longer than the context are expected here and dropped just below.
    encoded = tokenizer([template.format(question=q) for q in gsm8k_questions(rows, shared)], verbose=False)[
        "input_ids"
    ]
    prompts = [p for p in encoded if len(p) < STORIES_CONTEXT]  # a full-context prompt leaves no room to generate
    if not prompts:
        raise ValueError(
            f"no gsm8k-fewshot prompt of the first {rows} questions fits the {STORIES_CONTEXT}-token "
            f"context; raise --rows"
        )
    num_shared = len(os.path.commonprefix(prompts))
    return Workload(
        "gsm8k-fewshot",
        model_dir,
        prompts,
        draw_max_new_tokens(prompts, new_tokens, STORIES_CONTEXT, seed),
        (1,),
        STORIES_CONTEXT,
        f"stories260K on the first {rows} GSM8K test questions, each after the same 1-shot exemplar "
        f"(GSM8K train row 0, as manifests/gsm8k-fewshot.toml): {num_shared} shared prompt tokens; "
        f"{rows - len(prompts)} rows left out (prompt of >= {STORIES_CONTEXT} tokens, no room to "
        f"generate), {len(prompts)} run; {_stories_limits(new_tokens, seed)}",
    )


def _stories_model(model_dir: Path, shared: Path):
    """stories260K's tokenizer, after converting the llama2.c checkpoint to ``model_dir`` unless already there."""
    from transformers import AutoTokenizer

    if not (model_dir / "config.json").is_file():
        from cbrun.jobs.model.convert_llama2c import convert_llama2c

        source = stories260k_path(shared)
        convert_llama2c(source / "stories260K.bin", source / "tok512.bin", model_dir)
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def _stories_limits(new_tokens: tuple[int, int], seed: int) -> str:
    return (
        f"stop token 1, max_new_tokens uniform {new_tokens[0]}..{new_tokens[1]} (seed {seed}), capped by the "
        f"{STORIES_CONTEXT}-token context"
    )


def _random_llama_workload(
    rows: int, new_tokens: tuple[int, int], seed: int, model_dir: Path, shared: Path
) -> Workload:
    if not (model_dir / "config.json").is_file():
        build_random_llama(model_dir, seed)
    lengths = [len(ids) for ids in _stories_tokenizer(shared)(gsm8k_questions(rows, shared))["input_ids"]]
    g = torch.Generator().manual_seed(seed)
    vocab = RANDOM_LLAMA["vocab_size"]
    prompts = [[1] + torch.randint(3, vocab, (n - 1,), generator=g).tolist() for n in lengths]
    max_len = RANDOM_LLAMA["max_position_embeddings"]
    return Workload(
        "random-llama-30m",
        model_dir,
        prompts,
        draw_max_new_tokens(prompts, new_tokens, max_len, seed),
        (RANDOM_LLAMA["eos_token_id"],),
        max_len,
        f"random-init Llama ({_shape_text(RANDOM_LLAMA)}) on {rows} prompts of random ids with the "
        f"stories260K token lengths of the first {rows} GSM8K test questions, stop token 2, "
        f"max_new_tokens uniform {new_tokens[0]}..{new_tokens[1]} (seed {seed})",
    )


def _shape_text(c: dict) -> str:
    return (
        f"hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_attention_heads']} heads, "
        f"{c['num_key_value_heads']} kv heads, intermediate {c['intermediate_size']}, vocab {c['vocab_size']}, "
        f"tied embeddings"
    )


def _stories_tokenizer(shared: Path):
    from cbrun.jobs.model.convert_llama2c import build_tokenizer, read_tokenizer

    return build_tokenizer(*read_tokenizer(stories260k_path(shared) / "tok512.bin", 512), 512)


def _vllm_random_llama_workload(rows: int, new_tokens: tuple[int, int], seed: int, model_dir: Path) -> Workload:
    """Random prompt ids of random lengths, per-row limits, ``ignore_eos``: the same rows for a given ``seed``."""
    return _random_ids_workload(
        "vllm-random-llama",
        VLLM_RANDOM_LLAMA,
        VLLM_PROMPT_LENGTHS,
        rows,
        new_tokens,
        seed,
        model_dir,
        "issue 19's vLLM CPU comparison",
        first_id=0,  # NOTE: its ids were drawn from 0 when its results were recorded; kept so they reproduce
    )


def _random_ids_workload(
    name: str,
    shape: dict,
    prompt_lengths: tuple[int, int],
    rows: int,
    new_tokens: tuple[int, int],
    seed: int,
    model_dir: Path,
    purpose: str,
    first_id: int = 3,
) -> Workload:
    """Random prompt ids of random lengths on a random Llama of ``shape``, per-row limits, ``ignore_eos``; the ids
    are drawn from ``first_id`` up (3: past the special tokens)."""
    if not (model_dir / "config.json").is_file():
        build_random_llama(model_dir, seed, shape)
    g = torch.Generator().manual_seed(seed)
    low, high = prompt_lengths
    lengths = torch.randint(low, high + 1, (rows,), generator=g).tolist()
    prompts = [torch.randint(first_id, shape["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    max_len = shape["max_position_embeddings"]
    return Workload(
        name,
        model_dir,
        prompts,
        draw_max_new_tokens(prompts, new_tokens, max_len, seed),
        (),
        max_len,
        f"random-init Llama ({_shape_text(shape)}) on {rows} prompts of random ids, {low}..{high} "
        f"tokens, max_new_tokens uniform {new_tokens[0]}..{new_tokens[1]}, ignore_eos (seed {seed}): "
        f"{purpose}",
        ignore_eos=True,
    )


def build_random_llama(out_dir: Path, seed: int = 0, shape: dict | None = None) -> Path:
    """Save a random-initialised Llama (float32, no tokenizer) to ``out_dir``.

    Args:
        out_dir: the transformers model directory to write.
        seed: the weights' seed.
        shape: ``LlamaConfig`` fields; None takes ``RANDOM_LLAMA``.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    shape = shape or RANDOM_LLAMA
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=shape["eos_token_id"], pad_token_id=0)
    model.save_pretrained(out_dir)
    return out_dir


def cut_output(tokens: list[int], max_new_tokens: int, stop_token_ids: tuple[int, ...]) -> list[int]:
    """Cut generated ids as cbrun does: through the first stop token (kept), at most ``max_new_tokens``."""
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in stop_token_ids:
            return tokens[: i + 1]
    return tokens
