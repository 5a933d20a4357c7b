"""``cbrun bench --workload structured``: a JSON-schema job against the same job unconstrained.

The model is a small random Llama (``STRUCTURED_LLAMA``: hidden 256, 4 layers, vocab 32000) with a byte-level BPE
tokenizer of 32000 tokens trained on GSM8K's train split (``build_tokenizer``; nothing is downloaded), so the masks
have a real tokenizer's size while a 256-row run fits a few minutes on 2 CPU cores. Its forward pass is cheap, so the
grammar's share of a step is larger here than with a real model. Rows: the first ``--rows`` (256) GSM8K test
questions as prompts, greedy, the same engine settings and budgets in every run, one run each, in one process:

- ``json schema``: every row under ``SCHEMA`` (nested objects, an enum, bounded integers, an array, bounded strings),
  ``max_new_tokens`` ``--max-new-tokens`` (160, above the schema's longest form in this tokenizer);
- ``unconstrained, same lengths``: the same rows without a constraint, each generating exactly as many tokens as
  its constrained run did (``ignore_eos``): the same batch at every step, so the ratio is the grammar's cost;
- ``unconstrained, same limit`` (``--same-limit``): ``max_new_tokens`` 160 for every row (rows run longer, so its
  batches stay full: the ratio then mixes in the workload's shape).

``--repeat`` runs the two again in the other order. A row gives each run's generated tokens / wall second, its
forward passes' time (timed around the model runner's forward, synchronous on the CPU) and the rest (host time),
and the ratio. On a shared machine the forward passes' time swings with the load although both runs do the same
passes, so the report also gives the ratio with the unconstrained run's forward time in both: the grammar's cost
alone. The constrained run adds the grammar's compile time (``EngineStats.grammar_compile_seconds``), the host time
per step spent filling and uploading the rows' bitmasks (``grammar_mask_seconds / num_grammar_mask_steps``), how
many rows ended by "stop" and how many parse and validate.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from cbrun.bench.measure import git_commit, machine_info
from cbrun.bench.workloads import RANDOM_LLAMA, build_random_llama, gsm8k_path, gsm8k_questions

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 100000},
        "unit": {"enum": ["dollars", "items", "hours", "people", "other"]},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
        "check": {
            "type": "object",
            "properties": {"confident": {"type": "boolean"}, "note": {"type": "string", "maxLength": 16}},
            "required": ["confident", "note"],
            "additionalProperties": False,
        },
    },
    "required": ["answer", "unit", "steps", "check"],
    "additionalProperties": False,
}
VOCAB = RANDOM_LLAMA["vocab_size"]
#: The benchmark's model: ``RANDOM_LLAMA``'s vocabulary on a smaller body.
STRUCTURED_LLAMA = {
    **RANDOM_LLAMA,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 704,
}


def build_tokenizer(out_dir: Path, shared: Path | None = None):
    """A byte-level BPE tokenizer of ``VOCAB`` tokens (<unk> 0, <s> 1, </s> 2) trained on GSM8K's train split, saved
    to ``out_dir`` as a transformers fast tokenizer; returns it."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    table = pq.read_table(gsm8k_path("train", shared), columns=["question", "answer"])
    texts = table.column("question").to_pylist() + table.column("answer").to_pylist()
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out_dir)
    return fast


def build_model(model_dir: Path, shared: Path | None = None):
    """The random Llama with the trained tokenizer in ``model_dir`` (built once)."""
    from transformers import AutoTokenizer

    if not (model_dir / "tokenizer.json").is_file():
        build_random_llama(model_dir, 0, STRUCTURED_LLAMA)
        build_tokenizer(model_dir, shared)
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def run(engine_config, model_dir: Path, prompts: list[list[int]], params: list) -> dict:
    """One run on a fresh engine (row i with ``params[i]``): generated tokens / wall second, the engine's grammar
    counters, and per row its output length and text."""
    from cbrun.engine import LLMEngine

    engine = LLMEngine.from_pretrained(str(model_dir), engine_config)
    forward = _time_forward(engine)
    start = time.perf_counter()
    outputs = sorted(
        engine.generate((i, p, q) for i, (p, q) in enumerate(zip(prompts, params))), key=lambda o: o.request_id
    )
    wall = time.perf_counter() - start
    stats = engine.stats
    texts = [
        engine.tokenizer.decode(o.output_token_ids, skip_special_tokens=True) if o.text is None else o.text
        for o in outputs
    ]
    return {
        "wall_s": wall,
        "forward_s": forward[0],
        "host_s": wall - forward[0],
        "tokens": stats.num_generated_tokens,
        "tok_s": stats.num_generated_tokens / wall,
        "steps": stats.num_steps,
        "compile_s": stats.grammar_compile_seconds,
        "mask_steps": stats.num_grammar_mask_steps,
        "mask_s": stats.grammar_mask_seconds,
        "stop": sum(o.finish_reason == "stop" for o in outputs),
        "texts": texts,
        "lengths": [len(o.output_token_ids) for o in outputs],
        "errors": sum(o.finish_reason == "error" for o in outputs),
    }


def _time_forward(engine) -> list[float]:
    """Wrap the model runner's forward pass with a timer (synchronous on the CPU); returns its running total."""
    total = [0.0]
    forward = engine.model_runner._forward

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start

    engine.model_runner._forward = timed
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cbrun bench --workload structured", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled, seed = row index")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--same-limit", action="store_true", help="also run unconstrained with max_new_tokens for all")
    p.add_argument("--repeat", action="store_true", help="run both again in the other order")
    p.add_argument("--model-dir", type=Path, default=None, help="where the model is built (default: a temp dir)")
    p.add_argument("--shared", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="also write the report here (markdown)")
    args = p.parse_args(argv)
    from cbrun.engine.config import EngineConfig
    from cbrun.engine.sampling_params import SamplingParams
    from cbrun.engine.structured_output import StructuredOutputsParams
    from cbrun.engine.structured_output.validate import is_valid_output

    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="cbrun-structured-")) / "model"
    tokenizer = build_model(model_dir, args.shared)
    prompts = tokenizer(gsm8k_questions(args.rows, args.shared))["input_ids"]
    config = EngineConfig(
        device=args.device, num_threads=args.threads, max_requests_per_batch=args.rows, max_batch_tokens=4096
    )
    free = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    constraint = StructuredOutputsParams(json=SCHEMA)
    constrained = [free.replace(structured_outputs=constraint, seed=i) for i in range(len(prompts))]
    runs = {"json schema": run(config, model_dir, prompts, constrained)}
    same_lengths = [
        free.replace(max_new_tokens=n, ignore_eos=True, seed=i) for i, n in enumerate(runs["json schema"]["lengths"])
    ]
    runs["unconstrained, same lengths"] = run(config, model_dir, prompts, same_lengths)
    if args.same_limit:
        runs["unconstrained, same limit"] = run(config, model_dir, prompts, [free] * len(prompts))
    if args.repeat:  # the same two runs again, in the other order: the machine's load drifts
        runs["unconstrained, same lengths (2)"] = run(config, model_dir, prompts, same_lengths)
        runs["json schema (2)"] = run(config, model_dir, prompts, constrained)
    valid = sum(bool(is_valid_output(t, constraint)) for t in runs["json schema"]["texts"])
    report = _report(args, runs, valid)
    print(report)
    if args.out is not None:  # benchmarks/results-structured-outputs.md holds the curated runs and their history
        args.out.write_text(report)
    return 0


def _report(args, runs: dict, valid: int) -> str:
    base, json_run = runs["unconstrained, same lengths"], runs["json schema"]
    mask_ms = 1000 * json_run["mask_s"] / max(1, json_run["mask_steps"])
    lines = [
        f"# cbrun bench --workload structured ({datetime.date.today()}, commit {git_commit()})",
        "",
        f"Machine: {machine_info(args.threads)['cpu']}, {args.device}; shared with other jobs while measured. "
        f"{args.rows} rows, max_new_tokens {args.max_new_tokens}, "
        f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}, seeded'}, "
        f"{args.threads} threads, one run each. "
        "Model: random Llama (hidden 256, 4 layers, vocab 32000) with a 32000-token byte-level BPE tokenizer "
        "trained on GSM8K train.",
        "",
        "| run | generated tokens | steps | wall s | forward s | host s (rest) | tok/s | vs same lengths | "
        "rows ended by stop |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        lines.append(
            f"| {name} | {r['tokens']} | {r['steps']} | {r['wall_s']:.1f} | {r['forward_s']:.1f} | "
            f"{r['host_s']:.1f} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x | "
            f"{r['stop']} / {args.rows} |"
        )
    # The forward passes are the same work in both runs; their time swings with the machine's load. With the
    # unconstrained run's forward time in both, the ratio is the host time's alone.
    same_forward = (base["forward_s"] + base["host_s"]) / (base["forward_s"] + json_run["host_s"])
    lines += [
        "",
        f"- ratio with equal forward time (the unconstrained run's {base['forward_s']:.1f} s in both): "
        f"{same_forward:.2f}x; grammar host time per step: "
        f"{1000 * (json_run['host_s'] - base['host_s']) / json_run['steps']:.1f} ms",
        f"- grammar compile (one schema, on the compile thread): {json_run['compile_s']:.3f} s",
        f"- bitmask fill + upload per step at up to {args.rows} constrained rows: {mask_ms:.2f} ms "
        f"({json_run['mask_steps']} steps, {json_run['mask_s']:.2f} s in all, "
        f"{100 * json_run['mask_s'] / json_run['wall_s']:.1f}% of the run)",
        f"- rows that parse and validate (jsonschema): {valid} / {args.rows}; errors: {json_run['errors']}",
        "",
        "Schema:",
        "",
        "```json",
        json.dumps(SCHEMA, indent=1),
        "```",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
