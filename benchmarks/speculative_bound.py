"""How many steps n-gram speculation could save at best on a workload, with verification free.

Usage (from the repo root; about a minute of CPU; results in ``benchmarks/results-speculative-bound.md``):
    PYTHONPATH=. python -m benchmarks.speculative_bound [--workload story-repeat] [--batches 1,8] [--out FILE]

The requests of ``cbrun bench --workload speculative`` are run once with speculation off (stories260K, greedy, stop
token 1). Greedy speculation commits exactly those outputs, so each request's verify steps can be replayed from its
output alone: at a step, a proposal rule proposes up to ``k`` tokens from the request's known tokens, the accepted
ones are the leading proposals equal to the output, and the step commits them plus one. Verification costs nothing
here (no row cost, a proposal at every step), so a rule's step count is a lower bound for any cost rule that
proposes with it. Steps per run are those of FIFO admission into ``max_requests_per_batch`` slots, a prefill step
per request first (what the engine's runs take when prompts fit one step's budget): at batch 1 the sum over
requests, at batch B the makespan. ``off`` is one token per step.

The rules (n-gram lengths 2..4 unless named):

- latest: the longest suffix n-gram with an earlier occurrence, its latest occurrence (the engine's rule with ``ngram_min = 2``);
- first: the same n, its first occurrence;
- longest: the longest suffix match of any length (not capped at 4), its latest occurrence;
- latest, n >= 1: the engine's rule down to single-token matches (``ngram_min = 1``, the engine's default);
- oracle: among every earlier occurrence of every suffix n-gram (n = 1..4), the one whose continuation the output
  follows longest (what no lookup can beat without knowing the output).

What it bounds: generated tokens/s with speculation over tokens/s without is (off steps / speculative steps) x
(a plain step's mean time / a verify step's mean time). The second factor is about 1 at best (a verify step runs
the same requests plus their proposal rows), so the step ratio printed here caps the speed-up any cost rule can
reach with that lookup and ``k``; the engine's rule proposes only where proposals pay, so it takes more steps than
its row here (compare the ``steps`` column of ``benchmarks/results-speculative.md``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

from cbrun.bench.speculative import BOS, gsm8k_requests, num_requests, story_repeat_requests

KS = (4, 8, 16)


def _occurrences(seq: list[int], t: int, n: int) -> list[int]:
    """Ends (exclusive, < t) of the earlier occurrences of the n tokens before position t, oldest first."""
    suffix = seq[t - n : t]
    return [end for end in range(n, t) if seq[end - n : end] == suffix]


def _accepted(seq: list[int], t: int, proposal: list[int], end: int) -> int:
    """Leading proposals equal to ``seq[t:end]`` (greedy acceptance against the known output)."""
    a = 0
    while a < len(proposal) and t + a < end and proposal[a] == seq[t + a]:
        a += 1
    return a


def _by_length(low: int, high: int | None, pick):
    def rule(seq, t, k):
        top = min(high or t - 1, t - 1)
        for n in range(top, low - 1, -1):
            found = _occurrences(seq, t, n)
            if found:
                end = pick(found)
                return seq[end : end + k]
        return []

    return rule


def _longest(seq, t, k):
    best = None
    for n in range(2, t):
        found = _occurrences(seq, t, n)
        if not found:
            break
        best = found[-1]
    return seq[best : best + k] if best is not None else []


def _oracle(seq, t, k):
    best, most = [], -1
    for n in range(1, 5):
        for end in _occurrences(seq, t, n):
            proposal = seq[end : end + k]
            accepted = _accepted(seq, t, proposal, len(seq))
            if accepted > most:
                best, most = proposal, accepted
    return best


RULES = {
    "latest": _by_length(2, 4, lambda f: f[-1]),
    "first": _by_length(2, 4, lambda f: f[0]),
    "longest": _longest,
    "latest, n >= 1": _by_length(1, 4, lambda f: f[-1]),
    "oracle": _oracle,
}


def decode_steps(prompt: list[int], output: list[int], rule, k: int) -> int:
    """Verify steps after the prefill step (which commits the first output token) under free verification."""
    seq, t, end, steps = prompt + output, len(prompt) + 1, len(prompt) + len(output), 0
    while t < end:
        room = min(k, end - t - 1)
        proposal = rule(seq, t, room) if room > 0 else []
        t += _accepted(seq, t, proposal, end) + 1
        steps += 1
    return steps


def fifo_steps(decode: list[int], slots: int) -> int:
    """Steps of a run: requests admitted in order into ``slots``, each taking a prefill step then its decodes."""
    free_at = [0] * slots
    for steps in decode:
        slot = min(range(slots), key=free_at.__getitem__)
        free_at[slot] += 1 + steps
    return max(free_at)


def greedy_outputs(requests, model_dir: Path) -> list[list[int]]:
    """Each request's greedy output with speculation off."""
    import torch

    from cbrun.engine import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(str(model_dir), EngineConfig(max_requests_per_batch=128, num_threads=1))
    triples = [(i, p, SamplingParams(max_new_tokens=m, stop_token_ids=(BOS,))) for i, p, m in requests]
    outputs = {o.request_id: o.output_token_ids for o in engine.generate(triples, max_in_flight=len(triples))}
    return [outputs[i] for i in range(len(requests))]


def _header(args) -> str:
    """The results file's title, command, commit, date and load."""
    from cbrun.bench.measure import git_commit

    command = f"python -m benchmarks.speculative_bound --workload {args.workload} --batches {args.batches}"
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"# Speculation step bound: {args.workload} (verification free)\n\n"
        f"Command: `{command} --out {args.out}` (`benchmarks/speculative_bound.py`; its docstring defines the "
        f"rules and what the bound means). Commit {git_commit()}, {date}; load average {load} at the end "
        f"(step counts do not depend on it). Each cell: steps of the run and off's steps over them.\n\n"
    )


def main(argv: list[str] | None = None) -> int:
    """Print (and with ``--out`` write) each rule's and ``k``'s steps per batch; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="story-repeat", choices=("story-repeat", "gsm8k-stories260k"))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--model-dir", type=Path, default=Path("models/stories260K"))
    p.add_argument("--shared", type=Path)
    p.add_argument("--out", type=Path, help="also write the Markdown table here")
    args = p.parse_args(argv)
    lines = [
        "| rule | k | "
        + " | ".join(f"steps at batch {b} (speed-up bound)" for b in map(int, args.batches.split(",")))
        + " |",
        "|---|---|" + "---|" * len(args.batches.split(",")),
    ]
    off_row, rows = [], []
    for batch in map(int, args.batches.split(",")):
        n = num_requests(args.workload, batch)
        if args.workload == "story-repeat":
            requests = story_repeat_requests(n, args.shared)
        else:
            with tempfile.TemporaryDirectory(prefix="cbrun-bound-") as scratch:
                requests = gsm8k_requests(n, args.model_dir, Path(scratch), args.shared)
        outputs = greedy_outputs(requests, args.model_dir)
        off = fifo_steps([len(o) - 1 for o in outputs], batch)
        off_row.append(f"{off}")
        for name, rule in RULES.items():
            for k in KS:
                steps = fifo_steps([decode_steps(r[1], o, rule, k) for r, o in zip(requests, outputs)], batch)
                rows.append((name, k, batch, steps, off / steps))
    lines.append("| off | | " + " | ".join(off_row) + " |")
    for name in RULES:
        for k in KS:
            cells = [f"{s} ({x:.2f}x)" for (r, kk, b, s, x) in rows if r == name and kk == k]
            lines.append(f"| {name} | {k} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(_header(args) + table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
