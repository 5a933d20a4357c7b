"""``cbrun bench --workload engine-overhead``: host time per engine step on a model whose forward costs next to
nothing.

The model is a random Llama of one layer, hidden size 16 and a 64-token vocabulary, run through the engine's real
path (scheduler, input preparation, the lean forward pass, sampling, bookkeeping). For each ``--running N`` the
engine takes ``max_requests_per_batch = N`` and ``max_batch_tokens = N + --prefill-tokens``. Two scenarios:

- mixed: ``--waves x N`` requests with prompts of ``--prompt-len`` tokens and ``--new-tokens`` generated tokens
  (drawn in [n/2, n], ``ignore_eos``, greedy), so that after the first wave every step mixes decodes with the
  prefills of requests taking finished ones' places;
- decode: N requests of ``--prompt-len`` prompt tokens each decoding ``--decode-steps`` steps after every prompt is
  in the cache: every step decodes N requests, nothing joins or leaves.

Each phase is timed by wrapping the engine's own methods with ``CLOCK``: the CPU time of this thread
(``time.thread_time``; the engine runs on one thread here, so it is the step's work without the time other
processes of a shared machine take from it; ``--clock wall`` uses ``time.perf_counter`` instead):

- schedule: ``Scheduler.schedule`` (the plan: admissions, block allocation);
- prepare inputs: ``StepInputBuilder.prepare`` plus ``ModelRunner._upload`` (flattened ids, positions, slot mapping,
  block tables from the persistent batch, attention metadata);
- forward: ``ModelRunner._forward`` (the model; near zero by construction, reported so it can be subtracted);
- read results: ``StepSampler.read`` plus ``Scheduler.update_from_output`` (the step's StepOutput read and applied by
  the scheduler: stop checks, finished requests);
- other: the rest of ``LLMEngine.step`` (zeroing new cache pages, the argmax, advancing requests, stats, output
  objects).

Host time is the step minus the forward pass. The table gives per-step means over the steps after the first
``--skip`` (warm-up), and host microseconds per scheduled request: the sum of host time over those steps divided by
the sum of their scheduled requests (and the same split by phase). With ``--repeats R`` every (scenario, running)
pair runs R times round-robin and each cell is the median of its R values.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from cbrun.bench.report import markdown_table

#: The near-free model: one layer, tiny hidden size and vocabulary.
OVERHEAD_MODEL = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=1024,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
#: The timed phases: table name -> the (dotted object path from the engine, method name) pairs timed as that phase.
PHASES = {
    "schedule": (("scheduler", "schedule"),),
    "prepare": (("model_runner.step_inputs", "prepare"),),
    "upload": (("model_runner", "_upload"),),
    "forward": (("model_runner", "_forward"),),
    "read": (("sampler", "read"), ("scheduler", "update_from_output")),
}


#: The clock of every measurement: CPU seconds of the calling thread (see the module docstring).
CLOCK = time.thread_time


class PhaseTimer:
    """Wraps the engine methods of ``PHASES`` on the instance; accumulates seconds per phase for the current step."""

    def __init__(self, engine) -> None:
        self.current = dict.fromkeys(PHASES, 0.0)
        self.scheduled = 0  # requests in the last plan
        for phase, methods in PHASES.items():
            for owner, name in methods:
                target = functools.reduce(getattr, owner.split("."), engine)
                method = getattr(target, name, None)
                if method is None:
                    raise RuntimeError(
                        f"engine-overhead: {type(target).__name__}.{name} is gone; update cbrun.bench.overhead.PHASES"
                    )
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
    """The mixed scenario: ``args.waves * running`` requests with ``running`` slots; per-step phase times after
    ``args.skip`` steps."""
    engine = _engine(model_dir, running, args)
    from cbrun.engine import SamplingParams

    g = torch.Generator().manual_seed(running)
    for i in range(args.waves * running):
        # Staggered lengths: requests finish at different steps, so admissions spread over the run.
        new_tokens = int(torch.randint(args.new_tokens // 2, args.new_tokens + 1, (1,), generator=g))
        prompt = torch.randint(0, OVERHEAD_MODEL["vocab_size"], (args.prompt_len,), generator=g).tolist()
        engine.add_request(i, prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    steps = _run_timed(engine, lambda: engine.has_unfinished_requests())
    return _summarize(steps[args.skip :], running, "mixed")


def measure_decode(model_dir: Path, running: int, args) -> dict:
    """The decode scenario: ``running`` requests, timed over ``args.decode_steps`` steps once all decode."""
    from cbrun.engine import SamplingParams
    from cbrun.engine.core.request import RequestStatus

    engine = _engine(model_dir, running, args)
    g = torch.Generator().manual_seed(running)
    for i in range(running):
        prompt = torch.randint(0, OVERHEAD_MODEL["vocab_size"], (args.prompt_len,), generator=g).tolist()
        # Longer than the run: the engine is dropped with its requests unfinished.
        max_new_tokens = OVERHEAD_MODEL["max_position_embeddings"] - args.prompt_len
        engine.add_request(i, prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    while not all(r.status is RequestStatus.DECODING for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(args.skip):
        engine.step()
    remaining = iter(range(args.decode_steps))
    steps = _run_timed(engine, lambda: next(remaining, None) is not None)
    assert all(n == running for _, _, n in steps), "a decode step did not schedule every request"
    return _summarize(steps, running, "decode")


def _engine(model_dir: Path, running: int, args):
    from cbrun.engine import EngineConfig, LLMEngine

    config = EngineConfig(
        max_requests_per_batch=running, max_batch_tokens=running + args.prefill_tokens, num_threads=1, page_size=16
    )
    return LLMEngine.from_pretrained(str(model_dir), config)


def _run_timed(engine, go_on) -> list[tuple[float, dict, int]]:
    """Step while ``go_on()``; (step seconds, seconds per phase, scheduled requests) of each step that ran."""
    timer = PhaseTimer(engine)
    steps = []
    while go_on():
        start = CLOCK()
        engine.step()
        total = CLOCK() - start
        phases, scheduled = timer.take()
        if scheduled:
            steps.append((total, phases, scheduled))
    return steps


def _summarize(steps, running: int, scenario: str) -> dict:
    """Means over steps, in microseconds; ``steps`` holds (step seconds, seconds per phase, scheduled requests)."""
    us = 1e6
    mean = lambda values: statistics.fmean(values) * us  # noqa: E731
    totals = [t for t, _, _ in steps]
    phase = {name: [p[name] for _, p, _ in steps] for name in PHASES}
    phase["prepare"] = [a + b for a, b in zip(phase["prepare"], phase.pop("upload"))]
    host = [t - p["forward"] for t, p, _ in steps]
    scheduled = sum(n for _, _, n in steps)
    row = dict(
        scenario=scenario,
        running=running,
        steps=len(steps),
        step_us=mean(totals),
        forward_us=mean(phase["forward"]),
        schedule_us=mean(phase["schedule"]),
        prepare_us=mean(phase["prepare"]),
        read_us=mean(phase["read"]),
        host_us=mean(host),
    )
    row["other_us"] = row["host_us"] - row["schedule_us"] - row["prepare_us"] - row["read_us"]
    row["scheduled_per_step"] = scheduled / len(steps)
    row["host_us_per_request"] = sum(host) * us / scheduled
    for name in ("schedule", "prepare", "read"):
        row[f"{name}_us_per_request"] = sum(phase[name]) * us / scheduled
    return row


def median_rows(runs: list[list[dict]]) -> list[dict]:
    """Cell-wise medians of repeated runs (each a list of rows in the same order)."""
    rows = []
    for cells in zip(*runs):
        row = dict(cells[0])
        for key, value in row.items():
            if isinstance(value, float):
                row[key] = statistics.median(c[key] for c in cells)
        row["repeats"] = len(cells)
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    columns = (
        "scenario",
        "running",
        "steps",
        "sched. req/step",
        "step us",
        "forward us",
        "host us",
        "schedule us",
        "prepare inputs us",
        "read results us",
        "other us",
        "host us / sched. req",
        "per req.: schedule / prepare / read us",
    )
    table = []
    for r in rows:
        cells = [
            r["scenario"],
            r["running"],
            r["steps"],
            f"{r['scheduled_per_step']:.0f}",
            f"{r['step_us']:.0f}",
            f"{r['forward_us']:.0f}",
            f"{r['host_us']:.0f}",
            f"{r['schedule_us']:.0f}",
            f"{r['prepare_us']:.0f}",
            f"{r['read_us']:.0f}",
            f"{r['other_us']:.0f}",
            f"{r['host_us_per_request']:.1f}",
            f"{r['schedule_us_per_request']:.1f} / {r['prepare_us_per_request']:.1f} / {r['read_us_per_request']:.1f}",
        ]
        table.append(cells)
    return markdown_table(columns, table)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cbrun bench --workload engine-overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--running", default="128,512", help="running requests (max_requests_per_batch), comma-separated")
    p.add_argument("--scenarios", default="mixed,decode", help="comma-separated, from " + ", ".join(SCENARIOS))
    p.add_argument("--waves", type=int, default=3, help="mixed: requests = waves x running")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=int, default=64, help="mixed: generated tokens per request, drawn in [n/2, n]")
    p.add_argument("--decode-steps", type=int, default=60, help="decode: steps timed")
    p.add_argument("--prefill-tokens", type=int, default=256, help="max_batch_tokens beyond one decode per slot")
    p.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="R",
        help="run every (scenario, running) pair R times round-robin; each cell is the median",
    )
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: this thread's CPU time (default, steady on a shared machine); wall: perf_counter",
    )
    p.add_argument("--json", type=Path, help="also write the rows (medians and every run) as JSON to this path")
    p.add_argument("--output", type=Path, help="also write the table, command and machine as Markdown here")
    return p


#: Scenario name -> its measuring function.
SCENARIOS = {"mixed": measure, "decode": measure_decode}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    running = [int(n) for n in args.running.split(",")]
    scenarios = [name.strip() for name in args.scenarios.split(",")]
    unknown = [name for name in scenarios if name not in SCENARIOS]
    if unknown:
        print(f"cbrun bench: unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    load_start = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="cbrun-overhead-") as tmp:
        model_dir = build_model(Path(tmp))
        for repeat in range(args.repeats):
            runs.append([SCENARIOS[name](model_dir, n, args) for name in scenarios for n in running])
            print(f"[engine-overhead] repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    rows = median_rows(runs)
    table = format_table(rows)
    print(table)
    command = "cbrun bench --workload engine-overhead " + shlex.join(argv if argv is not None else sys.argv[1:])
    if args.json:
        args.json.write_text(json.dumps(dict(command=command, rows=rows, runs=runs), indent=2) + "\n", encoding="utf-8")
    if args.output:
        args.output.write_text(_markdown(command, table, load_start, os.getloadavg(), args), encoding="utf-8")
    return 0


def _markdown(command: str, table: str, load_start, load_end, args) -> str:
    """The results file: what ran, where, the table, and how to read it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    clock = "this thread's CPU time (`time.thread_time`)" if args.clock == "cpu" else "wall time"
    return f"""# Engine overhead: host time per step on a near-free model

Command: `{command}` (`cbrun/bench/overhead.py`; its docstring defines every column).
Commit {commit}, {time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}; {platform.machine()}, {os.cpu_count()} CPUs,
torch {torch.__version__}, one thread; load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end.
Each cell is the median of {args.repeats} round-robin repeat(s); times are {clock}, means over the timed steps.

{table}

- host = step - forward; other = host - schedule - prepare inputs - read results. Per scheduled request: the sum of
  host time over the timed steps divided by the sum of their scheduled requests.
- Targets (issue 19): at most 10 us of host time per scheduled request, and at most 2 ms of host time per step
  with 128 decoding requests (the decode row at 128).
"""


if __name__ == "__main__":
    sys.exit(main())
