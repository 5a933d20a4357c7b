"""Paged attention on the CPU without gathering pages: a small C/OpenMP kernel, compiled at first use.

``cbrun/kernels/cpu_paged_attention.c`` reads each request's K/V pages where they lie in the cache (a blocked online
softmax, one page at a time), where ``cbrun.kernels.reference.paged_attention_ref`` first copies every page it reads
into a padded tensor. The reference stays the fallback and the oracle (``tests/kernels/test_cpu_attention.py``).

At one thread it is 2.5x to 4x the reference on decode rows (the reference's page copy is the cost there) and 1x to
2x on prefill chunks (head_dim 8 to 128; ``python -m benchmarks.cpu_attention --kernel-only``).

The same library writes each step's K/V into the cache (``write_kv_cache_cpu``, a plain copy) and applies RoPE
(``rope_cpu``, the floats of the PyTorch ops).

The kernel is plain C with no torch headers; it builds with ``$CC`` (default ``gcc``), flags ``-O3 -march=native
-ffp-contract=off -fopenmp -fno-trapping-math`` (no fused multiply-adds, so the floats do not depend on the CPU;
the last lets the compiler vectorise the softmax's selects), into
``$CBRUN_KERNEL_CACHE`` (default ``~/.cache/cbrun/kernels``), once per source, compiler and CPU (about 20 to 35 s on a
2-core machine: its tile loops are specialised per head size). It is loaded with ``ctypes`` and called on tensors'
data pointers. Where it cannot be built (no compiler, a failed build, a read-only cache), ``unavailable_reason``
says why and the engine keeps the reference.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path
from typing import Callable

import torch

from cbrun.kernels.c_build import build_library

logger = logging.getLogger("cbrun.engine")

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")

_library: ctypes.CDLL | None = None
_failure: str | None = None


def unavailable_reason() -> str | None:
    """Why the C kernel cannot run here (building it on first call), or None when it can."""
    _load()
    return _failure


def paged_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    page_offset: int = 0,
    num_threads: int | None = None,
    batch_invariant: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a flattened varlen batch over a paged KV cache, read in place (float32, CPU).

    Same contract as ``cbrun.kernels.paged_attention.paged_attention_triton`` and the reference.

    Args:
        query: (T, num_heads, head_dim) float32.
        k_cache, v_cache: (num_pages, page_size, num_kv_heads, head_dim) float32, contiguous;
            num_heads % num_kv_heads == 0.
        block_tables: (B, max_blocks) int32/int64 page of each request's logical blocks, covering its context.
        cu_seqlens_q: (B + 1,) cumulative query lengths; seqlens_k: (B,) context lengths, this step's included.
        scale: multiplier of q.k; softcap: scores become ``softcap * tanh(scores / softcap)`` when set.
        sliding_window: attend only to the last ``sliding_window`` positions (self included); None for full.
        page_offset: added to every page of ``block_tables``.
        num_threads: OpenMP threads of the kernel; None uses torch's intra-op thread count.
        batch_invariant: each query row attended on its own, as a decode row at its position: its floats then do
            not depend on the other rows of the call or the thread count (see ``StepKernels``).
        sinks: (num_heads,) float32 attention-sink logits, one more logit per head in the softmax denominator
            with no value (gpt-oss), or None.

    Returns:
        (T, num_heads, head_dim) float32; rows past ``cu_seqlens_q[-1]`` are zero.

    Raises:
        RuntimeError: when the kernel is unavailable (see ``unavailable_reason``) or runs out of memory.
        ValueError: for a dtype, device or shape the kernel does not take.
    """
    return StepKernels(k_cache, v_cache, num_threads, batch_invariant=batch_invariant).attention(
        query, block_tables, cu_seqlens_q, seqlens_k, scale, softcap, sliding_window, page_offset, sinks=sinks
    )


def write_kv_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    slot_offset: int = 0,
) -> None:
    """Store this step's keys and values in the paged cache, in place, in C: one call, no per-call tensor ops.

    The same bits as ``cbrun.kernels.reference.write_kv_cache_ref`` (a copy), which costs a mask, a host sync and two
    ``index_copy_`` per layer; with ``slot_offset`` the caller passes one slot mapping for every layer of a group
    instead of one shifted copy per layer.

    Args:
        key, value: (T, num_kv_heads, head_dim) float32 CPU tensors.
        k_cache, v_cache: (num_pages, page_size, num_kv_heads, head_dim) float32, contiguous.
        slot_mapping: (T,) int64 flat slot of each token (page * page_size + offset); a negative slot (padding) is
            skipped.
        slot_offset: added to every non-negative slot (a layer's page shift times ``page_size``).

    Raises:
        RuntimeError: when the kernel is unavailable (see ``unavailable_reason``).
        ValueError: for a dtype, device or shape the kernel does not take, or a slot outside the cache (nothing is
            written then).
    """
    StepKernels(k_cache, v_cache).write_kv(key, value, slot_mapping, slot_offset)


def rope_cpu(
    x: torch.Tensor, cos_table: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """RoPE in place, in C: ``x * cos + roll(x, head_dim / 2) * sin_signed`` per row's position, the same floats as
    those three PyTorch ops (``cbrun.engine.model.layers.rotary_embedding.apply_rope``), in one call instead of four ops and their tensors.

    Args:
        x: (T, num_heads, head_dim) float32 CPU tensor, contiguous; head_dim even. Overwritten.
        cos_table, sin_signed: (num_positions, head_dim) float32, contiguous: ``cbrun.engine.model.layers.rotary_embedding.rope_tables``
            (transformers' rotate_half with the sign of the first half folded into the sin table).
        positions: (T,) int64 position of each row.

    Returns:
        ``x``, rotated.

    Raises:
        RuntimeError: when the kernel is unavailable (see ``unavailable_reason``).
        ValueError: for a dtype, device or shape the kernel does not take, or a position outside the tables
            (``x`` is left as it was).
    """
    return StepKernels.rope_only().rope(x, cos_table, sin_signed, positions)


def silu_mul_cpu(gate: torch.Tensor, up: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """``silu(gate) * up`` in C, in place in ``gate``, each row's floats independent of the number of rows.

    PyTorch's ``F.silu`` runs a vector ``exp`` over most of a tensor and a scalar one, with other roundings, over
    the last elements of the whole tensor and of each thread's share, so an element's bits depend on where it sits
    in the batch. Here every element takes the same arithmetic (Cephes' exp polynomial, as the attention's
    softmax), so the result is a function of the row alone: the batch-invariant MLP (``engine.batch_invariant``).
    It is not bit-equal to ``F.silu(gate) * up`` (a different exp).

    Args:
        gate, up: (T, features) float32 CPU tensors, contiguous, of one shape.
        num_threads: OpenMP threads (rows split whole); None uses torch's intra-op thread count.

    Returns:
        ``gate``, overwritten.

    Raises:
        RuntimeError: when the kernel is unavailable (see ``unavailable_reason``).
        ValueError: for a dtype, device or shape the kernel does not take.
    """
    return StepKernels(None, None, num_threads).silu_mul(gate, up)


class StepKernels:
    """The C kernels of one engine step, called by every layer: what depends on the step alone is checked and
    converted to C's types once, and each layer's call checks only its own tensors.

    Step-constant tensors (the cache, cu_seqlens_q and seqlens_k, block tables, slot mappings, RoPE's tables and
    positions) are taken by identity: the first call that passes one checks and converts it, later calls reuse
    that. Before, each of a layer's four calls (attention, K/V write, RoPE of q and of k) redid it: about 15 us of
    Python per layer, 15% of a one-request decode step of stories260K. ``paged_attention_cpu``,
    ``write_kv_cache_cpu`` and ``rope_cpu`` are the same calls on a one-call instance; their docstrings give the
    contracts (shapes, dtypes, errors).

    Args:
        k_cache, v_cache: (num_pages, page_size, num_kv_heads, head_dim) float32, contiguous, of one shape; None
            for an instance that only applies RoPE (``rope_only``).
        num_threads: OpenMP threads of the attention; None uses torch's intra-op thread count.
        library: the loaded kernel library; None: this checkout's (``load_library`` loads another version's).
        batch_invariant: attend every query row as a one-row tile over all KV heads, so that its floats do not
            depend on the other rows of the step, its prefill chunk or the thread count (``engine.batch_invariant``;
            see ``cbrun_paged_attention_f32`` in the C source).

    Raises:
        RuntimeError: when the kernel is unavailable (see ``unavailable_reason``).
        ValueError: for a cache the kernels do not take.
    """

    def __init__(
        self,
        k_cache: torch.Tensor | None,
        v_cache: torch.Tensor | None,
        num_threads: int | None = None,
        library: ctypes.CDLL | None = None,
        batch_invariant: bool = False,
    ) -> None:
        self._library = library or _loaded()
        self._batch_invariant = batch_invariant
        if k_cache is not None:
            _check_cache(k_cache, v_cache)
            self._k_cache, self._v_cache = k_cache, v_cache  # kept alive while C holds their pointers
            self._cache_shape = tuple(k_cache.shape)
            self._k_ptr, self._v_ptr = k_cache.data_ptr(), v_cache.data_ptr()
        self._num_threads = num_threads or torch.get_num_threads()
        self._ready: dict[int, tuple[torch.Tensor, object]] = {}  # id(tensor) -> (tensor, its checked C form)
        self._rope_tables: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (cos, sin, positions), checked

    @classmethod
    def rope_only(cls) -> "StepKernels":
        """An instance without a cache, for ``rope``."""
        return cls(None, None)

    def attention(
        self,
        query: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seqlens_k: torch.Tensor,
        scale: float,
        softcap: float | None = None,
        sliding_window: int | None = None,
        page_offset: int = 0,
        lane_loops: bool = True,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``paged_attention_cpu`` over this instance's cache: (T, num_heads, head_dim) float32.

        ``lane_loops = False`` makes tiles with head_dim % 8 == 0 take the kernel's generic loops instead of its
        8-lane ones, which must give the same floats (``tests/kernels/test_cpu_attention.py`` compares them).
        """
        _check_float32_cpu(query=query)
        _, page_size, num_kv_heads, head_dim = self._cache_shape
        if query.dim() != 3 or query.shape[2] != head_dim or query.shape[1] % num_kv_heads:
            raise ValueError(f"query {tuple(query.shape)} does not fit the cache {self._cache_shape}")
        num_tokens, num_heads, _ = query.shape
        query = query.contiguous()
        tables = self._converted(block_tables, _int32)
        cu, num_rows = self._converted(cu_seqlens_q, _cu_seqlens)
        seqlens = self._converted(seqlens_k, _int32)
        out = torch.empty_like(query)
        if num_rows < num_tokens:
            out[num_rows:] = 0
        sinks = self._checked_sinks(sinks, num_heads)
        # NOTE: a library built before attention sinks takes no sinks argument
        takes_sinks = hasattr(self._library, "cbrun_paged_attention_has_sinks")
        sink_args = (None if sinks is None else sinks.data_ptr(),) if takes_sinks else ()
        status = self._library.cbrun_paged_attention_f32(
            query.data_ptr(),
            self._k_ptr,
            self._v_ptr,
            tables.data_ptr(),
            tables.shape[1],
            page_offset,
            cu.data_ptr(),
            seqlens.data_ptr(),
            seqlens.shape[0],
            num_heads,
            num_kv_heads,
            head_dim,
            page_size,
            scale,
            softcap or 0.0,
            *sink_args,
            sliding_window or 0,
            out.data_ptr(),
            self._num_threads,
            int(lane_loops),
            int(self._batch_invariant),
        )
        if status:
            raise RuntimeError("the CPU attention kernel could not allocate its scratch memory")
        return out

    def _checked_sinks(self, sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
        """``sinks`` contiguous (the caller keeps it while the kernel reads its pointer), or None.

        Raises:
            ValueError: sinks that are not one float32 logit per query head, or given to a library built before
                attention sinks.
        """
        if sinks is None:
            return None
        _check_float32_cpu(sinks=sinks)
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must be ({num_heads},), one logit per query head, got {tuple(sinks.shape)}")
        if not hasattr(self._library, "cbrun_paged_attention_has_sinks"):
            raise ValueError("this CPU attention library predates attention sinks")
        return sinks.contiguous()

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, slot_offset: int = 0
    ) -> None:
        """``write_kv_cache_cpu`` into this instance's cache."""
        _check_float32_cpu(key=key, value=value)
        num_pages, page_size, num_kv_heads, head_dim = self._cache_shape
        if key.shape != value.shape or key.dim() != 3 or tuple(key.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} do not fit the cache {self._cache_shape}"
            )
        slots = self._converted(slot_mapping, _int64_vector)
        if slots.shape[0] != key.shape[0]:
            raise ValueError(
                f"slot_mapping must be int64 of shape ({key.shape[0]},), got {slot_mapping.dtype} "
                f"{tuple(slot_mapping.shape)}"
            )
        key, value = key.contiguous(), value.contiguous()
        status = self._library.cbrun_write_kv_f32(
            key.data_ptr(),
            value.data_ptr(),
            self._k_ptr,
            self._v_ptr,
            slots.data_ptr(),
            slots.shape[0],
            num_kv_heads * head_dim,
            slot_offset,
            num_pages * page_size,
        )
        if status:
            raise ValueError(
                f"a slot of slot_mapping (+ {slot_offset}) lies outside the cache's {num_pages * page_size} slots"
            )

    def rope(
        self, x: torch.Tensor, cos_table: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """``rope_cpu``: ``x`` rotated in place."""
        _check_float32_cpu(x=x)
        if not x.is_contiguous() or x.dim() != 3:
            raise ValueError(f"x must be a contiguous (T, num_heads, head_dim) tensor, got {tuple(x.shape)}")
        num_rows, num_heads, head_dim = x.shape
        tables = self._rope_tables
        if tables is None or tables[0] is not cos_table or tables[1] is not sin_signed:  # a new pair: check it
            tables = self._rope_tables = (cos_table, sin_signed, _rope_table_positions(cos_table, sin_signed))
        num_positions = tables[2]
        if cos_table.shape[1] != head_dim:
            raise ValueError(
                f"x {tuple(x.shape)} does not fit the RoPE tables {tuple(cos_table.shape)} "
                f"and {tuple(sin_signed.shape)} (an even head_dim)"
            )
        pos = self._converted(positions, _int64_vector)
        if pos.shape[0] != num_rows:
            raise ValueError(
                f"positions must be int64 of shape ({num_rows},), got {positions.dtype} {tuple(positions.shape)}"
            )
        status = self._library.cbrun_rope_f32(
            x.data_ptr(),
            cos_table.data_ptr(),
            sin_signed.data_ptr(),
            pos.data_ptr(),
            num_rows,
            num_heads,
            head_dim,
            num_positions,
        )
        if status:
            raise ValueError(f"a position lies outside the RoPE tables' {num_positions} positions")
        return x

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu_mul_cpu`` with this instance's threads: ``gate``, overwritten with ``silu(gate) * up``."""
        _check_float32_cpu(gate=gate, up=up)
        if gate.shape != up.shape or gate.dim() != 2 or not (gate.is_contiguous() and up.is_contiguous()):
            raise ValueError(
                f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must be contiguous (T, features) of one shape"
            )
        self._library.cbrun_silu_mul_f32(
            gate.data_ptr(), up.data_ptr(), gate.data_ptr(), gate.shape[0], gate.shape[1], self._num_threads
        )
        return gate

    def _converted(self, tensor: torch.Tensor, convert: Callable[[torch.Tensor], object]) -> object:
        """``convert(tensor)`` (checks it, gives its C form), once per tensor object for this instance."""
        entry = self._ready.get(id(tensor))
        if entry is None or entry[0] is not tensor:
            entry = (tensor, convert(tensor))  # the tensor is kept, so its id cannot be reused meanwhile
            self._ready[id(tensor)] = entry
        return entry[1]


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def _cu_seqlens(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    cu = _int32(t)
    return cu, int(cu[-1])


def _int64_vector(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int64 or t.dim() != 1:
        raise ValueError(f"slot_mapping and positions must be int64 vectors, got {t.dtype} {tuple(t.shape)}")
    return t.contiguous()


def _rope_table_positions(cos_table: torch.Tensor, sin_signed: torch.Tensor) -> int:
    """Checks RoPE's tables; returns their number of positions."""
    _check_float32_cpu(cos_table=cos_table, sin_signed=sin_signed)
    if not (cos_table.is_contiguous() and sin_signed.is_contiguous()):
        raise ValueError("x, cos_table and sin_signed must be contiguous")
    if cos_table.shape != sin_signed.shape or cos_table.dim() != 2 or cos_table.shape[1] % 2:
        raise ValueError(
            f"the RoPE tables {tuple(cos_table.shape)} and {tuple(sin_signed.shape)} must be one "
            "(num_positions, head_dim) shape with an even head_dim"
        )
    return cos_table.shape[0]


def load_library(source: Path) -> ctypes.CDLL:
    """Another version of the kernel's source, built (and cached) as this one is and loaded: the ``library`` of a
    ``StepKernels``, for A/B benchmarks (``benchmarks.cpu_attention --paired``).

    Raises:
        RuntimeError, OSError, subprocess.SubprocessError: when it cannot be built or loaded.
    """
    return _bind(ctypes.CDLL(str(_build(Path(source)))))


def load_source(source: Path) -> Callable[..., torch.Tensor]:
    """``paged_attention_cpu`` of another version of the kernel's source, built (and cached) as this one is.

    A one-call comparison with another checkout's kernel, as ``paged_attention_cpu`` takes its arguments; the
    paired benchmark (``benchmarks.cpu_attention --paired``) builds ``StepKernels`` on ``load_library`` instead.

    Raises:
        RuntimeError, OSError, subprocess.SubprocessError: when it cannot be built or loaded.
    """
    library = load_library(source)

    def attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        seqlens_k,
        scale,
        softcap=None,
        sliding_window=None,
        page_offset=0,
        num_threads=None,
    ):
        return StepKernels(k_cache, v_cache, num_threads, library).attention(
            query, block_tables, cu_seqlens_q, seqlens_k, scale, softcap, sliding_window, page_offset
        )

    return attention


def _check_float32_cpu(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.float32 or not t.is_cpu:
            raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _check_float32_cpu(k_cache=k_cache, v_cache=v_cache)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must be contiguous and of one shape")


def _loaded() -> ctypes.CDLL:
    """The library, built and loaded at first use; RuntimeError (why) when it is unavailable."""
    library = _load()
    if library is None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {_failure}")
    return library


def _load() -> ctypes.CDLL | None:
    global _library, _failure
    if _library is None and _failure is None:
        try:
            _library = _bind(ctypes.CDLL(str(_build())))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _failure = str(e)
            logger.info("CPU attention kernel unavailable, the PyTorch reference runs instead: %s", e)
    return _library


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    fn = library.cbrun_paged_attention_f32
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
    # NOTE: a library built from an older checkout (``load_library``) has no sinks argument after softcap.
    sinks = [ptr] if hasattr(library, "cbrun_paged_attention_has_sinks") else []
    fn.argtypes = [ptr, ptr, ptr, ptr, i64, i32, ptr, ptr, i32, i32, i32, i32, i32, f32, f32, *sinks, i32, ptr, i32]
    fn.argtypes += [i32, i32]
    fn.restype = ctypes.c_int
    if hasattr(library, "cbrun_silu_mul_f32"):  # another checkout's library (``load_library``) may predate it
        silu_mul = library.cbrun_silu_mul_f32
        silu_mul.argtypes = [ptr, ptr, ptr, i64, i64, i32]
        silu_mul.restype = None
    write = library.cbrun_write_kv_f32
    write.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64]
    write.restype = ctypes.c_int
    rope = library.cbrun_rope_f32
    rope.argtypes = [ptr, ptr, ptr, ptr, i64, i32, i32, i64]
    rope.restype = ctypes.c_int
    return library


def _build(source: Path = SOURCE) -> Path:
    """The compiled library's path (``cbrun.kernels.c_build.build_library``; RuntimeError when it cannot be built)."""
    # NOTE: the compile takes 15 to 35 s on 2 cores (the tile loops are specialised per head size): say so first
    return build_library(source, "the CPU attention kernel", "about 20 to 35 s")
