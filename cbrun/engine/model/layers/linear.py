"""The lean forward pass's linear layers: a projection is (weight, bias, the function that runs it), the function
chosen once per weight at load (``projection``): a quantized weight's chunked dequantizing GEMM
(``cbrun.engine.model.layers.quantization.base.quantized_linear``; a float8 weight's W8A8 GEMM under
``engine.fp8_activation_scheme = "dynamic"``), else, on the CPU, torch's GEMM (``F.linear``, MKL on x86) or
oneDNN's.

Measured on a 2-core AMD EPYC (AVX-512), float32 (``python -m benchmarks.cpu_linear``,
``benchmarks/results-cpu-linear.md``): for weights of at least 2^18 elements (1 MiB), oneDNN's matmul primitive
(the ``mkldnn::_linear_pointwise`` op that inductor's CPU backend calls) runs 8 to 256 rows 0.9-1.4x as fast as
torch's GEMM (MKL) at one thread (1.05x or more from 64 rows) and 1.03-2.4x at two; the 32000-wide LM head of a
40M Llama 1.2-1.4x at one thread and 1.3-2.4x at two. Below that size oneDNN's fixed cost per call (about 12-15 us)
makes it up to 5x slower. So under ``linear_backend = "auto"`` each weight gets the faster one by its size, once,
when the model is loaded. On workload 2 (``cbrun bench --workload random-llama-30m``) this gave 1.11x tokens/s at
one thread and 1.28x at two (``python -m benchmarks.linear_backend_ab``), with the same output tokens.

The safetensors loader packs each weight that will run on oneDNN (``pack_for_onednn``: oneDNN's own blocked
layout, as inductor's freezing pass packs it), so no call reorders it. Measured on the same machine (float32,
``torch.ops.mkldnn._linear_pointwise`` warm, one thread): 16 rows of a 512 x 512 weight 113 us on torch's GEMM, 119
unpacked, 93-102 packed; of a 4096 x 512 LM head 910 unpacked, 630-660 packed; 1.0-1.1x from 64 rows on. Packed, the
fixed cost per call is about 13 us, and from 2^17 elements (256 x 512) oneDNN matches or beats torch's GEMM at 4 to 64
rows (1.03-1.07x at one thread, 1.15-1.49x at two), losing only at one row (11 against 21 us): so packed weights
run on oneDNN from ``ONEDNN_PACKED_MIN_WEIGHT_ELEMENTS``. Within a MoE model's decode step (``benchmarks/moe_lean.py``'s
model, 16 rows, one thread, ``torch.profiler`` over 10 steps), whose experts evict the caches between layers, the
dense projections took 4.3-4.8 ms a step unpacked and 3.1-3.4 ms packed.

The two GEMMs sum in different orders: their outputs differ by float32 rounding (relative ~1e-6), like any two
BLAS libraries, so the lean path's logits equal transformers' bit for bit only where every weight runs on torch's
(``linear_backend = "torch"``, or a model whose weights are all under the threshold, e.g. stories260K).

Batch invariance (``engine.batch_invariant``, ``batch_invariant_linear``): neither GEMM computes a row the same way
for every number of rows. Measured on the same machine (float32, 1 and 2 threads, weights 64x128 to 32000x512,
``tests/engine/model/test_cpu_linear.py``): torch's GEMM (MKL) gives a row other bits below 16 rows (3 for
64-wide inputs), and at two threads for some shapes (1408 or 896 inputs) below 200 rows, where it splits the sum
over threads; oneDNN gives a row the same bits for every row count from 2 to 1024 and at any row offset, at one
and two threads, but another at 1 row (a GEMV). So the invariant linear is oneDNN with a single row padded to two,
checked once per weight shape at load (``_onednn_rows_independent``); where oneDNN is unavailable or that check
fails it runs fixed tiles of ``INVARIANT_TILE_ROWS`` rows (every call the same shape, the last tile padded),
1.2-2x slower. This is Thinking Machines' batch-invariant matmul ("Defeating Nondeterminism in LLM Inference",
2025: one reduction order whatever the batch) obtained from the libraries rather than written anew.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cbrun.engine.config import LINEAR_BACKENDS
from cbrun.engine.model.layers.quantization.base import QuantizedLinearWeight, quantized_linear
from cbrun.engine.model.layers.quantization.fp8 import QuantizedWeight, check_w8a8, w8a8_linear

logger = logging.getLogger("cbrun.engine")

#: Weights with at least this many elements run on oneDNN under "auto" (see the module docstring).
ONEDNN_MIN_WEIGHT_ELEMENTS = 1 << 18
#: The same for a weight the loader packs (``packs_for_onednn``): packed, oneDNN's fixed cost per call is smaller.
ONEDNN_PACKED_MIN_WEIGHT_ELEMENTS = 1 << 17
#: The row count oneDNN packs a weight's layout for (``pack_for_onednn``). Measured (float32, one thread): packed
#: for 2 to 1024 rows, a call of 4 to 256 rows runs within 10% of the same; packed for 1 row (oneDNN's GEMV
#: layout), 16 rows lose the gain.
ONEDNN_PACKED_ROWS = 16

LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
#: (weight (out_features, in_features) or a ``QuantizedLinearWeight``, bias (out_features,) or None, the function
#: that runs them): one linear layer of the lean path, ready to run (``projection``, ``apply_linear``).
Projection = tuple["torch.Tensor | QuantizedLinearWeight", "torch.Tensor | None", Callable]
#: Which GEMM a projection gets: a ``linear_backend`` name, or a function of the weight giving its ``LinearFn``.
Backend = str | Callable[[torch.Tensor], LinearFn]


def projection(
    weight: torch.Tensor | QuantizedLinearWeight,
    bias: torch.Tensor | None,
    backend: Backend,
    fp8_activation_scheme: str = "none",
    name: str = "",
) -> Projection:
    """(weight, bias, its function): a quantized weight runs ``quantized_linear`` (weight-only: dequantized in the
    GEMM, chunk by chunk), or, a float8 one under ``fp8_activation_scheme = "dynamic"``, ``fp8.w8a8_linear``
    (its activations rounded to float8 per row); another runs ``backend(weight)`` when ``backend`` is a function,
    else ``select_linear``'s.

    Args:
        name: the linear's name, for a refusal (``fp8.check_w8a8``).

    Raises:
        ValueError: from ``select_linear``; a float8 weight W8A8 cannot run (``fp8.check_w8a8``).
    """
    if isinstance(weight, QuantizedWeight) and fp8_activation_scheme == "dynamic":
        check_w8a8(weight, name)
        return weight, bias, w8a8_linear
    if isinstance(weight, QuantizedLinearWeight):
        return weight, bias, quantized_linear
    return weight, bias, backend(weight) if callable(backend) else select_linear(weight, backend)


def apply_linear(x: torch.Tensor, layer: Projection) -> torch.Tensor:
    """(T, in_features) -> (T, out_features): the projection's function on its weight and bias."""
    weight, bias, run = layer
    return run(x, weight, bias)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN's matmul primitive.

    Args:
        x: (T, in_features) float32 on the CPU.
        weight: (out_features, in_features) float32 on the CPU, strided or packed (``pack_for_onednn``).
        bias: (out_features,) float32, or None.

    Returns:
        (T, out_features) float32.
    """
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in oneDNN's blocked layout for its matmul (``torch.ops.mkldnn._reorder_linear_weight``, as
    inductor's CPU freezing pass packs a linear's weight), which ``onednn_linear`` takes as is.

    Args:
        weight: (out_features, in_features) float32 on the CPU (``onednn_unavailable_reason`` None).

    Returns:
        an opaque ``torch._mkldnn`` tensor of the same shape and values (a copy: the caller drops the original).
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_PACKED_ROWS)


def packs_for_onednn(weight: torch.Tensor, backend: str) -> bool:
    """Whether the loader packs ``weight`` for oneDNN (``pack_for_onednn``) under ``backend``: "onednn", or "auto"
    for a weight of at least ``ONEDNN_PACKED_MIN_WEIGHT_ELEMENTS`` elements; either where ``onednn_unavailable_reason``
    gives none (a packed weight then runs ``onednn_linear``: ``select_linear``).

    Raises:
        ValueError: as ``select_linear``: an unknown backend, or "onednn" where oneDNN cannot run the weight.
    """
    if backend != "auto":
        runs_onednn = select_linear(weight, backend) is onednn_linear
    else:
        runs_onednn = onednn_unavailable_reason(weight) is None and weight.numel() >= ONEDNN_PACKED_MIN_WEIGHT_ELEMENTS
    return runs_onednn and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")  # a build without it: unpacked


def onednn_unavailable_reason(weight: torch.Tensor) -> str | None:
    """Why ``onednn_linear`` cannot run ``weight``, or None when it can."""
    if weight.device.type != "cpu":
        return f"the weight is on {weight.device.type}, not the CPU"
    if weight.dtype != torch.float32:
        return f"the weight is {weight.dtype}, not float32"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN linear op"
    return None


def select_linear(weight: torch.Tensor, backend: str, batch_invariant: bool = False) -> LinearFn:
    """The function that runs ``weight``'s linear layer.

    Args:
        weight: (out_features, in_features); a weight ``pack_for_onednn`` packed runs ``onednn_linear``.
        backend: one of ``LINEAR_BACKENDS``: "torch" is ``F.linear``; "onednn" is ``onednn_linear``; "auto" is
            ``onednn_linear`` for a float32 CPU weight of at least ``ONEDNN_MIN_WEIGHT_ELEMENTS`` elements where
            oneDNN is available, else ``F.linear``.
        batch_invariant: ``batch_invariant_linear(weight)`` instead, whatever ``backend`` is "auto" (the engine
            refuses "torch" and "onednn" with it).

    Raises:
        ValueError: for an unknown backend, or "onednn" where ``onednn_unavailable_reason`` gives a reason; a packed
            weight under "torch" or ``batch_invariant``.
    """
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    if weight.is_mkldnn:  # packed at load (pack_for_onednn): only oneDNN runs it
        if batch_invariant or backend == "torch":
            raise ValueError(f"a weight packed for oneDNN cannot run linear_backend = {backend} or batch_invariant")
        return onednn_linear
    if batch_invariant:
        return batch_invariant_linear(weight)
    if backend == "torch":
        return F.linear
    reason = onednn_unavailable_reason(weight)
    if backend == "onednn":
        if reason:
            raise ValueError(f"linear_backend = onednn cannot run: {reason}; use linear_backend = auto or torch")
        return onednn_linear
    return onednn_linear if reason is None and weight.numel() >= ONEDNN_MIN_WEIGHT_ELEMENTS else F.linear


#: Rows per GEMM call of the fixed-tile invariant linear (``batch_invariant_linear``'s fallback).
INVARIANT_TILE_ROWS = 64
#: Row counts the load-time check compares with one call of ``_PROBE_ROWS`` rows (starting at several offsets).
_PROBE_COUNTS = (2, 3, 16, 17, 65)
_PROBE_ROWS = 130
#: The check runs at most this many output features of a wider weight (an LM head's vocabulary), so that it costs
#: about as much as one prefill step.
_PROBE_MAX_FEATURES = 8192


def batch_invariant_linear(weight: torch.Tensor) -> LinearFn:
    """A linear function whose every output row is the same bits whatever the number of rows in the call and the
    row's place among them (``engine.batch_invariant``; the measurements are in the module docstring).

    Args:
        weight: (out_features, in_features).

    Returns:
        ``onednn_linear`` with one row padded to two, for a float32 CPU weight where oneDNN is available and
        ``_onednn_rows_independent`` holds for its shape at this thread count; else ``fixed_tile_linear``.
    """
    if onednn_unavailable_reason(weight) is None:
        shape = (min(weight.shape[0], _PROBE_MAX_FEATURES), weight.shape[1])
        if _onednn_rows_independent(shape, torch.get_num_threads()):
            return onednn_two_rows_or_more
        logger.warning(
            "oneDNN's linear gives a row other bits with other row counts for a %s weight: batch-invariant linear "
            "layers of that shape run fixed %d-row tiles instead (slower)",
            tuple(weight.shape),
            INVARIANT_TILE_ROWS,
        )
    return fixed_tile_linear


def fixed_tile_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` called on tiles of exactly ``INVARIANT_TILE_ROWS`` rows (the last one zero-padded), so the GEMM
    always sees one shape and a row's result does not depend on how many rows came with it.

    Args:
        x: (T, in_features); weight: (out_features, in_features); bias: (out_features,) or None.

    Returns:
        (T, out_features) in ``x.dtype``.
    """
    tile = INVARIANT_TILE_ROWS
    num_rows = x.shape[0]
    padded = -(-num_rows // tile) * tile
    if padded != num_rows:
        x = torch.cat([x, x.new_zeros(padded - num_rows, x.shape[1])])
    out = torch.cat([F.linear(x[start : start + tile], weight, bias) for start in range(0, padded, tile)])
    return out[:num_rows]


def onednn_two_rows_or_more(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``onednn_linear``, a single row run as two (a zero row added): one row alone takes oneDNN's GEMV, which sums
    in another order than its GEMM for two or more rows."""
    if x.shape[0] == 1:
        return onednn_linear(torch.cat([x, x.new_zeros(1, x.shape[1])]), weight, bias)[:1]
    return onednn_linear(x, weight, bias)


@functools.lru_cache(maxsize=None)
def _onednn_rows_independent(shape: tuple[int, int], num_threads: int) -> bool:
    """Whether oneDNN computes rows of a ``shape`` weight with the same bits in calls of ``_PROBE_COUNTS`` rows at
    three offsets as in one call of ``_PROBE_ROWS`` rows, on random inputs, at ``num_threads`` torch threads (a
    check of the measured behaviour on this machine's oneDNN, not a proof for every row count; a wider weight is
    checked on its first ``_PROBE_MAX_FEATURES`` features). Cached per shape."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator)
    x = torch.randn(_PROBE_ROWS, shape[1], generator=generator)
    full = onednn_linear(x, weight, None)
    return all(
        torch.equal(onednn_two_rows_or_more(x[start : start + count], weight, None), full[start : start + count])
        for count in (1, *_PROBE_COUNTS)
        for start in (0, 5, _PROBE_ROWS - count)
    )
