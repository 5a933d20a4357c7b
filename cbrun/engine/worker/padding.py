"""Which steps replay a CUDA graph, and the padded shape they replay: decode and uniform verify steps, padded to
a batch-size bucket (vLLM's ``cudagraph_capture_sizes``, SGLang's ``cuda_graph_max_bs``).

A graph replays only the exact shapes it was captured with. Steps that mix prefill chunks of any length vary in
every dimension, so they run eagerly; a decode step (one token per request) or a verify step where every request
checks the same number of proposals varies only in its request count, which is padded up to the next bucket. The
number of graphs is then at most the number of buckets times the query lengths allowed (1, and 2 to 1 + k with
speculative decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

from cbrun.engine.core.cache_spec import cdiv


def capture_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The batch-size buckets: 1, 2, 4, then every multiple of 8 up to ``max_batch_size``, which is always one
    (vLLM's default capture sizes, cut at the limit)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch_size] + list(range(8, max_batch_size, 8))
    return tuple(sizes) + (max_batch_size,)


@dataclass(frozen=True)
class PaddedShape:
    """The shape a graphed step is padded to, and the key of its graph.

    Attributes:
        num_tokens: query tokens, ``num_requests * query_len``.
        num_requests: the bucket: rows of block tables and sequence lengths.
        num_kv_blocks: the static block tables' width, the same for every graph (enough for ``max_model_len``);
            a step fills only the columns its longest context needs.
        num_logit_rows: rows of logits, one per token (a decode or verify step samples every token).
        query_len: tokens of every request (1 for decode, 1 + proposals for verify); attention's ``max_seqlen_q``.
    """

    num_tokens: int
    num_requests: int
    num_kv_blocks: int
    num_logit_rows: int
    query_len: int


@dataclass(frozen=True)
class GraphBuckets:
    """The shapes steps are graphed at.

    Args:
        max_batch_size: the largest bucket; steps with more requests run eagerly.
        max_query_len: the longest uniform query graphed: 1, or 1 + ``num_speculative_tokens``.
        max_model_len: the longest context (sizes the block tables).
        page_size: tokens per block.

    Raises:
        ValueError: for a size below 1.
    """

    max_batch_size: int
    max_query_len: int
    max_model_len: int
    page_size: int

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_query_len", "max_model_len", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def sizes(self) -> tuple[int, ...]:
        return capture_sizes(self.max_batch_size)

    @property
    def num_kv_blocks(self) -> int:
        return cdiv(self.max_model_len, self.page_size)

    @property
    def max_shape(self) -> PaddedShape:
        """The largest shape (what the static buffers are sized for)."""
        return self._shape(self.max_batch_size, self.max_query_len)

    def shape(self, num_requests: int, query_len: int) -> PaddedShape | None:
        """The padded shape of a uniform step of ``num_requests`` requests of ``query_len`` tokens each, or None
        when it runs eagerly (too many requests or too long a query)."""
        if num_requests > self.max_batch_size or not 1 <= query_len <= self.max_query_len:
            return None
        bucket = next(size for size in self.sizes if size >= num_requests)
        return self._shape(bucket, query_len)

    def _shape(self, num_requests: int, query_len: int) -> PaddedShape:
        tokens = num_requests * query_len
        return PaddedShape(tokens, num_requests, self.num_kv_blocks, tokens, query_len)
