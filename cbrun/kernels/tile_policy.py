"""Which tile and how many warps each Triton launch uses, per GPU architecture, and the tile that fits them all.

The paged-attention kernel holds a (BLOCK_M, HEAD_DIM) float32 accumulator and the query tile in registers and
stages K and V tiles of BLOCK_N positions in shared memory, so a tile that suits one part spills registers or
overflows shared memory on another. The choices below are the ones ``tests/kernels/test_kernel_fit.py`` compiles
ahead of time for sm_80, sm_89 and sm_90 (``cbrun.kernels.aot_fit``), for head sizes 64, 80, 96, 128 and 256 (a
head size that is not a power of two is padded to the next one, masked in the kernel): every launch fits each
part's shared memory and spills nothing in 16-bit on sm_90 (at most 16 bytes of stack elsewhere).

Rules, in the order they apply:
    * the part: the capability of the launching device; off CUDA (the interpreter, or a launch recorded on the
      CPU), ``capability=None``, the portable tile, which fits every part of ``FIT_CAPABILITIES`` (the sm_80-class
      rules below: ``tests/kernels/test_kernel_fit.py`` compiles it for all three). A recorded CPU launch must
      never carry an sm_90 tile to an sm_89 (99 KiB) part.
    * element size: 2 bytes for fp16/bf16, 4 for float32 and for bf16 dots upcast to float32 (``DOT_IN_FP32``, the
      interpreter): an upcast tile holds float32 operands, so it is sized as a float32 one.
    * rows (BLOCK_M): BLOCK_Q query tokens times the padded GQA group, at least 16; up to 64 in 16-bit (tensor-core
      dots), up to 32 in float32 (``input_precision="ieee"`` dots run on FMA units with both operands and the
      accumulator in registers), 16 in float32 at head_dim 256, and from head_dim 128 in the portable float32
      tile (32 rows spilled on sm_90 with the BLOCK_N 32 that sm_80 needs). Decode batches (one query token per request) get
      the smallest tile: memory bound, many programs.
    * BLOCK_N: 32 on sm_80-class parts and the portable tile (ptxas spilled with 64 in float32 and at several
      16-bit GQA shapes), and where the K and V tiles of 64 positions would not fit (head_dim 256 in 16-bit on
      sm_89, head_dim 256 in float32); else 64.
    * num_warps: 8 once the accumulator is large (64 x 256 in 16-bit, or any float32 tile of 32 rows or head_dim
      256; from head_dim 128 in the portable float32 tile, which spilled on sm_89 with 4), else 4 (8 warps cap ptxas at
      128 registers per thread, where 16-bit 64 x 128 tiles spilled on sm_80).

The batch-invariant kernels (``pick_invariant_matmul_tile``, ``pick_row_tile``) take one tile for every part and
every batch: their tile is part of what makes a row's bits independent of its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Shared memory one block may use, in bytes, by compute capability (major * 10 + minor): CUDA C Programming
#: Guide, "Technical Specifications per Compute Capability" (opt-in maximum per block).
SHARED_MEMORY_LIMITS = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
#: The parts every tile is checked on (``cbrun.kernels.aot_fit``): A100 (sm_80), L4 / L40S (sm_89, whose 99 KiB is
#: sm_86's too), H100 / H200 (sm_90). ``capability=None`` asks for a tile that fits all of them.
FIT_CAPABILITIES = (80, 89, 90)
#: The architecture assumed off CUDA: None, the portable tile (the Triton interpreter ignores warps and shared
#: memory; only the tile's shape matters there, and any of them computes the same attention).
DEFAULT_CAPABILITY: int | None = None
#: The largest head size the Triton attention kernel takes. NOTE: larger head dims would not fit a
#: (BLOCK_M, HEAD_DIM) fp32 accumulator in registers.
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class LaunchConfig:
    """Everything of a launch that selects a compiled kernel: the constexprs and the launch options."""

    constexprs: dict
    num_warps: int
    num_stages: int

    def key(self) -> tuple:
        """Hashable identity: two launches with equal keys run the same binary."""
        return tuple(sorted(self.constexprs.items())) + (self.num_warps, self.num_stages)

    def launch(self, kernel: Any, grid: tuple[int, ...], *args: object) -> None:
        """``kernel[grid](*args)`` with this configuration: its warps, stages and constexprs (the one place a
        wrapper's launch options are spelled, so a launch is always the configuration ``aot_fit`` compiles)."""
        kernel[grid](*args, num_warps=self.num_warps, num_stages=self.num_stages, **self.constexprs)


@dataclass(frozen=True)
class AttentionTile:
    """One launch's tile: ``block_m`` rows (query tokens x padded group), ``block_n`` context positions per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = 2

    def block_q(self, group_padded: int) -> int:
        """Query tokens per program."""
        return self.block_m // group_padded


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def _max_attention_rows(wide: bool, portable_fp32: bool, head_dim_padded: int) -> int:
    """The most query rows (``BLOCK_M``) a paged-attention tile takes: 64 in 16-bit, 32 in float32, 16 for float32
    at head_dim 256 (and the portable float32 tile from 128)."""
    if not wide:
        return 64
    if head_dim_padded >= 256 or (portable_fp32 and head_dim_padded >= 128):
        # NOTE: the portable float32 tile of 32 x 128 spilled 168-296 bytes on sm_90 (sm_80 needs BLOCK_N 32,
        # sm_90 then spills at 32 rows): 16 rows fit all three parts.
        return 16
    return 32


def pick_attention_tile(
    capability: int | None,
    elem_bytes: int,
    head_dim_padded: int,
    group_padded: int,
    max_seqlen_q: int,
    upcast: bool = False,
) -> AttentionTile:
    """The tile of one paged-attention launch.

    Args:
        capability: compute capability as major * 10 + minor (80 for A100, 89 for L4/L40S, 90 for H100/H200), or
            None for the portable tile (fits every part of ``FIT_CAPABILITIES``).
        elem_bytes: bytes per element the dots run in (2 for fp16/bf16, 4 for float32 and upcast bf16).
        head_dim_padded: the kernel's HEAD_DIM_PADDED (a power of two, 16 to 256).
        group_padded: query heads per KV head, rounded up to a power of two.
        max_seqlen_q: the longest query (tokens) of any request in the batch (1 for decode-only batches).
        upcast: 16-bit K/V tiles whose dots run in float32 (``DOT_IN_FP32``, the interpreter's bf16): sized as
            float32 by the sm_80-class rules (its tiles hold 16-bit K/V in shared memory).

    Returns:
        The ``AttentionTile``; ``block_m`` is a multiple of ``group_padded``.
    """
    wide = elem_bytes >= 4
    portable_fp32 = capability is None and wide and not upcast
    rows = min(
        max(next_power_of_2(max_seqlen_q * group_padded), 16), _max_attention_rows(wide, portable_fp32, head_dim_padded)
    )
    block_m = max(rows, group_padded)
    if capability is None or capability < 89:  # sm_80 / 86 / 87 and the portable tile: fewer registers per K/V step
        block_n = 32
        # NOTE: the portable float32 tile takes 8 warps from head_dim 128: with 4, ptxas for sm_89 spilled 272 bytes
        # at 16 x 128 (sm_80's own tile keeps 4 there, spilling nothing; so does the upcast one, which spilled 8
        # bytes on sm_90 with 8).
        wide_warps_dim = 128 if portable_fp32 else 256
        large_acc = (
            block_m >= 32 or head_dim_padded >= wide_warps_dim if wide else block_m * head_dim_padded >= 64 * 256
        )
    elif wide:
        block_n = 32 if head_dim_padded >= 256 else 64
        large_acc = block_m >= 32 or head_dim_padded >= 256
    else:
        block_n = 32 if head_dim_padded >= 256 and capability < 90 else 64
        large_acc = block_m * head_dim_padded >= 64 * 256
    return AttentionTile(block_m, block_n, 8 if large_acc else 4)


@dataclass(frozen=True)
class MatmulTile:
    """The one tile of every batch-invariant matmul launch of a dtype: ``block_m`` x ``block_n`` outputs per
    program, the K loop in steps of ``block_k``."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def pick_invariant_matmul_tile(elem_bytes: int) -> MatmulTile:
    """The tile of ``cbrun.kernels.batch_invariant_matmul``: fixed per dtype, never by the row count M, the same on
    every part (so the one binary fits sm_80, sm_89 and sm_90: ``cbrun.kernels.aot_fit``).

    A row's output is then computed by the same instructions whatever M is: its K loop runs in ``block_k`` steps
    from 0 to K in one order, with no split-K (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025;
    vLLM's ``VLLM_BATCH_INVARIANT`` and SGLang's deterministic mode use the same rule: one tile config for all M).

    Sizes: 16-bit 128 x 128 outputs, K steps of 32, 4 stages: 64 KiB of staged A/B tiles, inside sm_89's 99 KiB
    with room; float32 (``input_precision="ieee"``: FMA dots, operands in registers) 64 x 64, K steps of 32,
    3 stages (48 KiB). The price is paid at small M (decode): a 128-row tile for 1 to 127 rows.

    Args:
        elem_bytes: bytes per element of the activations and weight (2 for fp16/bf16, 4 for float32).
    """
    if elem_bytes >= 4:
        return MatmulTile(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=3)
    return MatmulTile(block_m=128, block_n=128, block_k=32, group_m=8, num_warps=8, num_stages=4)


@dataclass(frozen=True)
class RowTile:
    """One program per row: ``block`` columns per loop step, ``num_warps`` warps."""

    block: int
    num_warps: int


#: Columns per loop step of the row kernels (RMSNorm, log-softmax) at most: 8192 float32 values over 8 warps is
#: 32 registers a thread.
MAX_ROW_BLOCK = 8192


def pick_row_tile(num_columns: int) -> RowTile:
    """The tile of a row-wise reduction kernel (``cbrun.kernels.rms_norm``, ``cbrun.kernels.log_softmax``): chosen by
    the row's length only, so a row sums in the same order whatever the number of rows (a one-program-per-row grid
    and no split of a row over programs)."""
    block = min(next_power_of_2(num_columns), MAX_ROW_BLOCK)
    return RowTile(block, 8 if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1)


#: Rows up to which a quantized-GEMM launch counts as decode-sized (the split-N tile below).
GEMM_DECODE_ROWS = 16


@dataclass(frozen=True)
class GemmTile:
    """One quantized-GEMM launch's tile: a (block_m, block_n) output tile per program, block_k inputs per step."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pick_quantized_gemm_tile(capability: int | None, elem_bytes: int, rows: int, max_block_k: int) -> GemmTile:
    """The tile of one weight-dequantizing GEMM launch (``int4_gemm``, ``fp8_gemm``, ``mxfp4_gemm``).

    The kernels stream the quantized weight once per row tile and dequantize it in registers, so on decode the
    launch is memory bound on the weight: the rule is to read it once (one row tile) and spread it over many
    programs (a narrow ``block_n``: split-N, 128 programs for 4096 outputs), with a long ``block_k`` step and a
    deep pipeline to keep loads in flight. Larger batches take wider tiles for reuse of each dequantized tile.

    Rules, in order (each compiled for sm_80/89/90 without spills in ``tests/kernels/test_kernel_fit.py``):
        * float32 activations (``input_precision="ieee"`` dots run on FMA units with both operands in registers):
          16 x 32 x 64 with 8 warps on decode, 32 x 64 x 32 with 8 warps above (a block_k of 128 spilled
          hundreds of bytes on sm_90).
        * 16-bit, rows <= 16 (decode): 16 x 32 tiles, block_k 128, 4 warps, 4 stages (3 on sm_80-class parts;
          int4 with 3 stages on sm_89 spilled 8 bytes).
        * 16-bit, rows <= 64: block_m the next power of two (32 or 64), block_n 64, block_k 64, 4 warps, 3 stages.
        * 16-bit, more rows (prefill, large batches): 64 x 128 x 64 with 8 warps, 3 stages.
        * block_k never exceeds ``max_block_k``: the largest power of two that keeps one scale group (or block)
          per step, which the wrapper derives from the layout (at least 16).

    Args:
        capability: compute capability, major * 10 + minor (80, 89, 90); None off CUDA (the interpreter), which
            takes sm_90's tile (these launches are compiled per part by ``aot_fit.quantized_gemm_launches``, not
            recorded from the wrapper).
        elem_bytes: bytes per activation element (2 for fp16/bf16, 4 for float32).
        rows: M, the activation rows of the launch (tokens in the step).
        max_block_k: upper bound on block_k (a power of two >= 16).

    Returns:
        The ``GemmTile``.
    """
    if capability is None:
        capability = 90
    if elem_bytes >= 4:
        tile = GemmTile(16, 32, 64, 8, 3) if rows <= GEMM_DECODE_ROWS else GemmTile(32, 64, 32, 8, 2)
    elif rows <= GEMM_DECODE_ROWS:
        tile = GemmTile(16, 32, 128, 4, 3 if capability < 89 else 4)
    elif rows <= 64:
        tile = GemmTile(next_power_of_2(rows), 64, 64, 4, 3)
    else:
        tile = GemmTile(64, 128, 64, 8, 3)
    return GemmTile(tile.block_m, tile.block_n, min(tile.block_k, max_block_k), tile.num_warps, tile.num_stages)


def pick_fused_moe_tile(
    capability: int | None, elem_bytes: int, pairs: int, num_experts: int, max_block_k: int, gated: bool
) -> GemmTile:
    """The tile of one ``fused_moe`` launch: ``pick_quantized_gemm_tile`` for the rows an expert's group holds on
    average (``pairs`` spread over ``min(pairs, num_experts)`` experts: decode gets the split-N decode tile, whose
    16 rows waste least on groups of one or two rows), with ``block_n`` halved for the gated launch, which holds two
    accumulators (gate and up), so its registers are the single launch's, and a K step of 32 on the 64-row 4-warp
    tile (64 spilled on sm_89). ``block_m`` never depends on ``gated``: a step's two launches share their row
    tiles.

    Args:
        capability: major * 10 + minor. elem_bytes: bytes per activation element. pairs: S = tokens * top_k.
        num_experts: E. max_block_k: as ``pick_quantized_gemm_tile``. gated: the gate/up launch.
    """
    rows = -(-pairs // max(1, min(pairs, num_experts)))
    tile = pick_quantized_gemm_tile(capability, elem_bytes, rows, max_block_k)
    if not gated:
        return tile
    # NOTE: on the 64-row, 4-warp tile a gated program dequantizes two (BLOCK_K, BLOCK_N) weight tiles a step, and
    # MXFP4's spilled 8 to 16 bytes on sm_89 at BLOCK_K 64 (with 2 or 3 stages; 8 warps spilled FP8's): 32 there
    block_k = min(tile.block_k, 32) if tile.block_m >= 64 and tile.num_warps == 4 else tile.block_k
    return GemmTile(tile.block_m, max(16, tile.block_n // 2), block_k, tile.num_warps, tile.num_stages)
