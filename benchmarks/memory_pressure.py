"""Throughput and offload counts under KV-cache pressure: cache sizes from generous to tight, both schedulers.

Usage (from the repository root, after converting stories260K as the README shows):

    python -m benchmarks.memory_pressure --model models/stories260K --rows 256

Prints a Markdown table: scheduler, cache blocks, CPU swap, generated tokens/s, steps, offloads (swaps to CPU),
soft resets, and whether every output equals the unconstrained run's.
"""

from __future__ import annotations

import argparse
import platform
import time

import pyarrow.parquet as pq
import torch
from transformers import AutoTokenizer

from cbrun.bench.workloads import gsm8k_path
from cbrun.engine import EngineConfig, LLMEngine, SamplingParams


def load_prompts(model_dir: str, data: str, rows: int) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = pq.read_table(data, columns=["question"]).column("question").to_pylist()[:rows]
    return [tokenizer(q)["input_ids"] for q in questions]


def run(model_dir: str, prompts, config: EngineConfig, max_new_tokens: int) -> tuple[dict, float, object]:
    """Outputs (``None`` for a request that failed, e.g. larger than the whole cache), seconds, the engine."""
    engine = LLMEngine.from_pretrained(model_dir, config)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    start = time.perf_counter()
    outputs = {
        o.request_id: (o.output_token_ids if o.error is None else None)
        for o in engine.generate((i, p, params) for i, p in enumerate(prompts))
    }
    return outputs, time.perf_counter() - start, engine


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/stories260K")
    parser.add_argument(
        "--data",
        default=str(gsm8k_path("test")),
        help="GSM8K test parquet (default: from $CBRUN_SHARED, else shared/ beside the checkout)",
    )
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--blocks", type=int, nargs="+", default=[2048, 256, 96, 48, 24])
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompts = load_prompts(args.model, args.data, args.rows)
    common = dict(page_size=16, max_batch_tokens=512, max_requests_per_batch=64, num_threads=1)
    reference, _, _ = run(args.model, prompts, EngineConfig(num_blocks=4096, **common), args.max_new_tokens)
    print(
        f"machine: {_cpu_name()}, {torch.get_num_threads()} thread(s); "
        f"{len(prompts)} GSM8K questions, stories260K, greedy, max_new_tokens {args.max_new_tokens}, page 16, "
        f"max_batch_tokens 512, max_requests_per_batch 64"
    )
    print()
    print(
        "| scheduler | blocks (tokens) | CPU swap | gen tokens/s | steps | offloads | soft resets | too large "
        "for the cache | other outputs equal |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for scheduler in ("fifo", "prefill_first"):
        for blocks in args.blocks:
            for swap in (0.0, 0.25) if blocks <= 96 else (0.0,):
                config = EngineConfig(num_blocks=blocks, scheduler_type=scheduler, cpu_offload_space=swap, **common)
                outputs, seconds, engine = run(args.model, prompts, config, args.max_new_tokens)
                stats = engine.stats
                failed = [i for i in outputs if outputs[i] is None]
                equal = sum(outputs[i] == reference[i] for i in reference if outputs[i] is not None)
                print(
                    f"| {scheduler} | {blocks} ({blocks * 16}) | {'0.25 GiB' if swap else 'off'} | "
                    f"{stats.num_generated_tokens / seconds:.0f} | {stats.num_steps} | {stats.num_offloads} | "
                    f"{stats.num_soft_resets} | {len(failed)} | {equal}/{len(reference) - len(failed)} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
