"""Attention kernels: the PyTorch reference and the Triton kernels with their checked wrappers.

NOTE: the Triton names are imported on first use (module ``__getattr__``), not here: importing a Triton kernel
module fixes whether its kernels run compiled or interpreted (``TRITON_INTERPRET`` is read when ``@triton.jit``
decorates), and CPU-only installs may lack Triton altogether.
"""

from __future__ import annotations

import importlib

from cbrun.kernels.reference import (
    GatherPlan,
    build_gather_plan,
    log_softmax_ref,
    matmul_ref,
    paged_attention_ref,
    rms_norm_ref,
    write_kv_cache_ref,
)

_TRITON_EXPORTS = {
    "paged_attention_triton": "cbrun.kernels.paged_attention",
    "write_kv_cache_triton": "cbrun.kernels.kv_cache_write",
    "batch_invariant_linear_triton": "cbrun.kernels.batch_invariant_matmul",
    "rms_norm_triton": "cbrun.kernels.rms_norm",
    "log_softmax_triton": "cbrun.kernels.log_softmax",
}

__all__ = [
    "GatherPlan",
    "build_gather_plan",
    "log_softmax_ref",
    "matmul_ref",
    "paged_attention_ref",
    "rms_norm_ref",
    "write_kv_cache_ref",
    *_TRITON_EXPORTS,
]


def __getattr__(name: str):
    if name in _TRITON_EXPORTS:
        return getattr(importlib.import_module(_TRITON_EXPORTS[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
