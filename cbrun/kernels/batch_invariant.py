"""Which batch-invariant kernels run a lean forward pass on a device, or why none can: the one place that decides.

A batch-invariant step (``engine.batch_invariant``) needs every reduction of a row to run in one order whatever
else is in the step: the GEMMs, the norms, attention and the log-softmax. On the CPU the engine has its own
(``cpu_linear.batch_invariant_linear`` and the C kernels). On a GPU these are the Triton kernels of this package:

==============  ==================================================  ==========================================
op              kernel                                              why torch's is not enough
==============  ==================================================  ==========================================
linear          ``batch_invariant_matmul`` (one tile per dtype)     cuBLAS picks tile and split-K by M
RMSNorm         ``rms_norm`` (one program per row)                  torch's mean may split a row over blocks
log-softmax     ``log_softmax`` (one program per row)               kept for logprob rows (vLLM does the same)
attention       ``paged_attention`` with ``batch_invariant=True``   the tile otherwise follows the longest query
==============  ==================================================  ==========================================

Elementwise ops (embedding, RoPE, SiLU-and-multiply, residual adds, casts) compute each element on its own and
stay torch's. ``triton_invariant_kernels`` returns the set; ``triton_invariant_unavailable_reason`` says why a
device cannot run it (the engine refuses ``batch_invariant = on`` by name there).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: Dtypes the invariant kernels take (activations and weights alike).
INVARIANT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The oldest part whose tiles ``cbrun.kernels.aot_fit`` checks (sm_80); older parts are refused.
MIN_CAPABILITY = 80


@dataclass(frozen=True)
class InvariantKernels:
    """The batch-invariant ops of one device.

    Attributes:
        name: what runs them, for the log ("triton", "triton-interpreter").
        linear: ``(x (T, K), weight (N, K), bias (N,) or None) -> (T, N)``, ``F.linear``'s contract.
        rms_norm: ``(x (..., D), weight (D,), eps) -> x.shape``, the Llama family's RMSNorm.
        log_softmax: ``(x (R, V)) -> (R, V) float32``.
    """

    name: str
    linear: Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    log_softmax: Callable[[torch.Tensor], torch.Tensor]


def triton_invariant_unavailable_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why the Triton batch-invariant kernels cannot run a ``dtype`` model on ``device``, or None when they can.

    They run on CUDA parts of compute capability 8.0 or newer (the parts whose tiles are checked ahead of time),
    and on the CPU only under Triton's interpreter (``TRITON_INTERPRET=1`` before Triton's first import: tests;
    far too slow for a job).
    """
    device = torch.device(device)
    if dtype not in INVARIANT_DTYPES:
        return f"dtype {dtype} (the invariant kernels take float16, bfloat16 and float32)"
    try:
        importlib.import_module("triton")
    except ImportError:
        return "Triton is not installed (the invariant GPU kernels are Triton kernels)"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        major, minor = torch.cuda.get_device_capability(device)
        if major * 10 + minor < MIN_CAPABILITY:
            return f"compute capability {major}.{minor} (the invariant tiles are checked for 8.0, 8.9 and 9.0)"
        return None
    if device.type == "cpu":
        if not _interpreted():
            return (
                "on the CPU the Triton kernels run only under TRITON_INTERPRET=1 (the CPU's own invariant kernels "
                "run otherwise)"
            )
        return None
    return f"the device is {device.type} (the Triton invariant kernels run on CUDA)"


def triton_invariant_kernels(device: torch.device | str, dtype: torch.dtype) -> InvariantKernels:
    """The Triton batch-invariant kernels for a ``dtype`` model on ``device``.

    Raises:
        ValueError: where ``triton_invariant_unavailable_reason`` gives a reason.
    """
    reason = triton_invariant_unavailable_reason(device, dtype)
    if reason:
        raise ValueError(f"the batch-invariant Triton kernels cannot run: {reason}")
    from cbrun.kernels.batch_invariant_matmul import batch_invariant_linear_triton
    from cbrun.kernels.log_softmax import log_softmax_triton
    from cbrun.kernels.rms_norm import rms_norm_triton

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return batch_invariant_linear_triton(x, weight, bias)

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_triton(x, weight, eps)

    name = "triton" if torch.device(device).type == "cuda" else "triton-interpreter"
    return InvariantKernels(name, linear, rms_norm, log_softmax_triton)


def _interpreted() -> bool:
    """Whether this process's Triton kernels run in the interpreter: ``TRITON_INTERPRET`` is read when a kernel is
    decorated, so the kernels' own type decides (a module imported before the variable was set runs compiled)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    from triton.runtime.interpreter import InterpretedFunction

    from cbrun.kernels.batch_invariant_matmul import batch_invariant_matmul_kernel

    return isinstance(batch_invariant_matmul_kernel, InterpretedFunction)
