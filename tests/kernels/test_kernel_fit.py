"""Every Triton launch the engine and the public wrappers can make fits sm_80, sm_89 and sm_90: compiled ahead of
time, no GPU needed.

The full matrix (every model shape of ``cbrun.kernels.aot_fit.MODELS``, head sizes 64/80/96/128/256, x
bf16/fp16/fp32 x decode/verify/prefill, the engine's launches on each part and every public wrapper's launch,
batch-invariant kernels included, three architectures) takes tens of minutes on two cores, so it is marked slow and
runs only with ``CBRUN_KERNEL_FIT_ALL=1`` (the suite runs slow tests by default); the default run compiles a
representative subset (``aot_fit.SUBSET``), one test per architecture.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
from cbrun.kernels import aot_fit  # noqa: E402
from cbrun.kernels.paged_attention import attention_launch_config  # noqa: E402
from cbrun.kernels.tile_policy import SHARED_MEMORY_LIMITS, pick_attention_tile  # noqa: E402


def _toolchain_present() -> bool:
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return all(os.path.exists(os.path.join(bin_dir, tool)) for tool in ("ptxas", "cuobjdump"))


needs_toolchain = pytest.mark.skipif(not _toolchain_present(), reason="triton wheel without ptxas/cuobjdump")
ROOT = Path(__file__).resolve().parents[2]


def full_matrix(what: str, command_options: str):
    """The marks of a test that compiles a whole launch matrix, one architecture (``capability``) a case: slow, and
    run only with ``CBRUN_KERNEL_FIT_ALL=1`` (the reason says how long ``what`` takes and the command that runs it
    by hand)."""
    marks = (
        pytest.mark.slow,
        pytest.mark.skipif(
            not os.environ.get("CBRUN_KERNEL_FIT_ALL"),
            reason=f"{what} takes ~10 minutes on 2 cores: set CBRUN_KERNEL_FIT_ALL=1 (or run "
            f"python -m cbrun.kernels.aot_fit{command_options})",
        ),
        needs_toolchain,
        pytest.mark.parametrize("capability", aot_fit.CAPABILITIES),
    )

    def mark(test):
        for one in reversed(marks):
            test = one(test)
        return test

    return mark


def _compile_all(tmp_path, *args: str) -> list[dict]:
    """``python -m cbrun.kernels.aot_fit`` in a fresh process: without TRITON_INTERPRET (the test session sets it, and
    interpreted kernels cannot be compiled for a GPU), with an empty Triton cache (nothing cached across runs)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), TRITON_DEFAULT_FP_FUSION="1")
    out = tmp_path / "fits.json"
    result = subprocess.run(
        [sys.executable, "-m", "cbrun.kernels.aot_fit", *args, "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert out.exists(), result.stdout[-5000:] + result.stderr[-5000:]
    fits = json.loads(out.read_text())
    bad = [fit["line"] for fit in fits if not fit["ok"]]
    assert not bad, "launches that do not fit:\n" + "\n".join(bad)
    assert result.returncode == 0, result.stderr[-5000:]
    return fits


@needs_toolchain
@pytest.mark.parametrize("capability", aot_fit.CAPABILITIES)
def test_representative_launches_fit(capability, tmp_path):
    """The subset (``aot_fit.SUBSET``) on one part: the engine's launches for it and the public wrappers'."""
    fits = _compile_all(tmp_path, "--subset", "--capability", str(capability))
    assert len(fits) == len(aot_fit.fit_launches(capability, **aot_fit.SUBSET)) >= 15
    kernels = {fit["kernel"] for fit in fits}
    assert {"paged_attention", "batch_invariant_matmul", "rms_norm", "log_softmax"} <= kernels
    assert all(fit["shared"] > 0 for fit in fits if fit["kernel"] == "paged_attention")  # K/V tiles are staged


@full_matrix("the full matrix", "")
def test_every_engine_launch_fits(capability, tmp_path):
    fits = _compile_all(tmp_path, "--capability", str(capability))
    assert len(fits) == len(aot_fit.fit_launches(capability))


def test_fit_verdict_reads_the_limits():
    """A launch over a part's shared memory, or spilling in 16-bit on sm_90, is reported as not fitting."""
    launch = aot_fit.engine_launches(90, models=aot_fit.MODELS[:1], dtypes=(torch.bfloat16,), max_seqlen_qs=(1,))[0]
    assert aot_fit.Fit(launch, 90, SHARED_MEMORY_LIMITS[90], 128, 0).ok
    assert not aot_fit.Fit(launch, 89, SHARED_MEMORY_LIMITS[89] + 1, 128, 0).ok
    assert not aot_fit.Fit(launch, 90, 1024, 128, 8).ok  # any spill in 16-bit on sm_90
    assert aot_fit.Fit(launch, 80, 1024, 128, 8).ok  # a few bytes elsewhere


def test_engine_launches_cover_every_tile_and_dedupe():
    launches = aot_fit.engine_launches(90)
    attention = [launch for launch in launches if launch.kernel == "paged_attention"]
    rows = {(launch.dtype, launch.config.constexprs["BLOCK_M"]) for launch in attention}
    assert {(torch.bfloat16, 16), (torch.bfloat16, 64), (torch.float32, 16), (torch.float32, 32)} <= rows
    assert any(launch.config.constexprs["USE_WINDOW"] for launch in attention)
    assert len({launch.key() for launch in launches}) == len(launches)


@pytest.mark.parametrize("capability", aot_fit.CAPABILITIES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("head_dim, heads", ((64, (9, 3)), (128, (28, 4)), (256, (8, 4))))
@pytest.mark.parametrize("max_q", (1, 3, 9, 4096))
def test_tile_policy_shapes(capability, dtype, head_dim, heads, max_q):
    """Tiles the kernel can run: power-of-two rows holding whole GQA groups, at least 16 by 16 for tl.dot."""
    config = attention_launch_config(dtype, heads[0], heads[1], head_dim, 16, max_q, False, False, capability)
    c = config.constexprs
    assert c["BLOCK_M"] % c["GROUP_PADDED"] == 0 and c["BLOCK_Q"] * c["GROUP_PADDED"] == c["BLOCK_M"]
    assert c["BLOCK_M"] >= 16 and c["BLOCK_N"] >= 16
    assert c["BLOCK_M"] & (c["BLOCK_M"] - 1) == 0 and config.num_warps in (4, 8)
    if max_q == 1:  # decode takes the smallest tile
        assert c["BLOCK_M"] == max(16, c["GROUP_PADDED"])


def test_wrapper_launches_record_every_public_kernel_and_head_size():
    """The public wrappers' launches (recorded, not run) reach every kernel, every head size of the supported
    families (80 and 96 padded to 128), the bf16 dots upcast on the CPU and not, and the portable tile only."""
    launches = aot_fit.wrapper_launches(dtypes=(torch.bfloat16,), max_seqlen_qs=(1, 256))
    assert {launch.kernel for launch in launches} == set(aot_fit.KERNELS)
    attention = [launch.config.constexprs for launch in launches if launch.kernel == "paged_attention"]
    assert {(c["HEAD_DIM"], c["HEAD_DIM_PADDED"]) for c in attention} == {
        (64, 64),
        (80, 128),
        (96, 128),
        (128, 128),
        (256, 256),
    }
    assert {c["DOT_IN_FP32"] for c in attention} == {True, False}
    portable = {(c["HEAD_DIM_PADDED"], c["BLOCK_M"], c["BLOCK_N"]) for c in attention if not c["DOT_IN_FP32"]}
    assert all(block_n == 32 for _, _, block_n in portable)  # the tile that fits sm_89's 99 KiB
    assert len({launch.key() for launch in launches}) == len(launches)


@pytest.mark.parametrize("head_dim", aot_fit.HEAD_SIZES)
@pytest.mark.parametrize("max_q", (1, 16, 256))
def test_cpu_launch_takes_the_portable_tile_sized_for_upcast_dots(head_dim, max_q):
    """Off CUDA the wrapper's tile is the portable one (capability None), and bf16 dots upcast to float32 take the
    sm_80-class float32 tile: the launches that did not fit sm_89/sm_90 before (issue 39: head_dim 256 at
    256-query tiles, head_dim 80 spilling in bf16) were sm_90's 16-bit tile with float32 operands."""
    cpu = attention_launch_config(torch.bfloat16, 8, 4, head_dim, 16, max_q, False, False, None, dot_in_fp32=True)
    sm80 = attention_launch_config(torch.float32, 8, 4, head_dim, 16, max_q, False, False, 80)

    def blocks(config):
        return {k: v for k, v in config.constexprs.items() if k.startswith("BLOCK")}, config.num_warps

    assert blocks(cpu) == blocks(sm80)
    padded = max(triton.next_power_of_2(head_dim), 16)
    assert pick_attention_tile(None, 2, padded, 2, max_q) == pick_attention_tile(80, 2, padded, 2, max_q)
    portable_fp32 = pick_attention_tile(None, 4, padded, 2, max_q)
    assert portable_fp32.block_n == 32 and (padded < 128 or portable_fp32.block_m == 16)


def test_tile_policy_rows_grow_with_the_query():
    decode = pick_attention_tile(90, 2, 128, 4, 1)
    prefill = pick_attention_tile(90, 2, 128, 4, 4096)
    assert (decode.block_m, prefill.block_m) == (16, 64)
    assert pick_attention_tile(90, 4, 128, 4, 4096).block_m == 32  # float32 keeps its tile smaller


# --- the weight-dequantizing GEMMs (int4_gemm, fp8_gemm, mxfp4_gemm) ---------------------------------------------


@needs_toolchain
def test_representative_quantized_gemm_launches_fit(tmp_path):
    """``aot_fit.QUANTIZED_SUBSET`` (each kernel in bf16 and float32, decode and large tiles) for sm_80/89/90."""
    fits = _compile_all(tmp_path, "--quantized", "--subset")
    expected = sum(len(aot_fit.quantized_gemm_launches(c, **aot_fit.QUANTIZED_SUBSET)) for c in aot_fit.CAPABILITIES)
    assert len(fits) == expected >= 30 and {fit["kernel"] for fit in fits} == set(aot_fit.QUANTIZED_GEMM_POINTERS)


@full_matrix("the full quantized-GEMM matrix", " --quantized")
def test_every_quantized_gemm_launch_fits(capability, tmp_path):
    fits = _compile_all(tmp_path, "--quantized", "--capability", str(capability))
    assert len(fits) == len(aot_fit.quantized_gemm_launches(capability))


def test_quantized_gemm_launches_cover_every_tile_and_dedupe():
    from cbrun.kernels.gemm_launch import gemm_launch_config

    launches = aot_fit.quantized_gemm_launches(90)
    assert len({launch.key() for launch in launches}) == len(launches)
    tiles = {
        (launch.kernel, launch.dtype, tuple(launch.config.constexprs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")))
        for launch in launches
    }
    for kernel in aot_fit.QUANTIZED_GEMM_POINTERS:
        for dtype in aot_fit.DTYPES:
            for rows in (1, 3, 16, 17, 40, 64, 65, 256, 8192):  # whatever a step brings, its tile was compiled
                c = gemm_launch_config(dtype, rows, 128, 90, False).constexprs
                assert (kernel, dtype, (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"])) in tiles
    assert {launch.config.constexprs["HAS_BIAS"] for launch in launches} == {False, True}


@pytest.mark.parametrize("capability", aot_fit.CAPABILITIES)
@pytest.mark.parametrize("elem_bytes", (2, 4))
def test_quantized_gemm_decode_tile_splits_n(capability, elem_bytes):
    """Decode (up to 16 rows) reads the weight once (one row tile) over many narrow programs: 128 of them for
    4096 outputs; larger batches get taller tiles, never a K step past the layout's scale group."""
    from cbrun.kernels.tile_policy import pick_quantized_gemm_tile

    for rows in (1, 16):
        tile = pick_quantized_gemm_tile(capability, elem_bytes, rows, 128)
        assert tile.block_m == 16 and 4096 // tile.block_n == 128
    assert pick_quantized_gemm_tile(capability, elem_bytes, 256, 128).block_m >= 32
    assert pick_quantized_gemm_tile(capability, elem_bytes, 1, 32).block_k == 32


def test_max_block_k_keeps_one_group_per_step():
    from cbrun.kernels.gemm_launch import max_block_k

    assert max_block_k("g", 128, 4096) == 128 and max_block_k("g", 64, 4096) == 64
    assert max_block_k("g", 96, 4096) == 32 and max_block_k("g", 4096, 4096) == 128
    assert max_block_k("g", 17, 17) == 128  # one group a row: any step
    with pytest.raises(ValueError, match="g 24 is not a multiple of 16"):
        max_block_k("g", 24, 4096)


# --- the fused MoE kernel (cbrun.kernels.fused_moe) ----------------------------------------------------------------


@needs_toolchain
def test_representative_fused_moe_launches_fit(tmp_path):
    """``aot_fit.FUSED_MOE_SUBSET`` (each weight format's gated launch in bf16 and float32, decode and prefill
    tiles) for sm_80/89/90."""
    fits = _compile_all(tmp_path, "--fused-moe", "--subset")
    expected = sum(len(aot_fit.fused_moe_launches(c, **aot_fit.FUSED_MOE_SUBSET)) for c in aot_fit.CAPABILITIES)
    assert len(fits) == expected >= 36 and {fit["kernel"] for fit in fits} == {"fused_moe"}


@full_matrix("the full fused-MoE matrix (per architecture)", " --fused-moe")
def test_every_fused_moe_launch_fits(capability, tmp_path):
    fits = _compile_all(tmp_path, "--fused-moe", "--capability", str(capability))
    assert len(fits) == len(aot_fit.fused_moe_launches(capability))


def test_fused_moe_launches_cover_every_tile_and_share_row_tiles():
    """Whatever a step brings (tokens x top_k over E experts), its gated and down launches were compiled, with one
    BLOCK_M for both (they share the tile map)."""
    from cbrun.kernels.fused_moe import WEIGHT_FORMATS, fused_moe_launch_config

    launches = aot_fit.fused_moe_launches(90)
    assert len({launch.key() for launch in launches}) == len(launches)
    compiled = {(launch.dtype, tuple(sorted(launch.config.constexprs.items()))) for launch in launches}
    for fmt in WEIGHT_FORMATS:
        for dtype in aot_fit.DTYPES:
            for pairs, experts in ((1, 8), (8, 128), (64, 128), (200, 8), (512, 8), (4096, 64), (65536, 128)):
                gated, down = (
                    fused_moe_launch_config(dtype, pairs, experts, 128, 90, fmt, g, "silu", False, not g)
                    for g in (True, False)
                )
                assert gated.constexprs["BLOCK_M"] == down.constexprs["BLOCK_M"]
                assert (
                    gated.constexprs["BLOCK_N"] * 2 == down.constexprs["BLOCK_N"] or gated.constexprs["BLOCK_N"] == 16
                )
                for config in (gated, down):
                    assert (dtype, tuple(sorted(config.constexprs.items()))) in compiled, (fmt, dtype, pairs, experts)
