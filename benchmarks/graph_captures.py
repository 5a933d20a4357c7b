"""How many CUDA graphs a job captures and how many of its steps replay one, with emulated graphs on the CPU.

A simulated job (random prompt and output lengths on a tiny random Llama, the CUDA batch limits) runs with
``cuda_graphs = "emulate"`` and with graphs off; the table gives the steps, the graphed steps, the captures, the
bucket count (the bound on captures) and whether the greedy outputs are equal. Counts, not timings: the emulation
says nothing about speed.

    python -m benchmarks.graph_captures [--requests 600] [--speculative ngram]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile

import torch

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams

VOCAB = 128


def _model_dir(path: str, max_len: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.model_utils import TINY_DECODER

    torch.manual_seed(0)
    config = LlamaConfig(**dict(TINY_DECODER, vocab_size=VOCAB, max_position_embeddings=max_len))
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _workload(num_requests: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens) per request: prompts of 1-200 tokens, outputs of 1-64."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(VOCAB) for _ in range(rng.randint(1, 200))], rng.randint(1, 64)) for _ in range(num_requests)
    ]


def _run(model_dir: str, workload, **config) -> tuple[dict, LLMEngine]:
    engine = LLMEngine.from_pretrained(
        model_dir,
        EngineConfig(
            loader="transformers",
            page_size=16,
            num_blocks=2048,
            max_requests_per_batch=256,
            max_batch_tokens=2048,
            attention_backend="cpu",
            **config,
        ),
    )
    requests = ((i, prompt, SamplingParams(max_new_tokens=n)) for i, (prompt, n) in enumerate(workload))
    return {o.request_id: o.output_token_ids for o in engine.generate(requests)}, engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--speculative", default="off", choices=("off", "ngram"))
    args = parser.parse_args(argv)
    workload = _workload(args.requests)
    with tempfile.TemporaryDirectory(prefix="cbrun-graph-captures-") as path:
        model_dir = _model_dir(path, 512)
        eager, _ = _run(model_dir, workload, cuda_graphs="off", speculative=args.speculative)
        graphed, engine = _run(model_dir, workload, cuda_graphs="emulate", speculative=args.speculative)
    stats = engine.stats
    buckets = engine.model_runner.graph_buckets
    bound = len(buckets.sizes) * buckets.max_query_len
    print(
        "requests | speculative | steps | graphed steps | captures | bound (buckets x query lengths) | outputs == off"
    )
    print(
        f"{args.requests:8} | {args.speculative:11} | {stats.num_steps:5} | {stats.num_cuda_graph_replays:13} | "
        f"{stats.num_cuda_graph_captures:8} | {bound:31} | {graphed == eager}"
    )
    return 0 if graphed == eager else 1


if __name__ == "__main__":
    sys.exit(main())
