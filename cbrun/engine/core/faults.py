"""Which exceptions belong to one request, and which to the whole engine."""

from __future__ import annotations

import torch

#: Text of errors that a device reports asynchronously: they may surface while one request's row is read, but the
#: device is what failed.
_DEVICE_ERROR_MARKERS = ("CUDA error", "device-side assert", "CUBLAS_STATUS", "cuDNN error", "HIP error")


class SamplingError(ValueError):
    """A request's logits cannot be turned into a token (NaN in them, or every token ruled out)."""


def is_request_fault(error: BaseException) -> bool:
    """Whether an exception raised while handling one request's row during a step is that request's alone.

    Out-of-memory and device errors are not: they concern the whole engine (and CUDA reports them at a later sync,
    so the row they surface at is not their cause). They propagate, so the job stops cleanly with what it has
    committed; a request fault fails that request and the others continue.
    """
    if not isinstance(error, Exception) or isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return False
    text = str(error)
    return not any(marker in text for marker in _DEVICE_ERROR_MARKERS)


def request_error_message(stage: str, error: Exception) -> str:
    """The ``error`` of a request failed by a fault of its own: where and what, e.g. "sampling failed: ..."."""
    return f"{stage} failed: {type(error).__name__}: {error}"
