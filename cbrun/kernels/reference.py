"""Plain PyTorch paged attention and KV-cache write: the CPU path and the oracle of the Triton kernels.

Cache layout, shared by every implementation (per layer)::

    k_cache, v_cache: (num_blocks, page_size, num_kv_heads, head_dim)
    slot = block_id * page_size + offset_in_block      (flat index into the first two dims)

A flattened batch holds B requests back to back: request b owns query rows
``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` and has ``seqlens_k[b]`` tokens of context in the cache, this step's
tokens included. Its query row j sits at position ``seqlens_k[b] - q_len_b + j`` and attends causally to cache
positions ``<= `` its own (and ``> position - sliding_window`` when a window is set).

The reference avoids a block-diagonal mask over the whole batch: requests are split into decode groups (one query
row each, bucketed by context length) and prefill groups, and each group is padded only to its own longest query
and context. A prefill's query rows are cut into tiles of ``PREFILL_TILE`` rows, each a group row that attends only
up to its own last position, so the causal upper triangle of a long prefill is mostly not computed (the idea of
FlashAttention's causal block skipping, Dao et al. 2022, at the granularity of padded batches); tiles are bucketed
by context length like decodes. K and V are gathered whole blocks at a time (one row of
``page_size * num_kv_heads * head_dim`` values per block), which is far cheaper on the CPU than gathering single
slots. Attention runs through ``torch.nn.functional.scaled_dot_product_attention`` with an additive mask built
once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Decodes per padded group: fewer wastes less padding on mixed context lengths, more launches fewer ops.
DECODE_BUCKET_SIZE = 32
#: Query rows per prefill tile: smaller tiles skip more of the causal upper triangle but make more, smaller calls
#: (32 measured fastest on stories260K scoring prompts of 60-480 tokens, one thread).
PREFILL_TILE = 32
#: Prefill tiles per padded group (sorted by context length, as decodes).
PREFILL_BUCKET_SIZE = 16


@dataclass
class _Group:
    """One padded group of requests. B requests, Q padded query rows, K padded context positions."""

    q_index: torch.Tensor  # (B, Q) int64 flat query row, 0 where padded
    blocks: torch.Tensor  # (B, NB) int64 block ids covering the longest context, 0 where padded
    mask: torch.Tensor  # (B, 1, Q, K) bool, True = attend; K = NB * page_size
    out_rows: torch.Tensor  # (n,) int64 flat query rows this group writes
    out_select: torch.Tensor  # (n,) int64 positions of those rows in the (B * Q) padded layout
    _head_masks: dict = field(default_factory=dict)

    def head_mask(self, group_size: int, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """(B, 1, G * Q, K) mask for query rows laid out as (query head in its KV group, query position).

        Boolean (True = attend) for ``torch.bool``, else additive (0 or -inf) in ``dtype``: what
        ``scaled_dot_product_attention`` makes of a boolean mask on every call, made once for all layers.
        """
        key = (group_size, dtype)
        mask = self._head_masks.get(key)
        if mask is None:
            if dtype == torch.bool:
                mask = self.mask.repeat(1, 1, group_size, 1) if group_size > 1 else self.mask
            else:
                bool_mask = self.head_mask(group_size)
                mask = torch.zeros(bool_mask.shape, dtype=dtype, device=bool_mask.device)
                mask.masked_fill_(~bool_mask, float("-inf"))
            self._head_masks[key] = mask
        return mask


@dataclass
class GatherPlan:
    """Index tensors for ``paged_attention_ref``, built once per step and reused by every layer.

    Build it with ``build_gather_plan``; it depends on the batch layout and the sliding window only.
    """

    groups: list[_Group]
    num_tokens: int


def build_gather_plan(
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    page_size: int,
    sliding_window: int | None = None,
) -> GatherPlan:
    """Precompute the gather indices and masks of one batch.

    Args:
        block_tables: (B, max_blocks) int32/int64, block ids of each request's pages in position order.
        cu_seqlens_q: (B + 1,) int32/int64 cumulative query lengths.
        seqlens_k: (B,) int32/int64 context length of each request, this step's tokens included.
        page_size: tokens per block.
        sliding_window: attend only to the last ``sliding_window`` positions (self included); None for full.

    Returns:
        A ``GatherPlan``; all its tensors live on ``block_tables.device``. Rows past ``cu_seqlens_q[-1]`` and
        requests with no query rows (padding) are left out: their outputs stay zero.
    """
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    is_decode = q_lens == 1
    groups = []
    # Decodes are bucketed by context length so short contexts are not padded to the longest one; requests with
    # no query rows (padding for CUDA graphs) belong to no group.
    seqlens_k = seqlens_k.long()
    decodes = is_decode.nonzero().flatten()
    decodes = decodes[torch.argsort(seqlens_k[decodes], stable=True)]
    # NOTE: split() of an empty index gives one empty piece; requests with no query rows (padding) have no group.
    for idx in decodes.split(DECODE_BUCKET_SIZE) if decodes.numel() else ():
        groups.append(
            _build_group(block_tables[idx].long(), cu[:-1][idx], q_lens[idx], seqlens_k[idx], page_size, sliding_window)
        )
    owner, q_starts, tile_lens, tile_seqlens_k = _prefill_tiles(cu, q_lens, seqlens_k)
    for idx in torch.argsort(tile_seqlens_k, stable=True).split(PREFILL_BUCKET_SIZE) if owner.numel() else ():
        groups.append(
            _build_group(
                block_tables[owner[idx]].long(),
                q_starts[idx],
                tile_lens[idx],
                tile_seqlens_k[idx],
                page_size,
                sliding_window,
            )
        )
    return GatherPlan(groups=groups, num_tokens=int(cu[-1]))


def _prefill_tiles(
    cu: torch.Tensor, q_lens: torch.Tensor, seqlens_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut every request of more than one query row into tiles of at most ``PREFILL_TILE`` rows.

    Tile t of request b holds its query rows ``t * PREFILL_TILE`` onward and sees the context up to its own last
    row, so it is a request of its own: (owner b, first flat query row, rows, context length), each (n_tiles,).
    """
    prefills = (q_lens > 1).nonzero().flatten()
    lens = q_lens[prefills]
    num_tiles = (lens + PREFILL_TILE - 1) // PREFILL_TILE
    owner = prefills.repeat_interleave(num_tiles)
    first_tile = (torch.cumsum(num_tiles, 0) - num_tiles).repeat_interleave(num_tiles)
    start = (torch.arange(owner.numel(), device=cu.device) - first_tile) * PREFILL_TILE  # row offset in the request
    tile_lens = torch.clamp(q_lens[owner] - start, max=PREFILL_TILE)
    tile_seqlens_k = seqlens_k[owner] - q_lens[owner] + start + tile_lens
    return owner, cu[:-1][owner] + start, tile_lens, tile_seqlens_k


def _build_group(block_tables, q_starts, q_lens, seqlens_k, page_size, sliding_window) -> _Group:
    device = block_tables.device
    max_q, max_k = int(q_lens.max()), int(seqlens_k.max())
    q_offsets = torch.arange(max_q, device=device)
    q_valid = q_offsets[None, :] < q_lens[:, None]  # (B, Q)
    q_index = torch.where(q_valid, q_starts[:, None] + q_offsets[None, :], 0)
    q_pos = (seqlens_k - q_lens)[:, None] + q_offsets[None, :]  # (B, Q) absolute positions

    num_blocks = -(-max_k // page_size)
    blocks = block_tables[:, :num_blocks]
    if blocks.shape[1] < num_blocks:  # a table narrower than the context: only possible with padding rows
        blocks = torch.nn.functional.pad(blocks, (0, num_blocks - blocks.shape[1]))
    kv_pos = torch.arange(num_blocks * page_size, device=device)
    kv_valid = kv_pos[None, :] < seqlens_k[:, None]  # (B, K)

    mask = kv_valid[:, None, :] & (kv_pos[None, None, :] <= q_pos[:, :, None])
    if sliding_window is not None:
        mask &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    # Padded query rows attend to slot 0 so their softmax stays finite; their outputs are dropped.
    mask[..., 0] |= ~q_valid
    flat_valid = q_valid.flatten()
    return _Group(
        q_index=q_index,
        blocks=blocks,
        mask=mask[:, None],
        out_rows=q_index.flatten()[flat_valid],
        out_select=flat_valid.nonzero().flatten(),
    )


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: GatherPlan,
    scale: float,
    softcap: float | None = None,
    page_offset: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a flattened varlen batch over a paged KV cache.

    Args:
        query: (T, num_heads, head_dim), rows ordered as in the plan's ``cu_seqlens_q``.
        k_cache, v_cache: (num_blocks, page_size, num_kv_heads, head_dim); num_heads % num_kv_heads == 0 (GQA).
        plan: from ``build_gather_plan`` for this batch.
        scale: multiplier of q.k (usually head_dim ** -0.5).
        softcap: if set, scores become ``softcap * tanh(scores / softcap)`` (Gemma 2).
        page_offset: added to every block id of the plan (a layer's page within a multi-layer block).
        sinks: (num_heads,) float32 attention-sink logits, or None. A sink is one more logit per head in the
            softmax, with no value: ``p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink_h))`` (gpt-oss; transformers'
            ``gpt_oss.eager_attention_forward``, Xiao et al. 2023, "Efficient Streaming Language Models with
            Attention Sinks").

    A float8_e4m3fn cache (``engine.kv_cache_dtype = "fp8_e4m3"``) is dequantized as its pages are gathered
    (``dequantize_kv``), only the pages this step reads.

    NOTE: whole pages are gathered and unused positions masked, so unused slots must hold finite values (a NaN
    there would survive a zero attention weight). The engine zeroes each cache page before its first use and then only ever writes K/V there.

    Returns:
        (T, num_heads, head_dim) in ``query.dtype``.
    """
    out = query.new_zeros(query.shape)
    for g in plan.groups:
        out[g.out_rows] = _attend_group(query, k_cache, v_cache, g, scale, softcap, page_offset, sinks)
    return out


def _attend_group(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: _Group,
    scale: float,
    softcap: float | None,
    page_offset: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``paged_attention_ref`` for the requests of one gather group (padded to its longest query and context),
    as (rows of ``g.out_rows``, num_heads, head_dim) in ``query.dtype``."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    batch, max_q = g.q_index.shape
    # (B, Q, H, D) -> (B, Hkv, G * Q, D): each KV head serves its group of query heads as extra query rows,
    # so K and V are never repeated per query head.
    q = query[g.q_index].view(batch, max_q, num_kv_heads, group_size, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group_size * max_q, head_dim)
    pages = (g.blocks + page_offset if page_offset else g.blocks).flatten()
    # (B * NB, page, Hkv, D) -> (B, Hkv, K, D)
    k = _read_pages(k_cache, pages, query.dtype).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = _read_pages(v_cache, pages, query.dtype).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    if softcap is None and sinks is None:
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=g.head_mask(group_size, q.dtype), scale=scale
        )
    else:
        head_sinks = None if sinks is None else sinks.view(num_kv_heads, group_size, 1).repeat_interleave(max_q, 1)
        o = _explicit_attention(q, k, v, g.head_mask(group_size), scale, softcap, head_sinks)
    o = o.view(batch, num_kv_heads, group_size, max_q, head_dim).permute(0, 3, 1, 2, 4)
    return o.reshape(batch * max_q, num_heads, head_dim)[g.out_select]


def _explicit_attention(q, k, v, mask, scale: float, softcap: float | None, sinks) -> torch.Tensor:
    """Explicit attention, softmax in float32: scores soft-capped (``softcap * tanh(scores / softcap)``) when
    ``softcap`` is set, and a sink logit per row in the denominator when ``sinks`` ((Hkv, R, 1) float32) is set.
    q (B, Hkv, R, D), k/v (B, Hkv, K, D), mask (B, 1, R, K)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # softmax over [scores, sink], the sink's own column dropped (it has no value)
        sink_column = sinks.to(scores.device).expand(scores.shape[0], -1, -1, -1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's keys and values in the paged cache, in place.

    Args:
        key, value: (T, num_kv_heads, head_dim).
        k_cache, v_cache: (num_blocks, page_size, num_kv_heads, head_dim), in key/value's dtype, or
            float8_e4m3fn (an fp8 KV cache: each value is stored as ``quantize_kv`` rounds it).
        slot_mapping: (T,) int64 flat slot of each token; a negative slot (padding) is skipped.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    if k_cache.dtype == KV_FP8_DTYPE:  # torch has no float8 index_copy_: copy the bytes
        key, value = quantize_kv(key).view(torch.uint8), quantize_kv(value).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


#: The fp8 KV cache's storage type (vLLM's ``kv_cache_dtype = "fp8_e4m3"``).
KV_FP8_DTYPE = torch.float8_e4m3fn
#: Its per-tensor scale, the same for every layer's K and V: the real value is ``stored * KV_FP8_SCALE``. 1.0 is
#: vLLM's default ``k_scale`` / ``v_scale`` when the checkpoint carries none (cbrun refuses a checkpoint's
#: ``kv_cache_scheme`` scales by name, and calibrates none: a scale computed from a first batch would make a
#: row's tokens depend on which rows came first).
KV_FP8_SCALE = 1.0
_FP8_MAX = torch.finfo(KV_FP8_DTYPE).max


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """``x`` (any float dtype) as the fp8 KV cache stores it: ``x / KV_FP8_SCALE`` saturated to +-448, rounded to
    the nearest float8_e4m3fn (``Tensor.to``'s round-to-nearest-even)."""
    return (x.float() / KV_FP8_SCALE).clamp(-_FP8_MAX, _FP8_MAX).to(KV_FP8_DTYPE)


def dequantize_kv(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn cache values back to ``dtype``: ``float32(stored) * KV_FP8_SCALE``, rounded once."""
    return (stored.float() * KV_FP8_SCALE).to(dtype)


def _read_pages(cache: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(len(pages), page_size, Hkv, D) pages of ``cache`` in ``dtype`` (an fp8 cache dequantized)."""
    if cache.dtype != KV_FP8_DTYPE:
        return cache.index_select(0, pages)
    return dequantize_kv(cache.view(torch.uint8).index_select(0, pages).view(KV_FP8_DTYPE), dtype)


def matmul_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle of ``cbrun.kernels.batch_invariant_matmul``: ``x @ weight.T + bias`` summed in float64, rounded
    once to x's dtype (the kernel sums in float32, so the two agree to float32 rounding of the sum).

    Args:
        x: (M, K); weight: (N, K); bias: (N,) or None; all one dtype.

    Returns:
        (M, N) in ``x.dtype``.
    """
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The oracle of ``cbrun.kernels.rms_norm``: the Llama family's RMSNorm (normalise in float32, cast back, then
    scale by ``weight``) over the last dim of ``x`` (..., D); x's shape and dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def log_softmax_ref(x: torch.Tensor) -> torch.Tensor:
    """The oracle of ``cbrun.kernels.log_softmax``: ``log_softmax`` over the last dim in float32, (R, V) -> (R, V)."""
    return torch.log_softmax(x.float(), dim=-1)
