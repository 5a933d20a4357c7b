"""Structured outputs' token bitmask on the CPU: ``cbrun/kernels/cpu_token_mask.c``, compiled at first use.

Greedy rows under a grammar take the argmax of their logits among the tokens their bitmask allows. In PyTorch that
is a masked copy of the rows (xgrammar's ``apply_token_bitmask_inplace``, or an unpacked boolean mask) and then a
``max`` over them: two passes over (rows, vocab) floats and one write. The C kernel reads the packed words and the
allowed logits once and writes nothing: at 256 rows of 32000 it takes about 1/10 of those two passes
(``python -m benchmarks.structured_mask``). Sampled rows need the masked scores themselves:
``apply_token_bitmask_cpu`` writes -inf where xgrammar's ``apply_token_bitmask_inplace`` does, skipping the fully
allowed words. Where the kernel cannot be built (``unavailable_reason``) the callers keep the PyTorch and xgrammar
path, which is also the oracle of its tests (``tests/kernels/test_cpu_token_mask.py``).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from cbrun.kernels.c_build import KernelLibrary

SOURCE = Path(__file__).with_name("cpu_token_mask.c")
#: The kernel's per-row results that are not a token.
NOTHING_ALLOWED, NAN_ALLOWED = -1, -2


def unavailable_reason() -> str | None:
    """Why the C kernel cannot run here (building it on first call), or None when it can."""
    return _LIBRARY.unavailable_reason()


def supports(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """Whether ``masked_argmax_cpu`` takes these tensors: float32 CPU logits with unit stride along the vocabulary,
    an int32 CPU bitmask with unit stride along its words, and the kernel built."""
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.stride(1) == 1
        and bitmask.device.type == "cpu"
        and bitmask.dtype == torch.int32
        and bitmask.dim() == 2
        and bitmask.stride(1) == 1
        and _LIBRARY.load() is not None
    )


def masked_argmax_cpu(
    logits: torch.Tensor,
    rows: list[int],
    bitmask: torch.Tensor,
    mask_rows: list[int] | None = None,
    num_threads: int | None = None,
) -> list[int]:
    """Per row, the first index of its largest allowed logit; the logits are not written.

    Args:
        logits: (N, V) float32 CPU, unit stride along V.
        rows: the rows of ``logits`` to read.
        bitmask: (M, W) int32 CPU in xgrammar's layout (bit j of word i allows token ``32 i + j``); tokens at or
            past ``32 W`` are disallowed, bits past V are ignored.
        mask_rows: the bitmask row of each of ``rows`` (default: the same indices).
        num_threads: OpenMP threads; None uses torch's intra-op thread count (one below 16 rows).

    Returns:
        Per row its token, ``NOTHING_ALLOWED`` when no allowed logit is above -inf, or ``NAN_ALLOWED`` when an
        allowed logit is NaN.

    Raises:
        RuntimeError: when the kernel is unavailable (``unavailable_reason``).
        ValueError: for tensors ``supports`` refuses, or a row outside either tensor.
    """
    library, args, _indices = _call_args(logits, rows, bitmask, mask_rows, num_threads)
    if not rows:
        return []
    out = torch.empty(len(rows), dtype=torch.int64)
    library.cbrun_masked_argmax_f32(*args[:-1], out.data_ptr(), args[-1])
    return out.tolist()


def apply_token_bitmask_cpu(
    logits: torch.Tensor,
    rows: list[int],
    bitmask: torch.Tensor,
    mask_rows: list[int] | None = None,
    num_threads: int | None = None,
) -> None:
    """Set each row's disallowed tokens to -inf, in place: xgrammar's ``apply_token_bitmask_inplace`` on the CPU,
    skipping fully allowed words (for the rows that are sampled, where the masked scores themselves are needed).

    Args, raises: as ``masked_argmax_cpu``'s (``logits`` is written).
    """
    library, args, _indices = _call_args(logits, rows, bitmask, mask_rows, num_threads)
    if rows:
        library.cbrun_apply_token_bitmask_f32(*args)


def _call_args(logits, rows, bitmask, mask_rows, num_threads) -> tuple[ctypes.CDLL, tuple, tuple]:
    """The checked kernel arguments shared by both entry points (RuntimeError / ValueError as they say), and the
    index tensors behind two of its pointers, which the caller holds until the call returns."""
    library = _LIBRARY.loaded()
    if not supports(logits, bitmask):
        raise ValueError(
            f"the CPU token-mask kernel takes float32 CPU logits and an int32 CPU bitmask, both 2-D with unit "
            f"inner stride; got {logits.dtype} {tuple(logits.shape)} on {logits.device} and {bitmask.dtype} "
            f"{tuple(bitmask.shape)} on {bitmask.device}"
        )
    mask_rows = rows if mask_rows is None else mask_rows
    if len(mask_rows) != len(rows):
        raise ValueError(f"{len(rows)} rows but {len(mask_rows)} bitmask rows")
    _check_rows("rows", rows, logits.shape[0])
    _check_rows("mask_rows", mask_rows, bitmask.shape[0])
    if num_threads is None:
        num_threads = 1 if len(rows) < 16 else torch.get_num_threads()
    row_index = torch.tensor(rows, dtype=torch.int64)
    mask_index = row_index if mask_rows is rows else torch.tensor(mask_rows, dtype=torch.int64)
    args = (
        logits.data_ptr(),
        logits.stride(0),
        logits.shape[1],
        bitmask.data_ptr(),
        bitmask.stride(0),
        bitmask.shape[1],
        row_index.data_ptr(),
        mask_index.data_ptr(),
        len(rows),
        max(1, num_threads),
    )
    return library, args, (row_index, mask_index)


def _check_rows(name: str, rows: list[int], limit: int) -> None:
    if rows and (min(rows) < 0 or max(rows) >= limit):
        raise ValueError(f"{name} must lie in [0, {limit}); got {min(rows)}..{max(rows)}")


def _bind(library: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    argmax = library.cbrun_masked_argmax_f32
    argmax.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    argmax.restype = ctypes.c_int
    apply = library.cbrun_apply_token_bitmask_f32
    apply.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ctypes.c_int]
    apply.restype = ctypes.c_int


_LIBRARY = KernelLibrary(SOURCE, "the CPU token-mask kernel", "about 1 s", _bind, "the PyTorch path")
