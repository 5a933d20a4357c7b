"""CPU attention A/B: the PyTorch reference (gather pages, then SDPA) against the C kernel that reads them in place.

Usage (from the repo root; about 6 minutes on a quiet 2-core machine with the defaults):
    python -m benchmarks.cpu_attention --repeats 3 [--threads 1] [--out benchmarks/results-cpu-attention.md]
    python -m benchmarks.cpu_attention --kernel-only --repeats 5 [--out benchmarks/results-cpu-attention-kernel.md]

``--kernel-only`` (about 1 minute) times one attention call per shape instead of whole runs: the C kernel against
the reference on decode and prefill batches of random data, head_dim 8 to 128 (``KERNEL_SHAPES``), as the best of
``--repeats`` round-robin calls in thread CPU time (steadier than wall time on a shared machine).

``--paired OLD.c`` (a few minutes) compares two versions of the C kernel on the calls of real engine runs: it runs
each workload of ``PAIRED_WORKLOADS`` once through the engine (1 thread) and times every attention call with
both kernels, in alternating order, the caches evicted before each (in the engine the other layers' pages stream
through them between calls of one layer), and checks the two give equal outputs. Both see the same pages at the
same addresses, so the pair is immune to the load of a shared machine in a way two separate runs are not.

Workloads:
- ``random-llama-vllm``: issue 19's vLLM comparison: a random Llama (hidden 512, 8 layers, 8 heads, 4 KV heads,
  head_dim 64, intermediate 1408, vocab 512), 128 rows of random prompt ids (40-300 tokens), per-row
  ``max_tokens`` 16-256, ``ignore_eos``, greedy float32, 256 requests / 2048 tokens per step.
- ``gsm8k-stories260k``: ``cbrun bench``'s workload 1 (stories260K, 512 GSM8K questions, 128 requests / 512 tokens).

Each repeat runs every (workload, backend) pair once, round-robin, in this process; the table gives the median
generation-phase tokens/s (model loading excluded) and the ratio cpu / torch, and checks outputs equal token for
token between the backends.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams

BACKENDS = ("torch", "cpu")
VLLM_LLAMA = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1408,
    vocab_size=512,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def vllm_workload(model_dir: Path, rows: int = 128, seed: int = 0):
    """(model dir, requests, engine budgets) of the random-llama-vllm workload; builds the model when missing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (model_dir / "config.json").is_file():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            LlamaForCausalLM(LlamaConfig(**VLLM_LLAMA)).float().save_pretrained(model_dir)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VLLM_LLAMA["vocab_size"]) for _ in range(rng.randint(40, 300))] for _ in range(rows)]
    requests = [
        (i, p, SamplingParams(max_new_tokens=rng.randint(16, 256), ignore_eos=True)) for i, p in enumerate(prompts)
    ]
    return model_dir, requests, (256, 2048)


def stories_workload(scratch: Path):
    from cbrun.bench.workloads import build_workload

    w = build_workload("gsm8k-stories260k", 512, (16, 256), 0, None, scratch)
    requests = [
        (i, p, SamplingParams(max_new_tokens=m, stop_token_ids=w.stop_token_ids))
        for i, (p, m) in enumerate(zip(w.prompts, w.max_new_tokens))
    ]
    return w.model_dir, requests, (128, 512)


#: name: (requests, query rows each, context tokens each, query heads, KV heads, head_dim, page size).
KERNEL_SHAPES = {
    "stories260K decode": (256, 1, 220, 8, 4, 8, 16),
    "stories260K prefill": (8, 256, 256, 8, 4, 8, 16),
    "stories260K prefill chunk after context": (4, 150, 300, 8, 4, 8, 16),
    "stories260K verify (1 + 4 rows)": (64, 5, 200, 8, 4, 8, 16),
    "stories260K lm-eval scoring (page 8)": (32, 200, 200, 8, 4, 8, 8),
    "vLLM-workload Llama decode": (128, 1, 300, 8, 4, 64, 16),
    "vLLM-workload Llama verify (1 + 4 rows)": (64, 5, 200, 8, 4, 64, 16),
    "vLLM-workload Llama prefill": (8, 256, 256, 8, 4, 64, 16),
    "head_dim 128 decode": (64, 1, 1000, 32, 8, 128, 16),
    "head_dim 128 prefill": (2, 512, 512, 32, 8, 128, 16),
}


def kernel_case(requests, q_len, context, num_heads, num_kv_heads, head_dim, page_size, seed=0):
    """Random (query, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k) with shuffled pages."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-context // page_size)
    num_pages = requests * blocks + 1
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen)
    tables = (torch.randperm(num_pages - 1, generator=gen)[: requests * blocks] + 1).view(requests, blocks)
    query = torch.randn(requests * q_len, num_heads, head_dim, generator=gen)
    cu = torch.arange(0, requests * q_len + 1, q_len, dtype=torch.int32)
    return query, k_cache, v_cache, tables.to(torch.int32), cu, torch.full((requests,), context, dtype=torch.int32)


def kernel_table(repeats: int) -> str:
    """Markdown table: per shape, reference and C kernel milliseconds per call and their ratio."""
    from cbrun.kernels.cpu_attention import paged_attention_cpu
    from cbrun.kernels.reference import build_gather_plan, paged_attention_ref

    calls = {}
    for name, shape in KERNEL_SHAPES.items():
        q, k, v, tables, cu, seqlens = kernel_case(*shape)
        scale = shape[5] ** -0.5
        calls[name] = {
            "torch": lambda q=q, k=k, v=v, t=tables, cu=cu, s=seqlens, sc=scale, ps=shape[6]: paged_attention_ref(
                q, k, v, build_gather_plan(t, cu, s, ps), sc
            ),
            "cpu": lambda q=q, k=k, v=v, t=tables, cu=cu, s=seqlens, sc=scale: paged_attention_cpu(
                q, k, v, t, cu, s, sc
            ),
        }
    best = {(name, b): float("inf") for name in calls for b in BACKENDS}
    for _ in range(repeats):
        for name, fns in calls.items():
            for backend, fn in fns.items():
                start = time.thread_time()
                fn()
                best[name, backend] = min(best[name, backend], time.thread_time() - start)
    rows = [
        f"| {name} | {'x'.join(map(str, KERNEL_SHAPES[name][:3]))} | {KERNEL_SHAPES[name][5]} | "
        f"{best[name, 'torch'] * 1e3:.2f} | {best[name, 'cpu'] * 1e3:.2f} | "
        f"{best[name, 'torch'] / best[name, 'cpu']:.2f}x |"
        for name in calls
    ]
    return "\n".join(
        [
            "| shape | requests x query rows x context | head_dim | torch (gather + SDPA) ms | cpu kernel ms "
            "| speed-up |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )


#: Bytes touched before each timed call of ``--paired``: they evict the pages and their TLB entries from the L1 and
#: L2 caches, and from most L3s (not from an L3 as large as the 480 MiB of the Intel Xeon of
#: results-cpu-attention-paired-r3.md, whose calls read pages from that L3).
EVICT_BYTES = 48 << 20

#: --paired: workload name, rows, (max_requests_per_batch, max_batch_tokens) of its engine.
PAIRED_WORKLOADS = (("gsm8k-long", 256, (256, 1024)), ("vllm-random-llama", 128, (256, 2048)))


def paired_table(old_source: Path, page_size: int | None = None) -> str:
    """Markdown table: per workload and kind of call, thread CPU seconds of its attention calls, old vs this tree."""
    rows = []
    for name, num_rows, budgets in PAIRED_WORKLOADS:
        seconds, calls = paired_seconds(old_source, name, num_rows, budgets, page_size)
        for kind in ("decode", "with prefill rows", "all"):
            old, new = (
                sum(t for (k, v), t in seconds.items() if v == version and kind in (k, "all"))
                for version in ("old", "new")
            )
            rows.append(f"| {name} | {kind} ({calls[kind]}) | {old:.2f} | {new:.2f} | {old / new:.2f}x |")
    return "\n".join(
        [
            "| workload | attention calls (count) | old kernel CPU s | this kernel CPU s | speed-up |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )


def paired_seconds(old_source: Path, name: str, num_rows: int, budgets: tuple[int, int], page_size: int | None = None):
    """({(kind, "old" | "new"): thread CPU seconds}, {kind: calls}) over one engine run of a workload, with the
    engine's KV pages of ``page_size`` tokens (None: the engine's default).

    kind is "decode" (every request one query row) or "with prefill rows"; calls also counts "all".
    """
    import cbrun.kernels.cpu_attention as cpu_attention
    from cbrun.bench.workloads import build_workload

    old_library = cpu_attention.load_library(old_source)
    new_attention = cpu_attention.StepKernels.attention
    evict = torch.ones(EVICT_BYTES // 4)
    seconds = {}
    calls = {"decode": 0, "with prefill rows": 0, "all": 0}

    def timed(step: cpu_attention.StepKernels, query, block_tables, cu_seqlens_q, *args, **kwargs):
        # The old kernel gets its own instance for the step, so both pay the same one-time conversions.
        old_step = step.__dict__.get("_paired_old")
        if old_step is None:
            old_step = step.__dict__["_paired_old"] = cpu_attention.StepKernels(
                step._k_cache, step._v_cache, step._num_threads, old_library
            )
        kernels = {"old": functools.partial(new_attention, old_step), "new": functools.partial(new_attention, step)}
        cu = cu_seqlens_q
        kind = "decode" if int((cu[1:] - cu[:-1]).max()) == 1 else "with prefill rows"
        outputs = {}
        for version in ("old", "new") if calls["all"] % 2 == 0 else ("new", "old"):
            evict.add_(0)
            start = time.thread_time()
            outputs[version] = kernels[version](query, block_tables, cu_seqlens_q, *args, **kwargs)
            seconds[kind, version] = seconds.get((kind, version), 0.0) + time.thread_time() - start
        calls[kind] += 1
        calls["all"] += 1
        assert torch.equal(outputs["old"], outputs["new"]), "the two kernels' outputs differ"
        return outputs["new"]

    with tempfile.TemporaryDirectory() as scratch:
        w = build_workload(name, num_rows, (16, 256), 0, None, Path(scratch))
        engine = LLMEngine.from_pretrained(
            str(w.model_dir),
            EngineConfig(
                max_requests_per_batch=budgets[0], max_batch_tokens=budgets[1], num_threads=1, page_size=page_size
            ),
        )
        requests = [
            (i, p, SamplingParams(max_new_tokens=m, stop_token_ids=w.stop_token_ids, ignore_eos=w.ignore_eos))
            for i, (p, m) in enumerate(zip(w.prompts, w.max_new_tokens))
        ]
        cpu_attention.StepKernels.attention = timed
        try:
            for _ in engine.generate(requests, max_in_flight=len(requests)):
                pass
        finally:
            cpu_attention.StepKernels.attention = new_attention
    if not calls["all"]:  # the engine no longer calls the kernel through StepKernels.attention: nothing was timed
        raise RuntimeError(f"{name}: no attention call reached StepKernels.attention")
    return seconds, calls


def run_once(model_dir: Path, requests, budgets, backend: str, threads: int) -> tuple[float, float, dict]:
    """(generated tokens/s, CPU seconds, {request id: output ids}) of one generation phase."""
    config = EngineConfig(
        max_requests_per_batch=budgets[0], max_batch_tokens=budgets[1], num_threads=threads, attention_backend=backend
    )
    engine = LLMEngine.from_pretrained(str(model_dir), config)
    start, cpu = time.perf_counter(), time.process_time()
    outputs = list(engine.generate(requests, max_in_flight=len(requests)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.output_token_ids) for o in outputs)
    return tokens / wall, cpu, {o.request_id: o.output_token_ids for o in outputs}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _report(out: Path, text: str) -> int:
    """Write a results file and print it; the exit status 0."""
    out.write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workloads", default="random-llama-vllm,gsm8k-stories260k")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results file (default benchmarks/results-cpu-attention.md, or -kernel.md with --kernel-only)",
    )
    p.add_argument("--kernel-only", action="store_true", help="time single attention calls, not whole runs")
    p.add_argument(
        "--paired",
        type=Path,
        metavar="OLD.c",
        help="time this kernel against the source OLD.c on every attention call of real engine runs",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=None,
        help="with --paired: the engine's KV page size in tokens (default: the engine's)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = f"python -m benchmarks.cpu_attention {' '.join(argv if argv is not None else sys.argv[1:])}"
    machine = (
        f"{_cpu_model()}, {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}, load average at start {os.getloadavg()[0]:.2f}"
    )
    if args.paired:
        return _report(
            args.out or Path("benchmarks/results-cpu-attention-paired.md"),
            f"# CPU attention kernel vs an older version, on the calls of real engine runs\n\n`{command}`; "
            f"1 thread; every call timed with both kernels (thread CPU time, caches evicted before each, "
            f"order alternating), outputs equal; {machine}.\n\n{paired_table(args.paired, args.page_size)}\n",
        )
    if args.kernel_only:
        return _report(
            args.out or Path("benchmarks/results-cpu-attention-kernel.md"),
            f"# CPU attention kernel vs reference, one call per shape\n\n`{command}`; {args.threads} "
            f"thread(s), best of {args.repeats} round-robin calls, thread CPU time; {machine}.\n\n"
            f"{kernel_table(args.repeats)}\n",
        )
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        builders = {
            "random-llama-vllm": lambda: vllm_workload(Path(scratch) / "vllm-llama"),
            "gsm8k-stories260k": lambda: stories_workload(Path(scratch)),
        }
        workloads = {name: builders[name]() for name in args.workloads.split(",")}
        results = {(w, b): [] for w in workloads for b in BACKENDS}
        outputs = {}
        for repeat in range(args.repeats):
            for name, (model_dir, requests, budgets) in workloads.items():
                for backend in BACKENDS:
                    tps, cpu, out = run_once(model_dir, requests, budgets, backend, args.threads)
                    results[name, backend].append((tps, cpu))
                    outputs[name, backend] = out
                    print(f"repeat {repeat} {name} {backend}: {tps:.0f} tok/s, {cpu:.1f} CPU s", flush=True)
        for name in workloads:
            torch_tps = statistics.median(t for t, _ in results[name, "torch"])
            cpu_tps = statistics.median(t for t, _ in results[name, "cpu"])
            equal = outputs[name, "torch"] == outputs[name, "cpu"]
            rows.append(
                f"| {name} | {torch_tps:.0f} | {cpu_tps:.0f} | {cpu_tps / torch_tps:.2f}x | "
                f"{'yes' if equal else 'NO'} |"
            )
    table = "\n".join(
        [
            "| workload | torch (gather + SDPA) tok/s | cpu (pages in place) tok/s | ratio | outputs equal |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    text = (
        f"# CPU attention: reference vs in-place kernel\n\n`{command}`; {args.threads} thread(s), median of "
        f"{args.repeats} round-robin repeats, generation phase.\n\n{table}\n"
    )
    (args.out or Path("benchmarks/results-cpu-attention.md")).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
