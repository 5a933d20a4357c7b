"""The engine end to end on a GPU: a random ~0.35B Llama, every mode against the plain one, then timed.

Run on a CUDA machine, from the repository root::

    PYTHONPATH=. python -m benchmarks.gpu_engine_check            # kernel checks (kernels.gpu_check), then this
    PYTHONPATH=. python -m benchmarks.gpu_engine_check --engine-only

Two parts, each mode against the plain one (CUDA graphs off, async batching off):

* correctness, in float32: CUDA graphs on, graphs with async batching, and swap preemption (a cache too small for
  the batch, CPU swap space) must give the plain mode's greedy tokens, every request token for token. Every mode
  runs the same forward (transformers' modules with cbrun's attention: ``model_impl = "transformers"``), so only
  what the mode changes can differ. float32, because in bf16 a padded graph batch may pick other GEMM kernels
  whose rounding flips a near-tied argmax of a random model; that is not a fault of the mode.
* speed, in bf16 (a bf16 checkpoint read with ``dtype = "auto"``): generated tokens/s per mode, the speed-up over
  plain, and the fraction of the measured copy bandwidth (HBM roofline) that decode-only steps reach (weights
  plus the KV read per step / step time). Equality with plain is shown there for information only.

Exit status: 0 when everything matched, 1 on any kernel or engine mismatch, 2 without CUDA (nothing was run). It
reads engine internals (the KV tensor, the scheduler's queues) to count bytes, which is why it lives here and not
in ``cbrun/kernels/``.
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

ENGINE_MODEL = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=4096,
)  # ~0.35B params
NO_CUDA_EXIT = 2

#: name -> engine settings on top of the plain mode's. "swap" sizes the cache far below the batch's need.
CUDA_MODES = {
    "plain": dict(cuda_graphs="off", async_batching="off"),
    "graphs": dict(cuda_graphs="on", async_batching="off"),
    "graphs+async": dict(cuda_graphs="on", async_batching="on"),
}
SWAP_MODE = {"swap": dict(cuda_graphs="off", async_batching="off", cpu_offload_space=2.0)}


@dataclass
class EngineRow:
    """One engine run: its mode, dtype, speed, and how many requests equal the plain mode's tokens."""

    part: str
    mode: str
    dtype: str
    tokens_per_s: float
    speedup: float
    equal: int
    total: int
    offloads: int
    bandwidth_fraction: float | None
    gate: bool  # a mismatch here is a failure

    @property
    def ok(self) -> bool:
        return not self.gate or self.equal == self.total

    def cells(self) -> list[str]:
        frac = f"{self.bandwidth_fraction:.2f}" if self.bandwidth_fraction is not None else "-"
        return [
            self.part,
            self.mode,
            self.dtype,
            f"{self.tokens_per_s:.0f}",
            f"{self.speedup:.2f}x",
            f"{self.equal}/{self.total}",
            str(self.offloads),
            frac,
            ("yes" if self.ok else "NO") if self.gate else "(info)",
        ]


ENGINE_HEADER = ["engine part", "mode", "dtype", "tokens/s", "vs plain", "== plain", "swaps", "decode BW frac", "ok"]


def _engine_workload(vocab_size: int, num_requests: int, max_prompt: int, max_new_tokens: int, seed: int = 0):
    from cbrun.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max_prompt // 16, max_prompt, (num_requests,), generator=g).tolist()
    return [
        (
            i,
            torch.randint(3, vocab_size, (n,), generator=g).tolist(),
            SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
        )
        for i, n in enumerate(lengths)
    ]


def _run_engine(model_dir: str, config, workload) -> tuple[float, dict, list[float], int]:
    """Generated tokens/s, outputs, the bytes/s each decode-only step moved (weights + KV read), swaps."""
    from cbrun.engine import LLMEngine

    engine = LLMEngine.from_pretrained(model_dir, config)
    param_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv = engine.model_runner.kv_cache.kv
    kv_bytes_per_token = kv[:, 0, 0].numel() * kv.element_size() * engine.model.config.num_hidden_layers
    for request_id, prompt, params in workload:
        engine.add_request(request_id, prompt, params)
    outputs, decode_bytes_per_s = {}, []
    device = kv.device
    sync = (lambda: torch.cuda.synchronize(device)) if kv.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        decode_only = not engine.scheduler.waiting and all(r.num_tokens_to_compute == 1 for r in running)
        context = sum(r.num_tokens for r in running)
        t0 = time.perf_counter()
        for out in engine.step():
            outputs[out.request_id] = out.output_token_ids
        if decode_only and running:
            decode_bytes_per_s.append((param_bytes + context * kv_bytes_per_token) / (time.perf_counter() - t0))
    sync()
    elapsed = time.perf_counter() - start
    stats = engine.stats
    del engine, kv
    gc.collect()  # NOTE: the next mode sizes its cache from free memory: this engine's graphs and cache must be gone
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return stats.num_generated_tokens / elapsed, outputs, decode_bytes_per_s, stats.num_offloads


def _compare(
    part: str,
    model_dir: str,
    dtype: str,
    modes: dict,
    base_settings: dict,
    workload,
    copy_bandwidth: float | None,
    gate: bool,
) -> list[EngineRow]:
    from cbrun.engine import EngineConfig

    results = {
        name: _run_engine(model_dir, EngineConfig(**base_settings, **settings), workload)
        for name, settings in modes.items()
    }
    base_tps, base_out, _, _ = results["plain"]
    rows = []
    for name, (tps, outputs, bandwidth, offloads) in results.items():
        equal = sum(outputs.get(k) == v for k, v in base_out.items())
        frac = statistics.median(bandwidth) / copy_bandwidth if bandwidth and copy_bandwidth else None
        rows.append(EngineRow(part, name, dtype, tps, tps / base_tps, equal, len(base_out), offloads, frac, gate))
    return rows


def engine_checks(
    copy_bandwidth: float | None = None,
    device: str = "cuda",
    model: dict = ENGINE_MODEL,
    num_requests: int = 128,
    max_prompt: int = 1024,
    max_new_tokens: int = 128,
    check_requests: int = 32,
    check_new_tokens: int = 32,
) -> list[EngineRow]:
    """The correctness part (float32, every mode against plain) and the speed part (bf16 on CUDA). Without CUDA
    only plain and swap run, in float32, and no speed part. Prints the table; returns its rows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cuda = torch.device(device).type == "cuda"
    modes = {**(CUDA_MODES if cuda else {"plain": CUDA_MODES["plain"]}), **SWAP_MODE}
    common = dict(
        device=device,
        page_size=16,
        max_batch_tokens=2048,
        model_impl="transformers",
        loader="transformers",
        **({} if cuda else {"max_memory_percent": 0.1}),
    )
    check_workload = _engine_workload(model["vocab_size"], check_requests, max_prompt // 4, check_new_tokens)
    # NOTE: the swap mode's cache holds about a quarter of the batch at its longest, so requests are preempted.
    longest = max(len(prompt) for _, prompt, _ in check_workload) + check_new_tokens
    swap_blocks = max(check_requests * -(-longest // 16) // 4, 2 * -(-longest // 16))
    modes["swap"] = {**modes["swap"], "num_blocks": swap_blocks}
    rows = []
    with tempfile.TemporaryDirectory(prefix="cbrun-gpu-check-") as model_dir:  # the model is removed afterwards
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**model)).to(torch.float32).save_pretrained(model_dir)
        rows += _compare(
            "correctness",
            model_dir,
            "float32",
            modes,
            dict(common, dtype="float32", max_requests_per_batch=check_requests),
            check_workload,
            None,
            gate=True,
        )
    if cuda:
        workload = _engine_workload(model["vocab_size"], num_requests, max_prompt, max_new_tokens)
        with tempfile.TemporaryDirectory(prefix="cbrun-gpu-check-") as model_dir:
            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(**model)).to(torch.bfloat16).save_pretrained(model_dir)
            rows += _compare(
                "speed",
                model_dir,
                "bfloat16",
                CUDA_MODES,
                dict(common, dtype="auto", max_requests_per_batch=num_requests),
                workload,
                copy_bandwidth,
                gate=False,
            )
    from cbrun.kernels.gpu_check import format_table

    print()
    print(format_table(ENGINE_HEADER, [row.cells() for row in rows]))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Kernel checks (unless ``--engine-only``), then the engine's. 0 all matched, 1 any mismatch, 2 no CUDA."""
    argv = sys.argv[1:] if argv is None else argv
    if not torch.cuda.is_available():
        print("gpu_engine_check: no CUDA device here, nothing was run (the CPU tests cover the engine)")
        return NO_CUDA_EXIT
    from cbrun.kernels import gpu_check

    status = 0 if "--engine-only" in argv else gpu_check.main()
    rows = engine_checks(gpu_check._copy_bandwidth("cuda", gpu_check.cuda_bench))
    if not all(row.ok for row in rows):
        print(f"gpu_engine_check: FAILED: {[row.mode for row in rows if not row.ok]} differ from plain")
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
