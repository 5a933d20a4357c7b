"""Run one workload through vLLM's offline ``LLM`` and write its outputs and timings: ``cbrun bench``'s ``vllm``
backend, executed by vLLM's own interpreter (``--vllm-python``), never imported by cbrun.

Usage: ``VLLM_PYTHON vllm_runner.py REQUEST.json RESULT.json``. It imports only the standard library and vLLM (and
psutil, which comes with vLLM), so it runs in an environment that has neither cbrun nor pyarrow. Linux only
(CPU time and memory are read from /proc).

The request (written by ``cbrun.bench.vllm_backend``)::

    {"model_dir": str, "prompts": [[int, ...], ...], "max_tokens": [int, ...], "ignore_eos": bool,
     "stop_token_ids": [int, ...], "seed": int, "llm_kwargs": {str: value}}

The result (``RESULT_KEYS``)::

    {"outputs": [[int, ...], ...],          # per row, generated ids, in the request's row order
     "wall_s": float,                        # LLM.generate: first request handed over to the last output
     "cpu_s": float,                         # user + system CPU s of this process and its children over that span
     "init_s": float,                        # LLM(...): model load, KV cache, compile and warm-up
     "first_token_s": [float | null, ...],   # per row, from the generate start (null where vLLM gives no metrics)
     "finish_s": [float | null, ...],
     "rss_base_mib": float,                  # resident MiB of the process tree after importing vLLM
     "rss_peak_mib": float,                  # sum of the tree's peak resident MiB (VmHWM) after generate
     "versions": {"vllm": str, "torch": str, "transformers": str},
     "config": {"max_num_seqs": int, "max_num_batched_tokens": int, "env": {str: str}}}

All greedy (``temperature=0``), ``detokenize=False``, and the tokenizer is never loaded (``skip_tokenizer_init``):
the model directory needs no tokenizer. The threads and KV-cache size come from the environment the parent sets,
as vLLM's CPU documentation says: ``VLLM_CPU_OMP_THREADS_BIND`` (cores for the OpenMP threads, e.g. ``0`` or
``0-1``) and ``VLLM_CPU_KVCACHE_SPACE`` (GiB).
"""

from __future__ import annotations

import json
import os
import sys
import time

#: Keys every result file has (``cbrun.bench.vllm_backend`` checks them).
RESULT_KEYS = (
    "outputs",
    "wall_s",
    "cpu_s",
    "init_s",
    "first_token_s",
    "finish_s",
    "rss_base_mib",
    "rss_peak_mib",
    "versions",
    "config",
)
#: Environment variables copied into the result, so the JSON says how vLLM was set up.
REPORTED_ENV = (
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "OMP_NUM_THREADS",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_USE_AOT_COMPILE",
)


def _process_tree() -> list[int]:
    """Pids of this process and its live descendants (vLLM V1 runs its engine core and worker as children).

    NOTE: psutil comes with vLLM; without it (an environment that only fakes vLLM) the tree is this process.
    """
    try:
        import psutil
    except ImportError:
        return [os.getpid()]
    me = psutil.Process()
    return [me.pid, *(child.pid for child in me.children(recursive=True))]


def tree_cpu_s() -> float:
    """User plus system CPU seconds of the process tree, all threads (live processes only), from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in _process_tree():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14 and 15 of stat)
    return total


def tree_rss_mib(peak: bool) -> float:
    """Sum over the process tree of resident MiB: current (``VmRSS``) or peak (``VmHWM``)."""
    field = "VmHWM:" if peak else "VmRSS:"
    total = 0.0
    for pid in _process_tree():
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024
        except (OSError, StopIteration, ValueError):
            continue
    return total


def _request_times(output, start_monotonic: float) -> tuple[float | None, float | None]:
    """(first token, finish) seconds from the generate start, from vLLM's per-request metrics when it keeps them.

    NOTE: vLLM stamps them with ``time.monotonic()``, the clock ``start_monotonic`` is read from; where its
    ``RequestOutput`` carries no such metrics (it varies by version) both are None and the report says "n/a".
    """
    metrics = getattr(output, "metrics", None)
    first = getattr(metrics, "first_token_ts", None) or getattr(metrics, "first_token_time", None)
    last = getattr(metrics, "last_token_ts", None) or getattr(metrics, "last_token_time", None)
    rel = lambda t: t - start_monotonic if isinstance(t, (int, float)) and t > 0 else None  # noqa: E731
    return rel(first), rel(last)


def run(request: dict) -> dict:
    """Build ``vllm.LLM`` on ``request["model_dir"]``, generate every row greedily, and return the result dict."""
    import vllm
    from vllm import LLM, SamplingParams

    rss_base = tree_rss_mib(peak=False)
    init_start = time.perf_counter()
    llm = LLM(
        model=request["model_dir"],
        dtype="float32",
        seed=request["seed"],
        skip_tokenizer_init=True,
        **request.get("llm_kwargs", {}),
    )
    init_s = time.perf_counter() - init_start
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=m,
            ignore_eos=request["ignore_eos"],
            stop_token_ids=request["stop_token_ids"] or None,
            detokenize=False,
        )
        for m in request["max_tokens"]
    ]
    prompts = [{"prompt_token_ids": p} for p in request["prompts"]]
    cpu_start, start, start_monotonic = tree_cpu_s(), time.perf_counter(), time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s, cpu_s = time.perf_counter() - start, tree_cpu_s() - cpu_start
    times = [_request_times(o, start_monotonic) for o in outputs]
    return dict(
        outputs=[list(o.outputs[0].token_ids) for o in outputs],
        wall_s=wall_s,
        cpu_s=cpu_s,
        init_s=init_s,
        first_token_s=[t[0] for t in times],
        finish_s=[t[1] for t in times],
        rss_base_mib=rss_base,
        rss_peak_mib=tree_rss_mib(peak=True),
        versions=_versions(vllm),
        config=_config(llm),
    )


def _versions(vllm) -> dict:
    import torch
    import transformers

    return {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def _config(llm) -> dict:
    """The scheduler limits vLLM chose (its defaults unless ``llm_kwargs`` set them) and the CPU environment."""
    scheduler = getattr(getattr(llm.llm_engine, "vllm_config", None), "scheduler_config", None)
    return {
        "max_num_seqs": getattr(scheduler, "max_num_seqs", None),
        "max_num_batched_tokens": getattr(scheduler, "max_num_batched_tokens", None),
        "env": {k: os.environ[k] for k in REPORTED_ENV if k in os.environ},
    }


def main(argv: list[str]) -> int:
    """``vllm_runner.py REQUEST.json RESULT.json``; returns 0, or 2 on a usage error (other errors raise)."""
    if len(argv) != 2:
        print("usage: vllm_runner.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        request = json.load(f)
    result = run(request)
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
