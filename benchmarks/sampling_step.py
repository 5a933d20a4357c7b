"""The batched sampler's own time per step: ``cbrun.engine.sample.sampler.sample`` on (rows, vocab) logits.

Three settings, as in ``cbrun bench --workload random-llama-100m``: greedy (through the sampler, e.g. a greedy row
with a penalty or logprobs pays this; plain greedy rows take the device argmax instead), temperature 0.8 / top_p
0.95, and the same plus repetition_penalty 1.1 (64 output tokens per row) and logprobs 5. Logits are random
normal times 4 (peaked like a trained model's) or times 0.5 (nearly flat, like a random model's: most of the
vocabulary is in the top-p set). Prints a markdown table of the median of ``--repeats`` calls.

    PYTHONPATH=. python -m benchmarks.sampling_step --rows 256 --vocab 32000 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cbrun.engine.core.plan import RowSampling
from cbrun.engine.core.request import Request
from cbrun.engine.sample.sampler import SamplingRow, TokenCounts, build_batch, sample
from cbrun.engine.sampling_params import SamplingParams

SETTINGS = {
    "greedy + logprobs 5": SamplingParams(logprobs=5),
    "temperature 0.8, top_p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "+ repetition_penalty 1.1, logprobs 5": SamplingParams(
        temperature=0.8, top_p=0.95, repetition_penalty=1.1, logprobs=5
    ),
}


def time_setting(params: SamplingParams, logits: torch.Tensor, repeats: int) -> float:
    """Median ms of one ``sample`` call over ``logits`` (the batch built once, as a step's would be)."""
    rows, vocab = logits.shape
    gen = torch.Generator().manual_seed(0)
    requests = []
    for i in range(rows):
        request = Request(i, torch.randint(0, vocab, (32,), generator=gen).tolist(), params, seed=i)
        request.output_token_ids = torch.randint(0, vocab, (64,), generator=gen).tolist()
        requests.append(SamplingRow(RowSampling.of(request), []))
    batch = build_batch(requests, TokenCounts(vocab, logits.device), frozenset(), logits.device)
    sample(logits, batch).to_host()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sample(logits, batch).to_host()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(1)
    noise = torch.randn(args.rows, args.vocab, generator=gen)
    print(
        f"rows {args.rows}, vocab {args.vocab}, {args.threads} threads, device {args.device}, "
        f"median of {args.repeats}\n"
    )
    print("| setting | peaked logits (x4) ms | flat logits (x0.5) ms |")
    print("|---|---|---|")
    for name, params in SETTINGS.items():
        cells = [f"{time_setting(params, (noise * scale).to(args.device), args.repeats):.1f}" for scale in (4.0, 0.5)]
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
