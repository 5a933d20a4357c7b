"""The grammar mask's own time per step at (rows, vocab): our C kernel against xgrammar's CPU kernel.

Two operations, each timed round-robin over ``--repeats`` rounds (median ms):

- masked argmax (greedy rows under a grammar): PyTorch's path, a masked copy of the rows with xgrammar's
  ``apply_token_bitmask_inplace`` then ``max``, against ``cbrun.kernels.cpu_token_mask.masked_argmax_cpu`` (one read,
  nothing written);
- masking in place (sampled rows under a grammar): xgrammar's ``apply_token_bitmask_inplace`` against
  ``apply_token_bitmask_cpu``, on a fresh copy of the logits each time (the copy is timed apart and left out).

The bitmask mixes the kinds of rows a JSON-schema batch has: a third "inside a string" (every word allowed but a
few: quotes, control characters), a third "a key or an enum" (a handful of tokens), a third random words. Prints a
markdown table; ``--check`` also asserts both paths agree.

    PYTHONPATH=. python -m benchmarks.structured_mask --rows 256 --vocab 32000 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cbrun.kernels.cpu_token_mask import apply_token_bitmask_cpu, masked_argmax_cpu


def make_bitmask(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """(rows, ceil(vocab / 32)) int32 in xgrammar's layout, a third of each kind of row (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    words = -(-vocab // 32)
    bitmask = torch.zeros(rows, words, dtype=torch.int32)
    for i in range(rows):
        if i % 3 == 0:  # inside a string: all but a few words
            bitmask[i] = -1
            bitmask[i, torch.randint(0, words, (8,), generator=gen)] = 0x0FFF0FFF
        elif i % 3 == 1:  # a key or an enum value: a handful of tokens
            for token in torch.randint(0, vocab, (6,), generator=gen).tolist():
                bitmask[i, token // 32] |= 1 << (token % 32) if token % 32 < 31 else -(2**31)
        else:
            bitmask[i] = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, generator=gen)
    return bitmask


def torch_masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor) -> list[int]:
    import xgrammar

    scores = logits.clone()
    xgrammar.apply_token_bitmask_inplace(scores, bitmask, vocab_size=scores.shape[1])
    return scores.max(dim=1).indices.tolist()


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def measure(rows: int, vocab: int, repeats: int, check: bool) -> dict[str, float]:
    """Median ms of each path (round-robin over ``repeats`` rounds)."""
    import xgrammar

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) * 4
    bitmask = make_bitmask(rows, vocab)
    all_rows = list(range(rows))
    if check:
        assert torch_masked_argmax(logits, bitmask) == masked_argmax_cpu(logits, all_rows, bitmask)
        ours, theirs = logits.clone(), logits.clone()
        apply_token_bitmask_cpu(ours, all_rows, bitmask)
        xgrammar.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab)
        assert torch.equal(ours, theirs)
    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        copies = [logits.clone(), logits.clone()]
        paths = {
            "masked argmax: xgrammar mask on a copy + max": lambda: torch_masked_argmax(logits, bitmask),
            "masked argmax: C kernel": lambda: masked_argmax_cpu(logits, all_rows, bitmask),
            "mask in place: xgrammar": lambda: xgrammar.apply_token_bitmask_inplace(
                copies[0], bitmask, vocab_size=vocab
            ),
            "mask in place: C kernel": lambda: apply_token_bitmask_cpu(copies[1], all_rows, bitmask),
            "(a copy of the logits)": lambda: logits.clone(),
        }
        for name, fn in paths.items():
            times.setdefault(name, []).append(_ms(fn))
    return {name: statistics.median(values) for name, values in times.items()}


def device_check(device: str, bench, rows: int = 256, vocab: int = 32000) -> list[tuple[str, bool, bool, float]]:
    """The engine's masked argmax (``cbrun.engine.structured_output.bitmask.masked_argmax``) on ``device``, per dtype,
    against the same function on the same values on the CPU (the C kernel there), row by row (the GPU suite's
    structured part).

    Args:
        device: where the logits and bitmask live ("cuda" in the suite).
        bench: ``fn -> median ms`` (``cbrun.kernels.gpu_check.cuda_bench`` on CUDA).

    Returns:
        Per dtype: (dtype name, whether every row's token is allowed and holds the row's largest allowed value
        (bf16 rows tie often; a device may break a tie elsewhere), whether every token is the CPU's own, median ms
        of a call, a copy of the rows included since the call masks them in place).
    """
    from cbrun.engine.sample.sampler import allowed_tokens
    from cbrun.engine.structured_output.bitmask import masked_argmax

    base = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2)) * 4
    bitmask = make_bitmask(rows, vocab)
    allowed = allowed_tokens(bitmask, vocab)
    on_device = bitmask.to(device)
    every = list(range(rows))
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        logits = base.to(device, dtype)
        values = logits.float().cpu()
        oracle = masked_argmax(values, every, bitmask)  # the C kernel where it builds, else the PyTorch path
        got = masked_argmax(logits.clone(), every, on_device)
        ok = all(
            (g is None and o is None)
            or (g is not None and o is not None and bool(allowed[r, g]) and values[r, g] == values[r, o])
            for r, (g, o) in enumerate(zip(got, oracle))
        )
        ms = bench(lambda: masked_argmax(logits.clone(), every, on_device))
        out.append((str(dtype).removeprefix("torch."), ok, got == oracle, ms))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--check", action="store_true", help="assert both paths agree first")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(args.rows, args.vocab, args.repeats, args.check)
    print(f"{args.rows} rows x {args.vocab} vocab, {args.threads} threads, median of {args.repeats} rounds\n")
    print("| path | ms |\n|---|---:|")
    for name, ms in result.items():
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()
