"""Do the Triton kernels fit every GPU part? Compile each launch the engine can make, ahead of time, without a GPU.

Triton compiles for a named target with no device present (``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))``); ptxas and cuobjdump ship in the triton wheel. For each model shape, dtype
and batch kind (decode, short verify, prefill) this builds the launch exactly as the wrappers do
(``paged_attention.attention_launch_config``, ``kv_cache_write.kv_write_launch_config``), drops launches that
would run the same binary, compiles each for each architecture, and reads back the shared memory (Triton's
metadata) and the registers and stack (``cuobjdump --dump-resource-usage``; stack bytes are register spills).

The weight-dequantizing GEMMs (``int4_gemm``, ``fp8_gemm``, ``mxfp4_gemm``) are checked the same way, each launch
built by ``gemm_launch.gemm_launch_config`` for decode, 17..64-row and large batches (``quantized_gemm_launches``;
``--quantized`` compiles only those, ``--with-quantized`` both).

Run ``python -m cbrun.kernels.aot_fit`` to print the full table (several minutes on two cores; ``--subset``,
``--capability 90`` for less). The test is ``tests/kernels/test_kernel_fit.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from cbrun.kernels.kv_cache_write import kv_cache_write_kernel, kv_write_launch_config
from cbrun.kernels.paged_attention import LaunchConfig, attention_launch_config, paged_attention_kernel
from cbrun.kernels.tile_policy import SHARED_MEMORY_LIMITS

#: Architectures checked: A100 (sm_80), L4 / L40S / RTX 4090 (sm_89, whose 99 KiB limit is sm_86's too), H100 / H200.
CAPABILITIES = (80, 89, 90)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Stack bytes (spills) allowed: none in 16-bit on sm_90 (the part cbrun is tuned for), a few elsewhere.
MAX_STACK_BYTES_SM90_16BIT = 0
MAX_STACK_BYTES = 16
#: Query lengths that reach every tile the policy can pick: decode, speculative verify (k + 1 <= 9), prefill.
MAX_SEQLEN_Q = (1, 2, 4, 9, 16, 8192)


@dataclass(frozen=True)
class ModelShape:
    """Attention shape of a model: query heads, KV heads, head_dim; ``window`` when some layers slide, ``sinks``
    when its attention has sinks (gpt-oss)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: bool = False
    sinks: bool = False


MODELS = (
    ModelShape("Llama-3-8B", 32, 8, 128),
    ModelShape("Qwen2.5-7B", 28, 4, 128),
    ModelShape("SmolLM2-135M", 9, 3, 64),
    ModelShape("SmolLM2-1.7B", 32, 32, 64),
    ModelShape("Gemma-3-4B", 8, 4, 256, window=True),
    ModelShape("MHA-80 (Phi-2)", 32, 32, 80),
    ModelShape("gpt-oss-20b", 64, 8, 64, window=True, sinks=True),
)

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Launch:
    """One compiled kernel: which kernel, its dtype, its launch config, and the first model/batch that made it."""

    kernel: str
    dtype: torch.dtype
    config: LaunchConfig
    example: str

    def key(self) -> tuple:
        return (self.kernel, self.dtype) + self.config.key()


@dataclass(frozen=True)
class Fit:
    """Resource use of one launch compiled for one architecture (bytes, registers per thread)."""

    launch: Launch
    capability: int
    shared: int
    registers: int
    stack: int

    @property
    def shared_limit(self) -> int:
        return SHARED_MEMORY_LIMITS[self.capability]

    @property
    def stack_limit(self) -> int:
        sixteen_bit = self.launch.dtype != torch.float32
        return MAX_STACK_BYTES_SM90_16BIT if self.capability >= 90 and sixteen_bit else MAX_STACK_BYTES

    @property
    def ok(self) -> bool:
        return self.shared <= self.shared_limit and self.stack <= self.stack_limit


def engine_launches(
    capability: int,
    models=MODELS,
    dtypes=DTYPES,
    max_seqlen_qs=MAX_SEQLEN_Q,
    page_size: int = 16,
    windows: bool = True,
    kv_write: bool = True,
) -> list[Launch]:
    """Every distinct launch the engine makes on ``capability`` for ``models`` x ``dtypes`` x batch kinds
    (``windows``: also the sliding-window variant of models with one; ``kv_write``: also the KV-cache write)."""
    launches: dict[tuple, Launch] = {}
    for model in models:
        for dtype in dtypes:
            for window in (False, True) if model.window and windows else (False,):
                for max_q in max_seqlen_qs:
                    config = attention_launch_config(
                        dtype,
                        model.num_heads,
                        model.num_kv_heads,
                        model.head_dim,
                        page_size,
                        max_q,
                        window,
                        False,
                        capability,
                        use_sinks=model.sinks,
                    )
                    launch = Launch("paged_attention", dtype, config, f"{model.name} max_q={max_q}")
                    launches.setdefault(launch.key(), launch)
            if kv_write:
                config = kv_write_launch_config(model.num_kv_heads, model.head_dim, page_size)
                launch = Launch("kv_cache_write", dtype, config, model.name)
                launches.setdefault(launch.key(), launch)
    return list(launches.values())


def compile_launch(launch: Launch, capability: int) -> Fit:
    """Compile ``launch`` for ``capability`` (no GPU needed) and read its shared memory, registers and stack."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = launch.config.constexprs
    if launch.kernel in QUANTIZED_GEMM_POINTERS:
        kernel = _quantized_gemm_kernel(launch.kernel)
        signature, attrs = _gemm_signature(kernel, launch.kernel, launch.dtype, constexprs)
    elif launch.kernel == "fused_moe":
        from cbrun.kernels.fused_moe import fused_moe_kernel as kernel

        signature, attrs = _fused_moe_signature(kernel, launch.dtype, constexprs)
    else:
        kernel = paged_attention_kernel if launch.kernel == "paged_attention" else kv_cache_write_kernel
        signature, attrs = _signature(kernel, launch.dtype, constexprs)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", capability, 32),
        options=dict(num_warps=launch.config.num_warps, num_stages=launch.config.num_stages),
    )
    registers, stack = _resource_usage(compiled.asm["cubin"])
    return Fit(launch, capability, int(compiled.metadata.shared), registers, stack)


def _signature(kernel, dtype: torch.dtype, constexprs: dict) -> tuple[dict, dict]:
    """Argument types as the runtime would specialise them: float tensors in ``dtype``, index tensors int32,
    pointers and strides 16-divisible (every cache and activation tensor the engine passes is)."""
    name = _DTYPE_NAMES[dtype]
    signature, attrs = {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            index_arg = arg in ("block_tables_ptr", "cu_seqlens_q_ptr", "seqlens_k_ptr", "slot_mapping_ptr")
            signature[arg] = "*i32" if index_arg else ("*fp32" if arg == "sinks_ptr" else f"*{name}")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in ("scale", "softcap"):
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            if arg.startswith("stride") and arg != "stride_block_table":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) of the one kernel in ``cubin``, from cuobjdump."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    return int(match.group(1)), int(match.group(2))


def format_fit(fit: Fit) -> str:
    """One table line for ``fit``."""
    c = fit.launch.config.constexprs
    if "WEIGHT_FORMAT" in c:
        tile = f"M={c['BLOCK_M']} N={c['BLOCK_N']} K={c['BLOCK_K']} {_fused_moe_variant(c)}"
    elif "BLOCK_K" in c:
        tile = f"M={c['BLOCK_M']} N={c['BLOCK_N']} K={c['BLOCK_K']}{' bias' if c['HAS_BIAS'] else ''}"
    elif "BLOCK_M" in c:
        tile = f"D={c.get('HEAD_DIM')} M={c['BLOCK_M']} N={c['BLOCK_N']}"
    else:
        tile = f"H={c['NUM_KV_HEADS']} D={c['HEAD_DIM']}"
    return (
        f"sm_{fit.capability} | {fit.launch.kernel} | {_DTYPE_NAMES[fit.launch.dtype]} | {tile} "
        f"w={fit.launch.config.num_warps} | {fit.shared // 1024} KiB / {fit.shared_limit // 1024} | "
        f"{fit.registers} | {fit.stack} | {'ok' if fit.ok else 'NO'} | {fit.launch.example}"
    )


#: A representative subset, for the default test run (7 binaries per architecture): Llama-3-8B (head_dim 128) and
#: Gemma-3 (head_dim 256), bf16 and float32, the decode and the prefill tile: the largest tiles, and the dtypes and
#: head dims that were hardest to fit.
SUBSET = dict(
    models=tuple(m for m in MODELS if m.name in ("Llama-3-8B", "Gemma-3-4B")),
    dtypes=(torch.bfloat16, torch.float32),
    max_seqlen_qs=(1, 8192),
    windows=False,
    kv_write=False,
)


def main(argv: list[str] | None = None) -> int:
    """Compile every launch for every architecture; print one line each; exit 1 if any does not fit.

    NOTE: run it in a process without ``TRITON_INTERPRET`` set: under the interpreter ``@triton.jit`` makes
    functions that cannot be compiled for a GPU.
    """
    parser = argparse.ArgumentParser(prog="python -m cbrun.kernels.aot_fit", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--capability",
        type=int,
        action="append",
        choices=sorted(SHARED_MEMORY_LIMITS),
        help="architecture(s) to compile for, e.g. 90 (default: 80, 89 and 90)",
    )
    parser.add_argument("--subset", action="store_true", help="only the representative subset (SUBSET)")
    parser.add_argument("--json", type=Path, help="also write every launch's figures here")
    parser.add_argument(
        "--quantized",
        action="store_true",
        help="the quantized GEMMs only (quantized_gemm_launches; with --subset, QUANTIZED_SUBSET)",
    )
    parser.add_argument("--with-quantized", action="store_true", help="the attention launches and the quantized GEMMs")
    parser.add_argument(
        "--fused-moe",
        action="store_true",
        help="the fused MoE kernel only (fused_moe_launches; with --subset, FUSED_MOE_SUBSET)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    matrix = SUBSET if args.subset else {}
    gemm_matrix = QUANTIZED_SUBSET if args.subset else {}
    fits = []
    with tempfile.TemporaryDirectory(prefix="cbrun-aot-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # NOTE: nothing cached across runs: every binary is compiled here
        print("arch | kernel | dtype | tile | shared | regs | stack | fits | first made by")
        for capability in args.capability or CAPABILITIES:
            launches = [] if args.quantized or args.fused_moe else engine_launches(capability, **matrix)
            if args.quantized or args.with_quantized:
                launches += quantized_gemm_launches(capability, **gemm_matrix)
            if args.fused_moe:
                launches += fused_moe_launches(capability, **(FUSED_MOE_SUBSET if args.subset else {}))
            for launch in launches:
                fits.append(compile_launch(launch, capability))
                print(format_fit(fits[-1]), flush=True)
    bad = [f for f in fits if not f.ok]
    print(f"{len(fits) - len(bad)} of {len(fits)} launches fit")
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    dict(
                        capability=f.capability,
                        kernel=f.launch.kernel,
                        shared=f.shared,
                        shared_limit=f.shared_limit,
                        registers=f.registers,
                        stack=f.stack,
                        ok=f.ok,
                        line=format_fit(f),
                    )
                    for f in fits
                ]
            )
        )
    return 1 if bad else 0


#: Each quantized GEMM's pointer arguments that are not in the activations' dtype, with their Triton types.
QUANTIZED_GEMM_POINTERS = {
    "int4_gemm": {"packed_ptr": "*i32", "zeros_ptr": "*u8", "scales_ptr": "*fp32"},
    "fp8_gemm": {"w_ptr": "*u8", "scale_ptr": "*fp32"},
    "mxfp4_gemm": {"blocks_ptr": "*u8", "scales_ptr": "*u8"},
}
#: The K-step caps a launch can get, per kernel: int4 group 128 and the shorter group 32 (channel-strategy and
#: FP8 128 x 128 / per-channel layouts get 128, MXFP4 always 128).
QUANTIZED_BLOCK_K_CAPS = {"int4_gemm": (128, 32), "fp8_gemm": (128,), "mxfp4_gemm": (128,)}
#: Rows that reach each tile of ``pick_quantized_gemm_tile``: decode, 17..32, 33..64, larger batches and prefill.
QUANTIZED_ROWS = (1, 32, 64, 256)
#: The default test run's share: 16-bit and float32, the decode and the large tile, no bias.
QUANTIZED_SUBSET = dict(dtypes=(torch.bfloat16, torch.float32), rows=(1, 256), biases=(False,), all_caps=False)


def quantized_gemm_launches(
    capability: int,
    dtypes=DTYPES,
    rows=QUANTIZED_ROWS,
    biases=(False, True),
    all_caps: bool = True,
) -> list[Launch]:
    """Every distinct launch of the quantized GEMMs on ``capability`` (``gemm_launch.gemm_launch_config``, as the
    wrappers make them) for ``dtypes`` x ``rows`` x ``biases`` x each kernel's K-step caps (only the first,
    group 128's, unless ``all_caps``)."""
    from cbrun.kernels.gemm_launch import gemm_launch_config

    launches: dict[tuple, Launch] = {}
    for kernel, caps in QUANTIZED_BLOCK_K_CAPS.items():
        for cap in caps if all_caps else caps[:1]:
            for dtype in dtypes:
                for m in rows:
                    for bias in biases:
                        config = gemm_launch_config(dtype, m, cap, capability, bias)
                        launch = Launch(kernel, dtype, config, f"rows={m} block_k<={cap}")
                        launches.setdefault(launch.key(), launch)
    return list(launches.values())


def _quantized_gemm_kernel(name: str):
    import importlib

    return getattr(importlib.import_module(f"cbrun.kernels.{name}"), f"{name}_kernel")


def _gemm_signature(kernel, name: str, dtype: torch.dtype, constexprs: dict) -> tuple[dict, dict]:
    """Argument types of a quantized GEMM as the runtime specialises them: activations, output and bias in
    ``dtype``, the weight's tensors in their own types (``QUANTIZED_GEMM_POINTERS``); pointers, N, K and the row
    strides of x and out 16-divisible, as the runtime finds them for every model it serves (4096, 14336, 2880, ...).
    M stays unspecialised (the runtime specialises M = 1, a simpler binary than the one checked)."""
    weight = QUANTIZED_GEMM_POINTERS[name]
    signature, attrs = {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = weight.get(arg, f"*{_DTYPE_NAMES[dtype]}")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "i32"
            if arg in ("N", "K", "stride_out_m", "stride_x_m"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


# --- the fused MoE kernel (cbrun.kernels.fused_moe) ------------------------------------------------------------------

#: The weight tensors' Triton types per format (values, scales, zero points; an unused pointer gets x's type).
FUSED_MOE_WEIGHT_POINTERS = {
    "dense": (None, None, None),
    "int4": ("*i32", "*fp32", "*u8"),
    "fp8": ("*u8", "*fp32", None),
    "mxfp4": ("*u8", "*u8", None),
}
#: The K-step caps a launch can get per format: int4 group 128 and 32, the rest 128.
FUSED_MOE_BLOCK_K_CAPS = {"dense": (128,), "int4": (128, 32), "fp8": (128,), "mxfp4": (128,)}
#: (pairs, experts) that reach each tile of ``pick_fused_moe_tile``: decode (8 pairs over 128 experts, one row a
#: group), 32 and 64 rows a group, and prefill (256 rows a group).
FUSED_MOE_SHAPES = ((8, 128), (256, 8), (512, 8), (32768, 128))
#: The launch variants: (gated, activation, biases): Qwen3-MoE / Mixtral's gated and down launches, gpt-oss's.
FUSED_MOE_VARIANTS = ((True, "silu", False), (False, "silu", False), (True, "swiglu_oai", True), (False, "silu", True))
#: The default test run's share: bf16 and float32, the decode and the prefill tile, each format's gated launch.
FUSED_MOE_SUBSET = dict(
    dtypes=(torch.bfloat16, torch.float32),
    shapes=(FUSED_MOE_SHAPES[0], FUSED_MOE_SHAPES[-1]),
    variants=FUSED_MOE_VARIANTS[:1],
    all_caps=False,
)


def fused_moe_launches(
    capability: int,
    dtypes=DTYPES,
    shapes=FUSED_MOE_SHAPES,
    variants=FUSED_MOE_VARIANTS,
    all_caps: bool = True,
) -> list[Launch]:
    """Every distinct launch of ``fused_moe_kernel`` on ``capability`` (``fused_moe.fused_moe_launch_config``, as
    ``fused_moe_triton`` makes them) for each weight format x ``dtypes`` x ``shapes`` x ``variants`` (the down
    launch with float32 routing weights, Mixtral's, the widest store)."""
    from cbrun.kernels.fused_moe import fused_moe_launch_config

    launches: dict[tuple, Launch] = {}
    for fmt, caps in FUSED_MOE_BLOCK_K_CAPS.items():
        for cap in caps if all_caps else caps[:1]:
            for dtype in dtypes:
                for pairs, experts in shapes:
                    for gated, activation, bias in variants:
                        config = fused_moe_launch_config(
                            dtype, pairs, experts, cap, capability, fmt, gated, activation, bias, not gated
                        )
                        launch = Launch("fused_moe", dtype, config, f"{fmt} pairs={pairs} E={experts} block_k<={cap}")
                        launches.setdefault(launch.key(), launch)
    return list(launches.values())


def _fused_moe_variant(c: dict) -> str:
    """A fused-MoE launch's format and variant, for the table."""
    from cbrun.kernels.fused_moe import ACTIVATIONS, WEIGHT_FORMATS

    kind = f"gated {ACTIVATIONS[c['ACTIVATION']]}" if c["GATED"] else "down"
    return f"{WEIGHT_FORMATS[c['WEIGHT_FORMAT']]} {kind}{' bias' if c['HAS_BIAS'] else ''}"


def _fused_moe_signature(kernel, dtype: torch.dtype, constexprs: dict) -> tuple[dict, dict]:
    """Argument types of ``fused_moe_kernel`` as the runtime specialises them: x, the intermediate and biases in
    ``dtype``, the down launch's output and routing weights float32, the pair and tile indices int32, the weights
    in their format's types; pointers, N, K and the row strides 16-divisible (as the runtime finds them for the
    models it serves), the token and tile counts unspecialised."""
    from cbrun.kernels.fused_moe import WEIGHT_FORMATS

    name = _DTYPE_NAMES[dtype]
    values, scales, zeros = FUSED_MOE_WEIGHT_POINTERS[WEIGHT_FORMATS[constexprs["WEIGHT_FORMAT"]]]
    types = {
        "out_ptr": f"*{name}" if constexprs["GATED"] else "*fp32",
        "sorted_pairs_ptr": "*i32",
        "tile_map_ptr": "*i32",
        "routing_ptr": "*fp32",
        "w_ptr": values,
        "w2_ptr": values,
        "s_ptr": scales,
        "s2_ptr": scales,
        "z_ptr": zeros,
        "z2_ptr": zeros,
    }
    signature, attrs = {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = types.get(arg) or f"*{name}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in ("alpha", "limit"):
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            if arg in ("N", "K", "stride_out_m", "stride_a_m", "stride_w_e", "stride_w_n"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


if __name__ == "__main__":
    sys.exit(main())
