"""GPU check of the Triton kernels: correctness against the PyTorch reference and speed against measured ceilings.

Run on a CUDA machine with ``python -m cbrun.kernels.gpu_check``: exit 0 when every kernel matches its reference, 1 on
any mismatch, 2 without CUDA (nothing was checked; the CPU tests of the kernels are
``tests/kernels/test_kernels.py``, in Triton's interpreter). ``python -m benchmarks.gpu_suite`` runs this and the
engine's checks. It prints one table::

    kernel | dtype | shape | tile | max err | ok | ms | GB/s | TFLOP/s | roofline

``tile`` is the launch the wrapper really makes on this device (``paged_attention.attention_launch_config``:
rows x context positions, warps). ``max err`` is against the reference computed in float32 on the same inputs;
``ms`` is the median of ``triton.testing.do_bench``; ``roofline`` is the fraction of the measured copy bandwidth
(the HBM roofline) for memory-bound cases (decode, KV write: bytes that must move / time) and of the measured bf16
matmul rate for prefill (FLOPs of the causal attention actually computed / time). The "decode tile" rows time
the tile decode uses in bf16 and float32 at head_dim 128 and 256.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from cbrun.kernels.reference import build_gather_plan, paged_attention_ref, write_kv_cache_ref

#: |err| <= tol * (1 + |expected|) against the float32 reference, as in the tests.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
NO_CUDA_EXIT = 2


@dataclass
class AttentionCase:
    """One batch: ``num_decodes`` decodes at ``decode_context`` plus prefill chunks (q_len, context incl. it)."""

    name: str
    num_decodes: int
    decode_context: int
    chunks: tuple[tuple[int, int], ...] = ()
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    sliding_window: int | None = None
    softcap: float | None = None
    memory_bound: bool = True  # roofline against copy bandwidth (else against the matmul rate)

    @property
    def q_lens(self) -> list[int]:
        return [q for q, _ in self.chunks] + [1] * self.num_decodes

    @property
    def k_lens(self) -> list[int]:
        return [k for _, k in self.chunks] + [self.decode_context] * self.num_decodes


# Llama-3-8B-like heads: H=32, Hkv=8, D=128, page 16, bf16.
REALISTIC_CASES = (
    AttentionCase("decode", 64, 2048),
    AttentionCase("decode", 256, 2048),
    AttentionCase("decode few long", 8, 16384),
    AttentionCase("decode window+softcap", 64, 4096, sliding_window=1024, softcap=50.0),
    AttentionCase("mixed", 62, 2048, chunks=((512, 2048), (512, 1024)), memory_bound=False),
    AttentionCase("prefill", 0, 0, chunks=((1024, 1024),) * 4, memory_bound=False),
)
#: The decode tile in each dtype the engine runs, at head_dim 128 (Llama-3-8B heads) and 256 (Gemma: 8 query heads
#: over 4 KV heads): 128 requests at 4096 tokens of context, far past L2.
DECODE_TILE_CASES = tuple(
    (AttentionCase("decode tile", 128, 4096, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim), dtype)
    for dtype in (torch.bfloat16, torch.float32)
    for head_dim, heads, kv_heads in ((128, 32, 8), (256, 8, 4))
)
KV_WRITE_TOKENS = (64, 8192)


@dataclass
class Row:
    kernel: str
    dtype: str
    shape: str
    tile: str
    max_err: float
    ok: bool
    ms: float
    bytes_moved: float
    flops: float
    ceiling: float  # bytes/s or FLOP/s the roofline is taken against

    def cells(self) -> list[str]:
        seconds = self.ms * 1e-3
        gbps, tflops = self.bytes_moved / seconds / 1e9, self.flops / seconds / 1e12
        achieved = self.flops / seconds if self.flops else self.bytes_moved / seconds
        return [
            self.kernel,
            self.dtype,
            self.shape,
            self.tile,
            f"{self.max_err:.2e}",
            "yes" if self.ok else "NO",
            f"{self.ms:.3f}",
            f"{gbps:.0f}",
            f"{tflops:.1f}" if self.flops else "-",
            f"{achieved / self.ceiling:.2f}",
        ]


def make_attention_batch(case: AttentionCase, dtype: torch.dtype, device: str, seed: int = 0):
    """Random query and cache for ``case``, pages of all requests shuffled over the pool.

    Returns:
        (query (T, H, D), k_cache, v_cache (num_blocks, page, Hkv, D), block_tables (B, max_blocks) int32,
        cu_seqlens_q (B + 1,) int32, seqlens_k (B,) int32).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = [-(-k // case.page_size) for k in case.k_lens]
    num_blocks = sum(pages) + 1
    perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    block_tables = torch.zeros(len(pages), max(pages), dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(pages):
        block_tables[b, :n] = perm[start : start + n]
        start += n
    shape = (num_blocks, case.page_size, case.num_kv_heads, case.head_dim)
    k_cache = torch.randn(shape, device=device, generator=gen).to(dtype)
    v_cache = torch.randn(shape, device=device, generator=gen).to(dtype)
    query = torch.randn(sum(case.q_lens), case.num_heads, case.head_dim, device=device, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    seqlens_k = torch.tensor(case.k_lens, dtype=torch.int32, device=device)
    return query, k_cache, v_cache, block_tables, cu, seqlens_k


def attention_work(case: AttentionCase, elem_bytes: int) -> tuple[float, float]:
    """(bytes that must move, FLOPs of QK^T and PV over the visible keys only) for one call."""
    kv_bytes = q_bytes = flops = 0.0
    for q_len, k_len in zip(case.q_lens, case.k_lens):
        first = max(k_len - q_len - (case.sliding_window or k_len) + 1, 0)
        kv_bytes += (k_len - first) * case.num_kv_heads * case.head_dim * 2 * elem_bytes
        q_bytes += q_len * case.num_heads * case.head_dim * 2 * elem_bytes  # query read, output written
        for pos in range(k_len - q_len, k_len):
            visible = min(pos + 1, case.sliding_window or pos + 1)
            flops += 4.0 * visible * case.num_heads * case.head_dim
    return kv_bytes + q_bytes, flops


def check_attention(case: AttentionCase, dtype: torch.dtype, device: str, bench: Callable, ceilings) -> Row:
    from cbrun.kernels.paged_attention import paged_attention_triton

    query, k_cache, v_cache, block_tables, cu, seqlens_k = make_attention_batch(case, dtype, device)
    scale = case.head_dim**-0.5
    max_q = max(case.q_lens)
    out = torch.full_like(query, float("nan"))

    def run():
        paged_attention_triton(
            query,
            k_cache,
            v_cache,
            block_tables,
            cu,
            seqlens_k,
            scale,
            case.sliding_window,
            case.softcap,
            max_seqlen_q=max_q,
            out=out,
        )

    run()
    plan = build_gather_plan(block_tables, cu, seqlens_k, case.page_size, case.sliding_window)
    expected = paged_attention_ref(query.float(), k_cache.float(), v_cache.float(), plan, scale, case.softcap)
    err = (out.float() - expected).abs()
    max_err = err.max().item()  # NaN (an unwritten row) propagates
    ok = bool((err <= TOLERANCE[dtype] * (1 + expected.abs())).all())  # False on NaN too
    del expected, plan, err
    ms = bench(run)
    bytes_moved, flops = attention_work(case, query.element_size())
    shape, tile = _attention_shape(case, query.shape[0]), _attention_tile(case, dtype, query.device)
    return Row(
        f"attention {case.name}",
        dtype_name(dtype),
        shape,
        tile,
        max_err,
        ok,
        ms,
        bytes_moved,
        0.0 if case.memory_bound else flops,
        ceilings[0] if case.memory_bound else ceilings[1],
    )


def _attention_shape(case: AttentionCase, num_tokens: int) -> str:
    """The row's shape column: requests, tokens, longest context, heads, head size, page size, window, softcap."""
    extras = f" win={case.sliding_window}" if case.sliding_window else ""
    extras += f" cap={case.softcap}" if case.softcap else ""
    return (
        f"B={len(case.q_lens)} T={num_tokens} ctx={max(case.k_lens)} H={case.num_heads}/{case.num_kv_heads} "
        f"D={case.head_dim} p={case.page_size}{extras}"
    )


def _attention_tile(case: AttentionCase, dtype: torch.dtype, device: torch.device) -> str:
    """The row's tile column: the tile and warps ``paged_attention_triton`` launched with on ``device``."""
    from cbrun.kernels.paged_attention import attention_launch_config, device_capability

    launch = attention_launch_config(
        dtype,
        case.num_heads,
        case.num_kv_heads,
        case.head_dim,
        case.page_size,
        max(case.q_lens),
        case.sliding_window is not None,
        case.softcap is not None,
        device_capability(device),
    )
    c = launch.constexprs
    return f"{c['BLOCK_M']}x{c['BLOCK_N']} w{launch.num_warps}"


def check_kv_write(
    num_tokens: int,
    dtype: torch.dtype,
    device: str,
    bench: Callable,
    ceilings,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
) -> Row:
    from cbrun.kernels.kv_cache_write import write_kv_cache_triton

    num_blocks = 2 * -(-num_tokens // page_size)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * page_size, device=device)[:num_tokens]
    slots[::7] = -1  # padding
    k_cache = torch.full((num_blocks, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(key, value, k_expected, v_expected, slots)
    write_kv_cache_triton(key, value, k_cache, v_cache, slots)
    same = all(
        torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0)) for a, b in ((k_cache, k_expected), (v_cache, v_expected))
    )
    ms = bench(lambda: write_kv_cache_triton(key, value, k_cache, v_cache, slots))
    written = int((slots >= 0).sum())
    bytes_moved = 4 * written * num_kv_heads * head_dim * key.element_size()  # read k, v; write k, v
    return Row(
        "kv_cache_write",
        dtype_name(dtype),
        f"T={num_tokens} Hkv={num_kv_heads} D={head_dim} p={page_size}",
        "-",
        0.0 if same else math.inf,
        same,
        ms,
        bytes_moved,
        0.0,
        ceilings[0],
    )


def measure_ceilings(device: str, bench: Callable) -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write: the HBM roofline, bf16 matmul rate in FLOP/s), measured
    here."""
    return _copy_bandwidth(device, bench), _matmul_rate(device, bench)


def _copy_bandwidth(device: str, bench: Callable) -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device=device)  # 1 GiB, far past L2
    dst = torch.empty_like(src)
    return 2 * src.numel() / (bench(lambda: dst.copy_(src)) * 1e-3)


def _matmul_rate(device: str, bench: Callable, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    return 2 * n**3 / (bench(lambda: torch.matmul(a, b, out=c)) * 1e-3)


def run_checks(
    device: str,
    bench: Callable,
    cases=REALISTIC_CASES,
    kv_write_tokens=KV_WRITE_TOKENS,
    dtype: torch.dtype = torch.bfloat16,
    decode_tile_cases=DECODE_TILE_CASES,
    ceilings: tuple[float, float] | None = None,
) -> list[Row]:
    """Every kernel against its reference on ``device``, timed with ``bench(fn) -> ms``; prints the table.

    ``cases`` run in ``dtype``, ``decode_tile_cases`` in their own dtypes; ``ceilings`` are measured when None.
    """
    if ceilings is None:
        ceilings = measure_ceilings(device, bench)
    print(f"ceilings: copy {ceilings[0] / 1e9:.0f} GB/s (read + write), bf16 matmul {ceilings[1] / 1e12:.0f} TFLOP/s")
    rows = [check_attention(case, dtype, device, bench, ceilings) for case in cases]
    rows += [check_attention(case, case_dtype, device, bench, ceilings) for case, case_dtype in decode_tile_cases]
    rows += [check_kv_write(t, dtype, device, bench, ceilings) for t in kv_write_tokens]
    print_table(rows)
    return rows


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


HEADER = ["kernel", "dtype", "shape", "tile", "max err", "ok", "ms", "GB/s", "TFLOP/s", "roofline"]


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell, a rule under the header."""
    cells = [header] + rows
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(rows: list[Row]) -> None:
    print(format_table(HEADER, [r.cells() for r in rows]))


def cuda_bench(fn: Callable) -> float:
    """Median milliseconds of ``fn`` on the CUDA device (``triton.testing.do_bench``)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def check_main(name: str, cpu_tests: str, run_checks: Callable[[str, Callable], list[Row]]) -> int:
    """A GPU check's command on the current CUDA device: prints the versions, runs ``run_checks("cuda",
    cuda_bench)`` (which prints its table) and names the rows that failed.

    Args:
        name: the command's module name, for its lines. cpu_tests: where the CPU tests of the same kernels are.
        run_checks: the check, ``(device, bench) -> rows``.

    Returns:
        0 when every row is correct, 1 on a mismatch, ``NO_CUDA_EXIT`` (nothing checked) without CUDA.
    """
    if not torch.cuda.is_available():
        print(f"{name}: no CUDA device here, nothing was checked (the CPU tests are {cpu_tests})")
        return NO_CUDA_EXIT
    import triton

    print(f"{name} on {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows = run_checks("cuda", cuda_bench)
    failed = [f"{r.kernel} {r.dtype} ({r.shape})" for r in rows if not r.ok]
    if failed:
        print(f"{name}: FAILED correctness: {failed}")
        return 1
    return 0


def main() -> int:
    """Check and time the kernels on the current CUDA device: 0 all correct, 1 any mismatch, 2 without CUDA."""
    return check_main("gpu_check", "tests/kernels/test_kernels.py", run_checks)


if __name__ == "__main__":
    sys.exit(main())
