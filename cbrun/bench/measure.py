"""What ``cbrun bench`` measures, the same way for every backend: clocks, memory, FLOPs, the machine.

- Wall time runs from the first request handed to the backend to the last output; model loading, cbrun/engine/cache
  construction and transformers' CB warm-up are excluded. Every request counts as arriving at that start (an
  offline job queues all its rows at once), so TTFT includes queueing.
- TTFT: first token time minus the run start. cbrun: ``arrival_time + ttft_s``; hf-cb: its per-token timestamps
  (``record_timestamps``); hf-generate: a stopping criterion timestamps every decoding step of the batch.
- ITL: per request, (finish time - first token time) / (tokens - 1), requests with >= 2 tokens; the table gives
  the median and p99 over requests.
- CPU time: ``time.process_time`` over the run (all threads). On a shared machine it is steadier than wall time;
  wall time is what the throughput columns use.
- Peak memory: each backend run (each setting of a sweep too) happens in a fresh process (multiprocessing, spawn).
  After imports and a warm-up on a tiny model, the process's peak-RSS mark is reset (``/proc/self/clear_refs``,
  Linux) and its RSS read as the base; at the end the peak (``VmHWM``) is read. The table gives the peak and, in
  "+", peak minus base: what the workload's model, KV cache and activations add. Where the mark cannot be reset,
  the peak is ``ru_maxrss`` (which then includes the warm-up). ``--no-isolate`` runs everything in this process
  instead (faster; memory then reads "n/a").
- Useful FLOP/s: 2 x (non-embedding decoder parameters) per prompt-or-generated token fed to the model, plus
  2 x (LM head) per sampled token, plus causal attention (4 x heads x head_dim per attended position per layer),
  divided by wall time. Padding and recomputation are not counted: it is the work the rows need. Prompt tokens
  served from a prefix cache are counted (the same numerator for every backend), so on ``gsm8k-fewshot`` sharing
  shows as more useful FLOP/s than the model ran. The ceiling is the best of a few fp32 ``torch.matmul`` of
  2048 x 2048 at the same thread count.
- Cached prompt tokens (hit rate): the cbrun backends' ``cbrun.engine.core.stats.num_cached_prompt_tokens`` and its share of
  ``num_prompt_tokens``; "n/a" for transformers.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class RunResult:
    """One backend's run of a workload.

    Attributes:
        backend: backend name.
        setting: e.g. "batch 32" for static backends, "" otherwise.
        outputs: per row, generated ids cut as cbrun cuts them.
        wall_s: seconds from the first request to the last output.
        cpu_s: process CPU seconds (all threads) over the same span.
        first_token_s: per row, seconds from the run start to its first token (None without one).
        finish_s: per row, seconds from the run start to its last token.
        computed_tokens: tokens run through the model, padding and recomputation included (None when unknown).
        rss_base_mib: RSS of the backend's process after imports and warm-up, before its model (None in-process).
        rss_peak_mib: peak resident set size of the backend's process (``ru_maxrss``; None in-process).
        load_avg: 1-minute load average before and after the run.
        info: backend facts for the JSON (cbrun backends: engine stats and KV blocks).
        repeat: which round of ``--repeats`` this run belongs to, from 1.
    """

    backend: str
    setting: str
    outputs: list[list[int]]
    wall_s: float
    cpu_s: float
    first_token_s: list[float | None]
    finish_s: list[float | None]
    computed_tokens: int | None = None
    rss_base_mib: float | None = None
    rss_peak_mib: float | None = None
    load_avg: tuple[float, float] = (0.0, 0.0)
    info: dict = field(default_factory=dict)
    repeat: int = 1


def current_rss_mib() -> float:
    """Resident set size of this process in MiB, from ``/proc/self/statm`` (0 where it is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark (``VmHWM``) to its current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """Peak resident set size (``VmHWM``) since the last reset, in MiB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def measure_matmul_gflops(n: int = 2048, repeats: int = 10) -> float:
    """Best fp32 ``torch.matmul`` throughput of two n x n matrices over ``repeats`` runs, in GFLOP/s."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def timed(backend: str, setting: str, run, computed_tokens) -> RunResult:
    """Run ``run() -> (ids, absolute first times, absolute finish times)`` under the wall and CPU clocks."""
    load_before = os.getloadavg()[0]
    cpu_start, start = time.process_time(), time.perf_counter()
    ids, first, finish = run()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    rel = lambda times: [t - start if t is not None else None for t in times]  # noqa: E731
    return RunResult(
        backend,
        setting,
        ids,
        wall,
        cpu,
        rel(first),
        rel(finish),
        computed_tokens(),
        load_avg=(load_before, os.getloadavg()[0]),
    )


@dataclass
class ModelCost:
    """FLOPs per token of a decoder: linear layers, LM head, and attention per attended position."""

    decoder_params: int
    lm_head_params: int
    attention_per_position: int
    total_params: int

    @classmethod
    def of(cls, model_dir: Path) -> "ModelCost":
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv = c.num_key_value_heads * head_dim
        q = c.num_attention_heads * head_dim
        per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
        lm_head = c.vocab_size * c.hidden_size
        total = c.num_hidden_layers * per_layer + lm_head * (1 if c.tie_word_embeddings else 2) + c.hidden_size
        return cls(c.num_hidden_layers * per_layer, lm_head, 4 * q * c.num_hidden_layers, total)

    def useful_flops(self, prompts: list[list[int]], outputs: list[list[int]]) -> float:
        flops = 0.0
        for prompt, out in zip(prompts, outputs):
            fed = len(prompt) + max(len(out) - 1, 0)  # the last generated token is never fed back
            flops += 2 * self.decoder_params * fed + 2 * self.lm_head_params * len(out)
            flops += self.attention_per_position * fed * (fed + 1) / 2
        return flops


def machine_info(threads: int) -> dict:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    import transformers

    return dict(
        cpu=model,
        cores=os.cpu_count(),
        torch_threads=threads,
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        commit=git_commit(),
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    )


def git_commit() -> str | None:
    """The repo's HEAD commit, with "+dirty" when tracked files changed (None outside a git checkout)."""
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")
