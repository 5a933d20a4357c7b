"""The CPU's draw of sampled rows: ``cbrun/kernels/cpu_sampler.c``, compiled at first use.

On a CPU a step's sampler is host time, and the PyTorch draw (``cbrun.engine.sample.sampler.draw_filtered``) is a
few dozen small tensor ops per step (softmax, cumulative sums, the top-p test's passes, each rejection round's),
each costing a few microseconds before any arithmetic. The C kernel does a row's whole draw in one call for every
sampled row of the step: the row's maximum and its NaN / infinity checks, the temperature, the weights
exp((x - max) / T), top-k, top-p and min-p by the sampler's rejection with pivots, the counter-based uniform
numbers of each round (``cbrun.engine.sample.sampler.uniform_of``) and the inverse-CDF pick. The distribution and
the random numbers are the PyTorch sampler's; the floats are its own (our exp2, float32 lanes and float64 sums in a fixed order per
row), so a draw whose number lands within about 1e-6 of a boundary may differ from the PyTorch path's
(``tests/kernels/test_cpu_sampler.py`` compares them: the same tokens on thousands of random rows). A row's token
depends only on its own scores and settings, never on its batch or the thread count.

Where the kernel cannot be built (``unavailable_reason``) the sampler keeps the PyTorch draw.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from cbrun.kernels.c_build import KernelLibrary

SOURCE = Path(__file__).with_name("cpu_sampler.c")


def unavailable_reason() -> str | None:
    """Why the C kernel cannot run here (building it on first call), or None when it can."""
    return _LIBRARY.unavailable_reason()


def supports(logits: torch.Tensor) -> bool:
    """Whether ``sample_rows`` takes these logits: float32, 2-D, on the CPU, unit stride along the vocabulary, and
    the kernel built."""
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.stride(1) == 1
        and _LIBRARY.load() is not None
    )


def sample_rows(
    logits: torch.Tensor,
    rows: np.ndarray | None,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    seed_hashes: np.ndarray,
    positions: np.ndarray,
    num_threads: int = 1,
) -> torch.Tensor:
    """One token per row drawn from its filtered softmax; the logits are not written.

    Args:
        logits: (N, V) float32 CPU scores, unit stride along V (processed: bitmask, penalties and stop tokens
            already applied; +inf scores share the row, NaN fails it).
        rows: (R,) int64, the rows of ``logits`` to draw from; None: every row (R = N).
        temperature: (R,) float32 (> 0); top_k: (R,) int64 (0 off); top_p: (R,) float32 (1 off); min_p: (R,)
            float32 (0 off).
        seed_hashes: (R,) uint64 or int64 bit patterns, each row's ``seed_hash`` (the first link of its stream);
            positions: (R,) int64 the output positions of the tokens drawn. Round r of a row's draw uses
            ``uniform(seed, position, PLAIN + r)`` (``uniform_of(row_keys(seed_hash, position), PLAIN + r)``).
        num_threads: OpenMP threads over the rows (the tokens do not depend on it).

    Returns:
        (R,) int64: each row's token in ``[0, V)``, or ``-1 - code`` for a row that fails (the sampler's
        ``encode_errors`` encoding: ``NAN_LOGITS`` for NaN scores, ``NOTHING_LEFT`` when every score is -inf,
        ``OUT_OF_VOCAB`` when its weights have no finite positive sum).

    Raises:
        RuntimeError: the kernel is unavailable (``unavailable_reason``) or its scratch memory could not be
            allocated.
        ValueError: logits ``supports`` refuses, arrays of the wrong dtype or length, or a row outside the logits.
    """
    library = _LIBRARY.loaded()
    num_rows = logits.shape[0] if rows is None else len(rows)
    seed_hashes = seed_hashes.view(np.int64) if seed_hashes.dtype == np.uint64 else seed_hashes
    _check(logits, rows, num_rows, temperature, top_k, top_p, min_p, seed_hashes, positions)
    out = np.empty(num_rows, dtype=np.int64)
    if num_rows:
        arrays = [a.ctypes.data for a in (temperature, top_k, top_p, min_p, seed_hashes, positions, out)]
        rows_at = None if rows is None else rows.ctypes.data
        function = library.cbrun_sample_rows_f32
        if function(
            logits.data_ptr(), logits.stride(0), logits.shape[1], rows_at, num_rows, *arrays, max(1, num_threads)
        ):
            raise RuntimeError("the CPU sampler kernel could not allocate its scratch memory")
    return torch.from_numpy(out)


def _check(logits, rows, num_rows, temperature, top_k, top_p, min_p, seed_hashes, positions) -> None:
    """``sample_rows``' ValueErrors: logits ``supports`` refuses, an array of the wrong dtype, length or layout, a
    row outside the logits."""
    if not supports(logits):
        raise ValueError(
            f"the CPU sampler kernel takes 2-D float32 CPU logits with unit inner stride; got {logits.dtype} "
            f"{tuple(logits.shape)} on {logits.device}"
        )
    arrays = (
        ("rows", rows if rows is not None else np.empty(num_rows, np.int64), np.int64),
        ("temperature", temperature, np.float32),
        ("top_k", top_k, np.int64),
        ("top_p", top_p, np.float32),
        ("min_p", min_p, np.float32),
        ("seed_hashes", seed_hashes, np.int64),
        ("positions", positions, np.int64),
    )
    for name, array, dtype in arrays:
        if array.dtype != dtype or array.shape != (num_rows,) or not array.flags.c_contiguous:
            raise ValueError(f"{name} must be a contiguous ({num_rows},) {np.dtype(dtype)} array")
    if rows is not None and num_rows and (rows.min() < 0 or rows.max() >= logits.shape[0]):
        raise ValueError(f"rows must lie in [0, {logits.shape[0]}); got {rows.min()}..{rows.max()}")


def _bind(library: ctypes.CDLL) -> None:
    fn = library.cbrun_sample_rows_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int


_LIBRARY = KernelLibrary(SOURCE, "the CPU sampler kernel", "about 1 s", _bind, "the PyTorch draw")
