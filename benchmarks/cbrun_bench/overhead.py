"""``cbrun bench --workload engine-overhead``: host time per engine step on a model whose forward costs next to
nothing.

The model is a random Llama of one layer, hidden size 16 and a 64-token vocabulary, run through the engine's real
path (scheduler, input preparation, the lean forward pass, sampling, bookkeeping). For each ``--running N`` the
engine takes ``max_requests_per_batch = N`` and ``max_batch_tokens = N + --prefill-tokens``, and ``--waves x N``
requests with prompts of ``--prompt-len`` tokens and ``--new-tokens`` generated tokens (``ignore_eos``, greedy), so
that after the first wave every step mixes decodes with the prefills of requests taking finished ones' places.

Each phase is timed by wrapping the engine's own methods with ``CLOCK``: the CPU time of this thread
(``time.thread_time``; the engine runs on one thread here, so it is the step's work without the time other
processes of a shared machine take from it; ``--clock wall`` uses ``time.perf_counter`` instead):

- schedule: ``Scheduler.schedule`` (the plan: admissions, block allocation);
- prepare inputs: ``ModelRunner._prepare`` plus ``ModelRunner._upload`` (flattened ids, positions, slot mapping,
  block tables, attention metadata);
- forward: ``ModelRunner._forward`` (the model; near zero by construction, reported so it can be subtracted);
- read results: ``LLMEngine._resolve`` (tokens to requests, stop checks, finished requests);
- other: the rest of ``LLMEngine.step`` (zeroing new cache pages, argmax, stats, output objects).

Host time is the step minus the forward pass. The table gives per-step means over the steps after the first
``--skip`` (warm-up), and host microseconds per scheduled request (host time / requests in the step, averaged
over steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

#: The near-free model: one layer, tiny hidden size and vocabulary.
OVERHEAD_MODEL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
#: The timed phases: table name -> (object path from the engine, method name).
PHASES = {"schedule": ("scheduler", "schedule"), "prepare": ("model_runner", "_prepare"),
          "upload": ("model_runner", "_upload"), "forward": ("model_runner", "_forward"), "read": ("", "_resolve")}


#: The clock of every measurement: CPU seconds of the calling thread (see the module docstring).
CLOCK = time.thread_time


class PhaseTimer:
    """Wraps the engine methods of ``PHASES`` on the instance; accumulates seconds per phase for the current step."""

    def __init__(self, engine) -> None:
        self.current = dict.fromkeys(PHASES, 0.0)
        self.scheduled = 0  # requests in the last plan
        for phase, (owner, name) in PHASES.items():
            target = getattr(engine, owner) if owner else engine
            method = getattr(target, name, None)
            if method is None:
                raise RuntimeError(f"engine-overhead: {type(target).__name__}.{name} is gone; update "
                                   f"benchmarks.cbrun_bench.overhead.PHASES")
            setattr(target, name, self._timed(phase, method))

    def _timed(self, phase: str, method):
        def wrapper(*args, **kwargs):
            start = CLOCK()
            result = method(*args, **kwargs)
            self.current[phase] += CLOCK() - start
            if phase == "schedule":
                self.scheduled = len(result.scheduled)
            return result
        return wrapper

    def take(self) -> tuple[dict[str, float], int]:
        """This step's seconds per phase and its scheduled requests; starts the next step at zero."""
        taken, self.current = self.current, dict.fromkeys(PHASES, 0.0)
        return taken, self.scheduled


def build_model(out_dir: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**OVERHEAD_MODEL)).save_pretrained(out_dir)
    return out_dir


def measure(model_dir: Path, running: int, args) -> dict:
    """Run ``args.waves * running`` requests with ``running`` slots; per-step phase times after ``args.skip`` steps."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(max_requests_per_batch=running, max_batch_tokens=running + args.prefill_tokens,
                          num_threads=1, page_size=16)
    engine = LLMEngine.from_pretrained(str(model_dir), config)
    g = torch.Generator().manual_seed(running)
    for i in range(args.waves * running):
        # Staggered lengths: requests finish at different steps, so admissions spread over the run.
        new_tokens = int(torch.randint(args.new_tokens // 2, args.new_tokens + 1, (1,), generator=g))
        prompt = torch.randint(0, OVERHEAD_MODEL["vocab_size"], (args.prompt_len,), generator=g).tolist()
        engine.add_request(i, prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    timer = PhaseTimer(engine)
    steps = []
    while engine.has_unfinished_requests():
        start = CLOCK()
        engine.step()
        total = CLOCK() - start
        phases, scheduled = timer.take()
        if scheduled:
            steps.append((total, phases, scheduled))
    return _summarize(steps[args.skip:], running)


def _summarize(steps, running: int) -> dict:
    """Means over steps, in microseconds; ``steps`` holds (step seconds, seconds per phase, scheduled requests)."""
    us = 1e6
    mean = lambda values: statistics.fmean(values) * us  # noqa: E731
    totals = [t for t, _, _ in steps]
    phase = {name: [p[name] for _, p, _ in steps] for name in PHASES}
    host = [t - p["forward"] for t, p, _ in steps]
    row = dict(running=running, steps=len(steps), step_us=mean(totals), forward_us=mean(phase["forward"]),
               schedule_us=mean(phase["schedule"]), prepare_us=mean([a + b for a, b in zip(phase["prepare"],
                                                                                       phase["upload"])]),
               read_us=mean(phase["read"]), host_us=mean(host))
    row["other_us"] = row["host_us"] - row["schedule_us"] - row["prepare_us"] - row["read_us"]
    row["scheduled_per_step"] = statistics.fmean(n for _, _, n in steps)
    row["host_us_per_request"] = statistics.fmean(h / n for h, (_, _, n) in zip(host, steps)) * us
    return row


def format_table(rows: list[dict]) -> str:
    columns = ("running", "steps", "sched. req/step", "step us", "forward us", "host us", "schedule us",
               "prepare inputs us", "read results us", "other us", "host us / sched. req")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [r["running"], r["steps"], f"{r['scheduled_per_step']:.0f}", f"{r['step_us']:.0f}",
                 f"{r['forward_us']:.0f}", f"{r['host_us']:.0f}", f"{r['schedule_us']:.0f}",
                 f"{r['prepare_us']:.0f}", f"{r['read_us']:.0f}", f"{r['other_us']:.0f}",
                 f"{r['host_us_per_request']:.1f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cbrun bench --workload engine-overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--running", default="128,512", help="running requests (max_requests_per_batch), comma-separated")
    p.add_argument("--waves", type=int, default=3, help="requests = waves x running")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=int, default=64, help="generated tokens per request, drawn in [n/2, n]")
    p.add_argument("--prefill-tokens", type=int, default=256, help="max_batch_tokens beyond one decode per slot")
    p.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="cpu: this thread's CPU time (default, steady on a shared machine); wall: perf_counter")
    p.add_argument("--json", type=Path, help="also write the rows as JSON to this path")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    running = [int(n) for n in args.running.split(",")]
    with tempfile.TemporaryDirectory(prefix="cbrun-overhead-") as tmp:
        model_dir = build_model(Path(tmp))
        rows = [measure(model_dir, n, args) for n in running]
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
