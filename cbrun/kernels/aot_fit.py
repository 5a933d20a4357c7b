"""Do the Triton kernels fit every GPU part? Compile each launch the engine can make, ahead of time, without a GPU.

Triton compiles for a named target with no device present (``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))``); ptxas and cuobjdump ship in the triton wheel. Two sources of launches:

* the engine's launches on each part: for each model shape, dtype and batch kind (decode, short verify, prefill)
  the launch exactly as the wrappers build it for that part's capability (``attention_launch_config``,
  ``kv_write_launch_config``), compiled for that part;
* every launch of the public wrappers (``paged_attention_triton``, ``write_kv_cache_triton``, and the
  batch-invariant ``batch_invariant_linear_triton``, ``rms_norm_triton``, ``log_softmax_triton``), made on small
  CPU tensors and recorded instead of run (``recording_launches``): off CUDA the wrappers choose the portable tile
  (and upcast bf16 dots), and each recorded launch is compiled for every part.

Model shapes cover every head size the supported families use (64, 80, 96, 128, 256). Launches that would run
the same binary are compiled once; for each, the shared memory (Triton's metadata) and the registers and stack
(``cuobjdump --dump-resource-usage``; stack bytes are register spills) are read back.

The weight-dequantizing GEMMs (``int4_gemm``, ``fp8_gemm``, ``mxfp4_gemm``) are checked the same way, each launch
built by ``gemm_launch.gemm_launch_config`` for decode, 17..64-row and large batches (``quantized_gemm_launches``;
``--quantized`` compiles only those, ``--with-quantized`` both).

Run ``python -m cbrun.kernels.aot_fit`` to print the full table (an hour or more on two cores; ``--subset``,
``--capability 90`` for less). The test is ``tests/kernels/test_kernel_fit.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from cbrun.kernels import batch_invariant_matmul, kv_cache_write, log_softmax, paged_attention, rms_norm
from cbrun.kernels.kv_cache_write import kv_write_launch_config
from cbrun.kernels.paged_attention import attention_launch_config
from cbrun.kernels.tile_policy import FIT_CAPABILITIES, SHARED_MEMORY_LIMITS, LaunchConfig

#: Architectures checked: A100 (sm_80), L4 / L40S / RTX 4090 (sm_89, whose 99 KiB limit is sm_86's too), H100 / H200.
CAPABILITIES = FIT_CAPABILITIES
#: The kernels, by the name a ``Launch`` carries.
KERNELS = {
    "paged_attention": paged_attention.paged_attention_kernel,
    "kv_cache_write": kv_cache_write.kv_cache_write_kernel,
    "batch_invariant_matmul": batch_invariant_matmul.batch_invariant_matmul_kernel,
    "rms_norm": rms_norm.rms_norm_kernel,
    "log_softmax": log_softmax.log_softmax_kernel,
}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Stack bytes (spills) allowed: none in 16-bit on sm_90 (the part cbrun is tuned for), a few elsewhere.
MAX_STACK_BYTES_SM90_16BIT = 0
MAX_STACK_BYTES = 16
#: Query lengths that reach every tile the policy can pick: decode, speculative verify (k + 1 <= 9), prefill chunks.
MAX_SEQLEN_Q = (1, 2, 4, 9, 16, 256, 8192)
#: Head sizes of the supported families: 64 (SmolLM2, gpt-oss), 80 (Phi-2 class), 96 (Phi-3), 128 (Llama-3,
#: Qwen2.5, Mistral), 256 (Gemma-2/3). 80 and 96 are padded to 128 in the kernel (HEAD_DIM_PADDED).
HEAD_SIZES = (64, 80, 96, 128, 256)


@dataclass(frozen=True)
class ModelShape:
    """Shape of a model: query heads, KV heads, head_dim; ``window`` when some layers slide, ``sinks`` when its
    attention has sinks (gpt-oss); ``hidden``, ``intermediate`` and ``vocab`` for the batch-invariant GEMMs and
    norms; ``bias`` when its q/k/v projections have a bias (Qwen2)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: bool = False
    sinks: bool = False
    hidden: int = 4096
    intermediate: int = 14336
    vocab: int = 128256
    bias: bool = False


MODELS = (
    ModelShape("Llama-3-8B", 32, 8, 128),
    ModelShape("Qwen2.5-7B", 28, 4, 128, hidden=3584, intermediate=18944, vocab=152064, bias=True),
    ModelShape("SmolLM2-135M", 9, 3, 64, hidden=576, intermediate=1536, vocab=49152),
    ModelShape("SmolLM2-1.7B", 32, 32, 64, hidden=2048, intermediate=8192, vocab=49152),
    ModelShape("Gemma-3-4B", 8, 4, 256, window=True, hidden=2560, intermediate=10240, vocab=262208),
    ModelShape("Gemma-3-1B", 4, 1, 256, window=True, hidden=1152, intermediate=6912, vocab=262144),
    ModelShape("MHA-80 (Phi-2)", 32, 32, 80, hidden=2560, intermediate=10240, vocab=51200, bias=True),
    ModelShape("MHA-96 (Phi-3-mini)", 32, 32, 96, hidden=3072, intermediate=8192, vocab=32064),
    ModelShape("gpt-oss-20b", 64, 8, 64, window=True, sinks=True, hidden=2880, intermediate=2880, vocab=201088),
)
assert {m.head_dim for m in MODELS} == set(HEAD_SIZES)

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Launch:
    """One compiled kernel: which kernel (a ``KERNELS`` name), its dtype, its launch config, the first model/batch
    that made it, and its argument types: ``signature`` ((name, Triton type) per non-constexpr argument) and
    ``divisible`` (the indices of arguments Triton would specialise as 16-divisible)."""

    kernel: str
    dtype: torch.dtype
    config: LaunchConfig
    example: str
    signature: tuple = ()
    divisible: tuple = ()

    def key(self) -> tuple:
        return (self.kernel, self.dtype, self.signature, self.divisible) + self.config.key()


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
                    launch = _engine_launch("paged_attention", dtype, config, f"{model.name} max_q={max_q}")
                    launches.setdefault(launch.key(), launch)
            if kv_write:
                config = kv_write_launch_config(model.num_kv_heads, model.head_dim, page_size)
                launch = _engine_launch("kv_cache_write", dtype, config, model.name)
                launches.setdefault(launch.key(), launch)
    return list(launches.values())


def _engine_launch(kernel: str, dtype: torch.dtype, config: LaunchConfig, example: str) -> Launch:
    signature, divisible = _signature(KERNELS[kernel], dtype, config.constexprs)
    return Launch(kernel, dtype, config, example, signature, divisible)


@contextlib.contextmanager
def recording_launches():
    """Within it, a launch of any kernel of ``KERNELS`` is recorded as a ``Launch`` (its constexprs, warps, stages
    and argument types, from the arguments given) and not run; yields the list they are appended to."""
    recorded: list[Launch] = []
    names = {id(kernel): name for name, kernel in KERNELS.items()}

    def recorder(kernel):
        def run(*args, grid, warmup, **kwargs):
            num_warps, num_stages = kwargs.pop("num_warps"), kwargs.pop("num_stages")
            constexprs = {name: kwargs.pop(name) for name in list(kwargs) if name in kernel.arg_names}
            assert not kwargs, f"unexpected launch options {sorted(kwargs)}"
            values = dict(zip(kernel.arg_names, args))
            signature, divisible, dtype = _signature_of_values(kernel, values, constexprs)
            config = LaunchConfig(constexprs, num_warps, num_stages)
            recorded.append(Launch(names[id(kernel)], dtype, config, "", signature, divisible))

        return run

    for kernel in KERNELS.values():
        kernel.run = recorder(kernel)  # JITFunction.__getitem__ calls self.run: the instance attribute wins
    try:
        yield recorded
    finally:
        for kernel in KERNELS.values():
            del kernel.run


def wrapper_launches(
    models=MODELS,
    dtypes=DTYPES,
    max_seqlen_qs=MAX_SEQLEN_Q,
    page_size: int = 16,
    windows: bool = True,
    kv_write: bool = True,
    invariant: bool = True,
) -> list[Launch]:
    """Every distinct launch the public wrappers make on the CPU (portable tiles; bf16 dots upcast) for ``models``
    x ``dtypes``: paged attention at each of ``max_seqlen_qs`` (with the model's window when it has one and
    ``windows``, its sinks, and ``batch_invariant``), the KV-cache write with ``kv_write``, and with ``invariant`` the batch-invariant matmul (each
    projection and the LM head, bias where the model has one), RMSNorm (hidden and per-head) and log-softmax
    (vocab). Tensors are small: only shapes that change a launch are the model's."""
    launches: dict[tuple, Launch] = {}
    with recording_launches() as recorded:
        for model in models:
            for dtype in dtypes:
                start = len(recorded)
                for device in ("cpu", "meta"):  # the CPU's launches (bf16 dots upcast) and a device's
                    device_ = torch.device(device)
                    _call_wrappers(model, dtype, max_seqlen_qs, page_size, windows, kv_write, invariant, device_)
                for launch in recorded[start:]:
                    named = Launch(
                        launch.kernel,
                        launch.dtype,
                        launch.config,
                        f"{model.name} (wrapper)",
                        launch.signature,
                        launch.divisible,
                    )
                    launches.setdefault(named.key(), named)
    return list(launches.values())


def _call_wrappers(
    model: ModelShape,
    dtype: torch.dtype,
    max_seqlen_qs,
    page_size: int,
    windows: bool,
    kv_write: bool,
    invariant: bool,
    device: torch.device,
) -> None:
    """Call each public wrapper once per launch shape of ``model`` in ``dtype`` (under ``recording_launches``), on
    ``device``: "cpu" makes the launches the interpreter runs, "meta" (no data, not the CPU) a device's, with the
    tile the wrappers pick where the capability is unknown (the portable one)."""
    heads, kv_heads, head_dim = model.num_heads, model.num_kv_heads, model.head_dim

    def zeros(*shape, dtype=dtype):
        return torch.zeros(*shape, dtype=dtype, device=device)

    query, key = zeros(1, heads, head_dim), zeros(1, kv_heads, head_dim)
    k_cache, v_cache = zeros(2, page_size, kv_heads, head_dim), zeros(2, page_size, kv_heads, head_dim)
    tables, cu_seqlens_q, seqlens_k = (
        zeros(1, 2, dtype=torch.int32),
        zeros(2, dtype=torch.int32),
        zeros(1, dtype=torch.int32),
    )
    sinks = zeros(heads, dtype=torch.float32) if model.sinks else None
    if kv_write:
        kv_cache_write.write_kv_cache_triton(key, key, k_cache, v_cache, zeros(1, dtype=torch.int32))
    for window in (None, 4096) if model.window and windows else (None,):
        for max_q in max_seqlen_qs:
            for batch_invariant in (False, True) if invariant else (False,):
                paged_attention.paged_attention_triton(
                    query,
                    k_cache,
                    v_cache,
                    tables,
                    cu_seqlens_q,
                    seqlens_k,
                    head_dim**-0.5,
                    sliding_window=window,
                    max_seqlen_q=max_q,
                    batch_invariant=batch_invariant,
                    sinks=sinks,
                )
    if invariant:
        _call_invariant_wrappers(model, zeros)


def _call_invariant_wrappers(model: ModelShape, zeros: Callable[..., torch.Tensor]) -> None:
    """Call the batch-invariant wrappers once per launch shape of ``model``: the matmul for each projection and the
    LM head (bias where the model has one), RMSNorm over the hidden size and per head, log-softmax over the vocab;
    ``zeros(*shape)`` makes their tensors (the dtype and device of ``_call_wrappers``)."""
    heads, kv_heads, head_dim = model.num_heads, model.num_kv_heads, model.head_dim
    hidden, qkv = model.hidden, (heads + 2 * kv_heads) * head_dim
    for in_features, out_features, bias in (
        (hidden, qkv, model.bias),
        (heads * head_dim, hidden, False),
        (hidden, model.intermediate, False),
        (model.intermediate, hidden, False),
        (hidden, model.vocab, False),
    ):
        # NOTE: N never reaches the binary but as a runtime int, 16-divisible or not: a 16 + N % 16 feature
        # weight makes the same launch without gigabytes of zeros.
        out_features = 16 + out_features % 16
        batch_invariant_matmul.batch_invariant_linear_triton(
            zeros(1, in_features), zeros(out_features, in_features), zeros(out_features) if bias else None
        )
    for columns in (hidden, head_dim):
        rms_norm.rms_norm_triton(zeros(1, columns), zeros(columns), 1e-6)
    log_softmax.log_softmax_triton(zeros(1, model.vocab))


def fit_launches(capability: int, **matrix) -> list[Launch]:
    """Every distinct launch compiled for ``capability``: the engine's for that part (``engine_launches``) and
    the public wrappers' (``wrapper_launches``), with ``matrix`` narrowing both (``SUBSET``)."""
    engine_matrix = {k: v for k, v in matrix.items() if k != "invariant"}
    wrapper_matrix = dict(matrix)
    launches = {launch.key(): launch for launch in engine_launches(capability, **engine_matrix)}
    for launch in _cached_wrapper_launches(tuple(sorted(wrapper_matrix.items()))):
        launches.setdefault(launch.key(), launch)
    return list(launches.values())


@functools.lru_cache(maxsize=4)
def _cached_wrapper_launches(matrix: tuple) -> list[Launch]:
    return wrapper_launches(**dict(matrix))


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
        kernel = KERNELS[launch.kernel]
        signature = dict(launch.signature)
        signature.update({name: "constexpr" for name in constexprs})
        signature = {name: signature[name] for name in kernel.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i in launch.divisible}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", capability, 32),
        options=dict(num_warps=launch.config.num_warps, num_stages=launch.config.num_stages),
    )
    registers, stack = _resource_usage(compiled.asm["cubin"])
    return Fit(launch, capability, int(compiled.metadata.shared), registers, stack)


def _signature(kernel, dtype: torch.dtype, constexprs: dict) -> tuple[tuple, tuple]:
    """Argument types of an engine launch of an attention or KV-write kernel as the runtime would specialise them:
    float tensors in ``dtype``, index tensors int32, pointers and strides 16-divisible (every cache and activation
    tensor the engine passes is). Returns (signature, divisible) as ``Launch`` holds them."""
    name = _DTYPE_NAMES[dtype]
    signature, divisible = [], []
    for i, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            continue
        if arg.endswith("_ptr"):
            index_arg = arg in ("block_tables_ptr", "cu_seqlens_q_ptr", "seqlens_k_ptr", "slot_mapping_ptr")
            signature.append((arg, "*i32" if index_arg else ("*fp32" if arg == "sinks_ptr" else f"*{name}")))
            divisible.append(i)
        elif arg in ("scale", "softcap"):
            signature.append((arg, "fp32"))
        else:
            signature.append((arg, "i32"))
            if arg.startswith("stride") and arg != "stride_block_table":
                divisible.append(i)
    return tuple(signature), tuple(divisible)


_TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
}


def _signature_of_values(kernel, values: dict, constexprs: dict) -> tuple[tuple, tuple, torch.dtype]:
    """(signature, divisible, dtype) of a recorded launch: each tensor's element type (pointers 16-divisible, as
    the device allocator aligns them), float scalars fp32, ints i32 and 16-divisible where their value is (as
    Triton specialises them, except ``do_not_specialize`` ones); ``dtype`` is the last float input's (not the
    output's, nor the float32 sinks')."""
    signature, divisible, dtype = [], [], None
    # NOTE: an interpreted kernel (TRITON_INTERPRET=1, the test session) keeps @triton.jit's options in ``kwargs``.
    options = getattr(kernel, "do_not_specialize", None) or getattr(kernel, "kwargs", {}).get("do_not_specialize")
    unspecialised = {kernel.arg_names[i] if isinstance(i, int) else i for i in options or ()}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            continue
        value = values[name]
        if isinstance(value, torch.Tensor):
            signature.append((name, f"*{_TRITON_TYPES[value.dtype]}"))
            divisible.append(i)
            if value.dtype.is_floating_point and (dtype is None or name != "out_ptr"):
                dtype = value.dtype if dtype is None or name != "sinks_ptr" else dtype
        elif isinstance(value, float):
            signature.append((name, "fp32"))
        else:
            signature.append((name, "i32"))
            if int(value) % 16 == 0 and name not in unspecialised:
                divisible.append(i)
    assert dtype is not None, f"{kernel.__name__} launched without a float tensor"
    return tuple(signature), tuple(divisible), dtype


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
    elif "HEAD_DIM_PADDED" in c:
        tile = f"D={c['HEAD_DIM']} M={c['BLOCK_M']} N={c['BLOCK_N']}" + (" up" if c["DOT_IN_FP32"] else "")
    elif "BLOCK_K" in c:
        tile = f"M={c['BLOCK_M']} N={c['BLOCK_N']} K={c['BLOCK_K']}" + (" bias" if c["HAS_BIAS"] else "")
        tile += " up" if c.get("DOT_IN_FP32") else ""
    elif "BLOCK" in c:
        tile = f"BLOCK={c['BLOCK']}"
    else:
        tile = f"H={c['NUM_KV_HEADS']} D={c['HEAD_DIM']}"
    return (
        f"sm_{fit.capability} | {fit.launch.kernel} | {_DTYPE_NAMES[fit.launch.dtype]} | {tile} "
        f"w={fit.launch.config.num_warps} | {fit.shared // 1024} KiB / {fit.shared_limit // 1024} | "
        f"{fit.registers} | {fit.stack} | {'ok' if fit.ok else 'NO'} | {fit.launch.example}"
    )


#: A representative subset, for the default test run: Gemma-3 (head_dim 256) and the head_dim-80 shape in bf16,
#: the decode and the prefill tile, for the engine on each part and for the public wrappers (portable tiles, bf16
#: dots upcast as on the CPU, and not), with the batch-invariant kernels: the largest tiles, and the launches that
#: did not fit before (issue 39).
SUBSET = dict(
    models=tuple(m for m in MODELS if m.name in ("Gemma-3-4B", "MHA-80 (Phi-2)")),
    dtypes=(torch.bfloat16,),
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
            launches = [] if args.quantized or args.fused_moe else fit_launches(capability, **matrix)
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
        _write_json(args.json, fits)
    return 1 if bad else 0


def _write_json(path: Path, fits: list[Fit]) -> None:
    """Write every launch's figures (architecture, kernel, shared memory and its limit, registers, stack, fits, the
    table's line) to ``path`` as a JSON list."""
    path.write_text(
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
