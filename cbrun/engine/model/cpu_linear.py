"""Which GEMM runs each linear layer of the lean forward pass on the CPU: torch's (``F.linear``, MKL on x86) or
oneDNN's.

Measured on a 2-core AMD EPYC (AVX-512), float32 (``python -m benchmarks.cpu_linear``,
``benchmarks/results-cpu-linear.md``): for weights of at least 2^18 elements (1 MiB), oneDNN's matmul primitive
(the ``mkldnn::_linear_pointwise`` op that inductor's CPU backend calls) runs 8 to 256 rows 0.9-1.4x as fast as
torch's GEMM (MKL) at one thread (1.05x or more from 64 rows) and 1.03-2.4x at two; the 32000-wide LM head of a
40M Llama 1.2-1.4x at one thread and 1.3-2.4x at two. Below that size oneDNN's fixed cost per call (about 12-15 us)
makes it up to 5x slower. So under ``linear_backend = "auto"`` each weight gets the faster one by its size, once,
when the model is loaded. On workload 2 (``cbrun bench --workload random-llama-30m``) this gave 1.11x tokens/s at
one thread and 1.28x at two (``python -m benchmarks.linear_backend_ab``), with the same output tokens.

The two GEMMs sum in different orders: their outputs differ by float32 rounding (relative ~1e-6), like any two
BLAS libraries, so the lean path's logits equal transformers' bit for bit only where every weight runs on torch's
(``linear_backend = "torch"``, or a model whose weights are all under the threshold, e.g. stories260K).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from cbrun.engine.config import LINEAR_BACKENDS

#: Weights with at least this many elements run on oneDNN under "auto" (see the module docstring).
ONEDNN_MIN_WEIGHT_ELEMENTS = 1 << 18

LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN's matmul primitive.

    Args:
        x: (T, in_features) float32 on the CPU.
        weight: (out_features, in_features) float32 on the CPU.
        bias: (out_features,) float32, or None.

    Returns:
        (T, out_features) float32.
    """
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_unavailable_reason(weight: torch.Tensor) -> str | None:
    """Why ``onednn_linear`` cannot run ``weight``, or None when it can."""
    if weight.device.type != "cpu":
        return f"the weight is on {weight.device.type}, not the CPU"
    if weight.dtype != torch.float32:
        return f"the weight is {weight.dtype}, not float32"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN linear op"
    return None


def select_linear(weight: torch.Tensor, backend: str) -> LinearFn:
    """The function that runs ``weight``'s linear layer.

    Args:
        weight: (out_features, in_features).
        backend: one of ``LINEAR_BACKENDS``: "torch" is ``F.linear``; "onednn" is ``onednn_linear``; "auto" is
            ``onednn_linear`` for a float32 CPU weight of at least ``ONEDNN_MIN_WEIGHT_ELEMENTS`` elements where
            oneDNN is available, else ``F.linear``.

    Raises:
        ValueError: for an unknown backend, or "onednn" where ``onednn_unavailable_reason`` gives a reason.
    """
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return F.linear
    reason = onednn_unavailable_reason(weight)
    if backend == "onednn":
        if reason:
            raise ValueError(f"linear_backend = onednn cannot run: {reason}; use linear_backend = auto or torch")
        return onednn_linear
    return onednn_linear if reason is None and weight.numel() >= ONEDNN_MIN_WEIGHT_ELEMENTS else F.linear
