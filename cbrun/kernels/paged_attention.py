"""Triton paged attention over a flattened varlen batch that mixes prefill chunks and decodes.

Same contract as ``cbrun.kernels.reference.paged_attention_ref`` (see that module for the cache layout and positions).
One kernel serves every mix: the batch is cut into query tiles, each tile belonging to one request, and each
program handles one (query tile, KV head) pair: the tile's BLOCK_Q query tokens times the GROUP query heads
that share the KV head, so every K/V tile it loads feeds all heads of the GQA group at once::

    rows of one program (BLOCK_M = BLOCK_Q * GROUP_PADDED), GROUP = 4 shown:

    row:    0    1    2    3    4    5    6    7  ...
    token:  t0   t0   t0   t0   t1   t1   t1   t1 ...   (t = q_tile * BLOCK_Q + row // GROUP_PADDED)
    head:   g0   g1   g2   g3   g0   g1   g2   g3 ...   (head = kv_head * GROUP + row % GROUP_PADDED)

    program loop over its request's context, BLOCK_N positions at a time (only the causal / window range):
      block_tables[req, pos // PAGE_SIZE] -> page -> K (HEAD_DIM, BLOCK_N), V (BLOCK_N, HEAD_DIM)
      S = Q K * scale (fp32) -> softcap -> mask -> online softmax -> acc += P V

Tiles are numbered without a host sync: request b's tiles start at ``cu_seqlens_q[b] // BLOCK_Q + b``, so the
grid ``num_tokens // BLOCK_Q + num_requests`` covers every tile of every request; a program finds its request
by binary search over ``cu_seqlens_q`` and exits at once when its tile lies past its request's query rows.
The launch shape thus depends on tensor shapes only (CUDA-graph friendly).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cbrun.kernels.tile_policy import DEFAULT_CAPABILITY, MAX_HEAD_DIM, LaunchConfig, pick_attention_tile

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)


@triton.jit
def _find_request(cu_seqlens_q_ptr, tile, num_requests, BLOCK_Q: tl.constexpr):
    """Largest b with ``cu_seqlens_q[b] // BLOCK_Q + b <= tile``: the request that owns query tile ``tile``."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_requests
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _locate_tile(cu_seqlens_q_ptr, tile, num_requests, BLOCK_Q: tl.constexpr):
    """Query tile ``tile``'s request ``req``, the request's first query row and query length, and the tile's
    index within the request (past the request's rows: the program has nothing to do)."""
    req = _find_request(cu_seqlens_q_ptr, tile, num_requests, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + req).to(tl.int32)
    q_len = tl.load(cu_seqlens_q_ptr + req + 1).to(tl.int32) - q_start
    return req, q_start, q_len, tile - (q_start // BLOCK_Q + req)


@triton.jit
def _softcap_log2(s, softcap):
    """``softcap * tanh(s / softcap)`` of the scores ``s``, in the log2 domain (times LOG2E)."""
    # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits +-1 when exp overflows.
    s = softcap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * LOG2E / softcap)) + 1.0))
    return s * LOG2E


@triton.jit
def _add_sinks(l_i, m_i, sinks_ptr, head, row_ok):
    """The softmax sums ``l_i`` (BLOCK_M,) with each row's head sink added: the sink is one more logit in the row's
    softmax, with no value, so exp(sink - m) joins the sum only (scores are in the log2 domain here, so the sink
    is too)."""
    sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * LOG2E
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    return l_i + tl.where(row_ok, tl.exp2(sink - m_safe), 0.0)


@triton.jit
def _query_rows(
    q_start, q_len, q_tile, kv_head, num_tokens,
    GROUP: tl.constexpr, GROUP_PADDED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
):  # fmt: skip
    """The program's BLOCK_M rows (the module docstring's diagram): each row's query token within its request
    ``q_idx``, query head, flat query row ``token`` (int64), and whether the row exists."""
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PADDED  # (BLOCK_M,) query token within the request
    head = kv_head * GROUP + rows % GROUP_PADDED  # (BLOCK_M,) query head
    token = (q_start + q_idx).to(tl.int64)  # (BLOCK_M,) flat query row
    row_ok = (q_idx < q_len) & (rows % GROUP_PADDED < GROUP) & (token < num_tokens)
    return q_idx, head, token, row_ok


@triton.jit
def _load_query(query_ptr, token, head, row_ok, dims, dim_ok, stride_q_t, stride_q_h, DOT_IN_FP32: tl.constexpr):
    """The rows' queries, (BLOCK_M, HEAD_DIM_PADDED), masked entries 0 (float32 under DOT_IN_FP32)."""
    q = tl.load(
        query_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    return q


@triton.jit
def _context_range(context_len, q_tile, seq_len, sliding_window, BLOCK_Q: tl.constexpr, USE_WINDOW: tl.constexpr):
    """``[kv_begin, kv_end)``: the context positions any row of the tile may see, from the window start of its first
    token to the causal end of its last."""
    tile_first_pos = context_len + q_tile * BLOCK_Q
    kv_end = tl.minimum(tile_first_pos + BLOCK_Q, seq_len)
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(tile_first_pos - sliding_window + 1, 0)
    return kv_begin, kv_end


@triton.jit
def _kv_tile(
    k_cache_ptr, v_cache_ptr, block_table_row, n_start, kv_begin, kv_end, max_blocks, kv_head, dims, dim_ok,
    stride_cache_block, stride_cache_offset, stride_cache_head,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):  # fmt: skip
    """The BLOCK_N context positions from ``n_start``, read through the block table where they lie in the cache:
    positions (BLOCK_N,), which are in range, K (HEAD_DIM_PADDED, BLOCK_N) and V (BLOCK_N, HEAD_DIM_PADDED)."""
    kv_pos = n_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    kv_ok = (kv_pos >= kv_begin) & (kv_pos < kv_end) & (kv_pos // PAGE_SIZE < max_blocks)
    page = tl.load(block_table_row + kv_pos // PAGE_SIZE, mask=kv_ok, other=0).to(tl.int64)
    kv_offsets = (
        page * stride_cache_block + (kv_pos % PAGE_SIZE) * stride_cache_offset + kv_head * stride_cache_head
    )  # (BLOCK_N,)
    k = tl.load(
        k_cache_ptr + kv_offsets[None, :] + dims[:, None], mask=kv_ok[None, :] & dim_ok[:, None], other=0.0
    )  # (HEAD_DIM_PADDED, BLOCK_N)
    v = tl.load(
        v_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_ok[:, None] & dim_ok[None, :], other=0.0
    )  # (BLOCK_N, HEAD_DIM_PADDED)
    if DOT_IN_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return kv_pos, kv_ok, k, v


@triton.jit
def _scores(
    q, k, qk_scale, softcap, kv_pos, kv_ok, q_pos, sliding_window,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The (BLOCK_M, BLOCK_N) fp32 scores of the rows against the context tile, in the log2 domain, soft-capped,
    -inf where a position is not visible to a row (causal, window, out of range)."""
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N) fp32
    if USE_SOFTCAP:
        s = _softcap_log2(s, softcap)
    visible = kv_ok[None, :] & (kv_pos[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        visible = visible & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, v_cache_ptr, DOT_PRECISION: tl.constexpr):
    """One step of the online softmax: the running max ``m_i``, sum ``l_i`` (BLOCK_M,) and output ``acc`` (BLOCK_M,
    HEAD_DIM_PADDED) updated with the scores ``s`` and values ``v`` of one context tile."""
    # A row with nothing visible yet keeps m = -inf, so subtract 0 instead (no NaN).
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # P is rounded to the cache dtype before P @ V (the second cast is a no-op unless DOT_IN_FP32).
    p = p.to(v_cache_ptr.dtype.element_ty).to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_context(
    q, q_pos, k_cache_ptr, v_cache_ptr, block_table_row, kv_begin, kv_end, max_blocks, kv_head, dims, dim_ok,
    scale, softcap, sliding_window, stride_cache_block, stride_cache_offset, stride_cache_head,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):  # fmt: skip
    """The blocked online softmax of the rows (queries ``q``, positions ``q_pos``) over the context range
    ``[kv_begin, kv_end)``, BLOCK_N positions a step: the final max ``m_i`` and sum ``l_i`` (BLOCK_M,) and the
    unnormalised output ``acc`` (BLOCK_M, HEAD_DIM_PADDED), fp32."""
    # Scores live in the log2 domain (exp2 is cheaper than exp); softcap is applied before the conversion.
    qk_scale = scale
    if not USE_SOFTCAP:
        qk_scale = scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    for n_start in range((kv_begin // BLOCK_N) * BLOCK_N, kv_end, BLOCK_N):
        kv_pos, kv_ok, k, v = _kv_tile(k_cache_ptr, v_cache_ptr, block_table_row, n_start, kv_begin, kv_end,
                                       max_blocks, kv_head, dims, dim_ok, stride_cache_block, stride_cache_offset,
                                       stride_cache_head, PAGE_SIZE, BLOCK_N, DOT_IN_FP32)  # fmt: skip
        s = _scores(q, k, qk_scale, softcap, kv_pos, kv_ok, q_pos, sliding_window, USE_SOFTCAP, USE_WINDOW,
                    DOT_PRECISION)  # fmt: skip
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, v_cache_ptr, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def paged_attention_kernel(
    out_ptr,  # (T, H, HEAD_DIM), strides (stride_out_t, stride_out_h, 1)
    query_ptr,  # (T, H, HEAD_DIM), strides (stride_q_t, stride_q_h, 1)
    k_cache_ptr, v_cache_ptr,  # (num_blocks, PAGE_SIZE, Hkv, HEAD_DIM) each, strides (stride_cache_block, _offset, _head, 1)
    block_tables_ptr,  # (B, max_blocks) int32/int64, strides (stride_block_table, 1)
    cu_seqlens_q_ptr,  # (B + 1,) int32/int64 cumulative query lengths
    seqlens_k_ptr,  # (B,) int32/int64 context length of each request, this step's tokens included
    sinks_ptr,  # (H,) fp32 attention-sink logit per query head; read only if USE_SINKS
    scale, softcap,  # fp32 multiplier of q.k; fp32 soft-cap of the scores, used only if USE_SOFTCAP
    sliding_window,  # int window length (self included); used only if USE_WINDOW
    num_tokens, num_requests, max_blocks,  # T (rows past it are never read or written), B, block_tables.shape[1]
    stride_out_t, stride_out_h, stride_q_t, stride_q_h,
    stride_cache_block, stride_cache_offset, stride_cache_head, stride_block_table,
    GROUP: tl.constexpr, GROUP_PADDED: tl.constexpr,  # query heads per KV head (H // Hkv); next power of two >= GROUP
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,  # HEAD_DIM_PADDED: next power of two >= max(HEAD_DIM, 16)
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,  # rows per program (BLOCK_Q * GROUP_PADDED, >= 16); query tokens
    BLOCK_N: tl.constexpr,  # context positions per loop step, >= 16
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding), else None (the default)
    DOT_IN_FP32: tl.constexpr,  # upcast bf16 dot operands (exactly): the CPU interpreter multiplies raw bf16 bits
):  # fmt: skip
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    req, q_start, q_len, q_tile = _locate_tile(cu_seqlens_q_ptr, tile, num_requests, BLOCK_Q)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seqlens_k_ptr + req).to(tl.int32)
    context_len = seq_len - q_len  # tokens cached before this step
    q_idx, head, token, row_ok = _query_rows(q_start, q_len, q_tile, kv_head, num_tokens, GROUP, GROUP_PADDED,
                                             BLOCK_M, BLOCK_Q)  # fmt: skip
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_ok = dims < HEAD_DIM
    q = _load_query(query_ptr, token, head, row_ok, dims, dim_ok, stride_q_t, stride_q_h, DOT_IN_FP32)
    kv_begin, kv_end = _context_range(context_len, q_tile, seq_len, sliding_window, BLOCK_Q, USE_WINDOW)
    block_table_row = block_tables_ptr + req.to(tl.int64) * stride_block_table
    m_i, l_i, acc = _attend_context(q, context_len + q_idx, k_cache_ptr, v_cache_ptr, block_table_row, kv_begin,
                                    kv_end, max_blocks, kv_head, dims, dim_ok, scale, softcap, sliding_window,
                                    stride_cache_block, stride_cache_offset, stride_cache_head, PAGE_SIZE, BLOCK_M,
                                    BLOCK_N, HEAD_DIM_PADDED, USE_SOFTCAP, USE_WINDOW, DOT_PRECISION,
                                    DOT_IN_FP32)  # fmt: skip
    if USE_SINKS:
        l_i = _add_sinks(l_i, m_i, sinks_ptr, head, row_ok)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + token[:, None] * stride_out_t + head[:, None] * stride_out_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])  # fmt: skip


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seqlen_q: int | None = None,
    out: torch.Tensor | None = None,
    batch_invariant: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a flattened varlen batch (prefill chunks and decodes mixed) over a paged KV cache (Triton).

    Args:
        query: (T, num_heads, head_dim) fp16/bf16/fp32, last dim contiguous; request b owns rows
            ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]``. Rows past ``cu_seqlens_q[-1]`` (padding) are not written.
        k_cache, v_cache: (num_blocks, page_size, num_kv_heads, head_dim), query's dtype, identical strides, last
            dim contiguous; num_heads % num_kv_heads == 0 (GQA). head_dim may be any value up to 256 (padded and
            masked inside the kernel).
        block_tables: (B, max_blocks) int32/int64, block ids of each request's pages in position order.
        cu_seqlens_q: (B + 1,) int32/int64 cumulative query lengths, ``cu_seqlens_q[-1] <= T``.
        seqlens_k: (B,) int32/int64 context length of each request, this step's tokens included.
        scale: multiplier of q.k (usually head_dim ** -0.5).
        sliding_window: attend only to the last ``sliding_window`` positions (self included); None for full.
        softcap: if set, scores become ``softcap * tanh(scores / softcap)`` (Gemma 2).
        max_seqlen_q: longest query length in the batch; picks the tile shape only. None reads it from
            ``cu_seqlens_q`` (one device sync): pass it when known, e.g. under CUDA-graph capture.
        out: optional (T, num_heads, head_dim) output buffer in query's dtype (last dim contiguous).
        batch_invariant: launch one tile for every batch (``INVARIANT_MAX_SEQLEN_Q``'s, the prefill tile) instead
            of the tile ``max_seqlen_q`` picks, so that a row's program has the same shape whatever else is in the
            step (the kernel has no split-KV; its KV loop runs in BLOCK_N steps from position 0 for every row).

    Returns:
        (T, num_heads, head_dim) in ``query.dtype`` (``out`` when given). Softmax runs in float32.

    Raises:
        ValueError: naming the argument whose shape, dtype, stride, device or value is wrong, or an unsupported
            head_dim (> 256).
    """
    _check_args(query, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, sliding_window, softcap, out, sinks)
    out = torch.empty_like(query, memory_format=torch.contiguous_format) if out is None else out
    if query.shape[0] and seqlens_k.shape[0]:  # an empty batch launches nothing
        tile_seqlen_q = _tile_seqlen_q(cu_seqlens_q, max_seqlen_q, batch_invariant)
        tensors = (out, query, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k)
        _launch(tensors, sinks, float(scale), sliding_window, softcap, tile_seqlen_q)
    return out


def _launch(
    tensors: tuple[torch.Tensor, ...],
    sinks: torch.Tensor | None,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    tile_seqlen_q: int,
) -> None:
    """Launches ``paged_attention_kernel`` over ``paged_attention_triton``'s checked, non-empty arguments
    ``(out, query, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k)`` and ``sinks``, with the tile that
    ``attention_launch_config`` picks for ``tile_seqlen_q`` on their device."""
    out, query, k_cache, _, block_tables, _, seqlens_k = tensors
    (num_tokens, num_heads, head_dim), num_requests = query.shape, seqlens_k.shape[0]
    launch = attention_launch_config(
        query.dtype,
        num_heads,
        k_cache.shape[2],
        head_dim,
        k_cache.shape[1],
        tile_seqlen_q,
        sliding_window is not None,
        softcap is not None,
        device_capability(query.device),
        dot_in_fp32=query.is_cpu and query.dtype == torch.bfloat16,
        use_sinks=sinks is not None,
    )
    grid = (num_tokens // launch.constexprs["BLOCK_Q"] + num_requests, k_cache.shape[2])
    pointers = (*tensors, seqlens_k if sinks is None else sinks)  # any sinks pointer without sinks: never read
    scalars = (scale, float(softcap or 0.0), int(sliding_window or 0), num_tokens, num_requests, block_tables.shape[1])
    strides = (*out.stride()[:2], *query.stride()[:2], *k_cache.stride()[:3], block_tables.stride(0))
    launch.launch(paged_attention_kernel, grid, *pointers, *scalars, *strides)


def _check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    """Sinks, when given, are one contiguous float32 logit per query head, on the query's device."""
    if sinks is not None and (sinks.shape != (query.shape[1],) or sinks.dtype != torch.float32 or sinks.stride(0) != 1):
        raise ValueError(
            f"sinks must be a contiguous float32 ({query.shape[1]},) tensor, got {sinks.dtype} {tuple(sinks.shape)}"
        )
    if sinks is not None and sinks.device != query.device:
        raise ValueError(f"sinks are on {sinks.device}, the query on {query.device}")


def _tile_seqlen_q(cu_seqlens_q: torch.Tensor, max_seqlen_q: int | None, batch_invariant: bool) -> int:
    """The query length whose tile the launch takes: ``INVARIANT_MAX_SEQLEN_Q`` for a batch-invariant launch, else
    the batch's longest query (read from ``cu_seqlens_q`` when not given: one device sync)."""
    if batch_invariant:
        return INVARIANT_MAX_SEQLEN_Q
    if max_seqlen_q is None:
        return int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    return int(max_seqlen_q)


#: The query length whose tile every ``batch_invariant`` launch uses: the largest tile the policy picks (a long
#: prefill's), one of the launches ``cbrun.kernels.aot_fit`` compiles for sm_80/89/90 (its ``MAX_SEQLEN_Q``).
INVARIANT_MAX_SEQLEN_Q = 8192


@functools.lru_cache(maxsize=1024)
def attention_launch_config(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    max_seqlen_q: int,
    use_window: bool,
    use_softcap: bool,
    capability: int | None,
    dot_in_fp32: bool = False,
    use_sinks: bool = False,
) -> LaunchConfig:
    """The constexprs, ``num_warps`` and ``num_stages`` of one ``paged_attention_kernel`` launch.

    ``paged_attention_triton`` launches with exactly this; ``cbrun.kernels.aot_fit`` compiles it ahead of time for each
    GPU architecture. The tile comes from ``cbrun.kernels.tile_policy.pick_attention_tile``. Cached: every layer of a
    step asks the same question, so the answer is computed once (callers must not change the returned dict).

    Args:
        dtype: query and cache dtype. num_heads, num_kv_heads, head_dim, page_size: the model's and cache's shape.
        max_seqlen_q: longest query (tokens) in the batch. use_window, use_softcap: whether those are set.
        capability: compute capability, major * 10 + minor (``device_capability``); None for the portable tile.
        dot_in_fp32: upcast bf16 dot operands (the CPU interpreter only): the tile is sized as a float32 one.
        use_sinks: the launch adds attention sinks (gpt-oss).
    """
    group = num_heads // num_kv_heads
    group_padded = triton.next_power_of_2(group)
    head_dim_padded = max(triton.next_power_of_2(head_dim), 16)
    elem_bytes = 4 if dot_in_fp32 else dtype.itemsize  # upcast operands take float32's registers
    upcast = dot_in_fp32 and dtype.itemsize < 4
    tile = pick_attention_tile(capability, elem_bytes, head_dim_padded, group_padded, max(max_seqlen_q, 1), upcast)
    constexprs = dict(
        GROUP=group,
        GROUP_PADDED=group_padded,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        PAGE_SIZE=page_size,
        BLOCK_M=tile.block_m,
        BLOCK_Q=tile.block_q(group_padded),
        BLOCK_N=tile.block_n,
        USE_SOFTCAP=use_softcap,
        USE_WINDOW=use_window,
        USE_SINKS=use_sinks,
        DOT_PRECISION="ieee" if dtype == torch.float32 else None,
        DOT_IN_FP32=dot_in_fp32,
    )
    return LaunchConfig(constexprs, tile.num_warps, tile.num_stages)


@functools.lru_cache(maxsize=None)
def device_capability(device: torch.device) -> int | None:
    """Compute capability of ``device`` as major * 10 + minor; ``DEFAULT_CAPABILITY`` (None: the portable tile,
    which fits every part) off CUDA, so a launch made on the CPU fits whichever part it is compiled for."""
    if device.type != "cuda":
        return DEFAULT_CAPABILITY
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _check_args(
    query, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, sliding_window, softcap, out, sinks
) -> None:
    """``paged_attention_triton``'s arguments (see its docstring); ValueError naming the first that is wrong."""
    if query.dim() != 3:
        raise ValueError(f"query must be (T, num_heads, head_dim), got shape {tuple(query.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be (num_blocks, page_size, num_kv_heads, head_dim), got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} differs from query head_dim {head_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim {head_dim} is not supported: the Triton kernel handles 1..{MAX_HEAD_DIM}; "
            f"use the PyTorch reference (attention_backend='torch') for this model"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"query dtype must be one of {_FLOAT_DTYPES}, got {query.dtype}")
    for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache)) + ((("out", out),) if out is not None else ()):
        if tensor.dtype != query.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} differs from query dtype {query.dtype}")
    if out is not None and out.shape != query.shape:
        raise ValueError(f"out must have query's shape {tuple(query.shape)}, got {tuple(out.shape)}")
    for name, tensor in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if tensor is not None and tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (head_dim), got strides {tensor.stride()}")
    if v_cache.stride() != k_cache.stride():
        raise ValueError(
            f"k_cache and v_cache must have identical strides, got {k_cache.stride()} and {v_cache.stride()}"
        )
    _check_index_args(block_tables, cu_seqlens_q, seqlens_k)
    tensors = (query, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k) + ((out,) if out is not None else ())
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must share one device, got {devices}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap!r}")
    _check_sinks(sinks, query)


def _check_index_args(block_tables, cu_seqlens_q, seqlens_k) -> None:
    for name, tensor in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q), ("seqlens_k", seqlens_k)):
        if tensor.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} dtype must be int32 or int64, got {tensor.dtype}")
    if seqlens_k.dim() != 1 or cu_seqlens_q.dim() != 1:
        raise ValueError(
            f"seqlens_k and cu_seqlens_q must be 1-D, got shapes {tuple(seqlens_k.shape)} and "
            f"{tuple(cu_seqlens_q.shape)}"
        )
    num_requests = seqlens_k.shape[0]
    if cu_seqlens_q.shape[0] != num_requests + 1:
        raise ValueError(
            f"cu_seqlens_q must have B + 1 = {num_requests + 1} entries (B from seqlens_k), got {cu_seqlens_q.shape[0]}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_requests:
        raise ValueError(f"block_tables must be (B={num_requests}, max_blocks), got {tuple(block_tables.shape)}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables rows must be contiguous, got strides {block_tables.stride()}")
    for name, tensor in (("cu_seqlens_q", cu_seqlens_q), ("seqlens_k", seqlens_k)):
        if tensor.shape[0] > 1 and tensor.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {tensor.stride()}")
