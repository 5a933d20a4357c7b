"""Padded batch shapes for CUDA graphs: a graph replays only the exact shapes it was captured with."""

from __future__ import annotations

from dataclasses import dataclass

from engine.cache_spec import cdiv


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value`` (``value`` >= 0, ``multiple`` >= 1)."""
    return cdiv(value, multiple) * multiple


def next_power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


@dataclass(frozen=True)
class PaddedShape:
    """The shape a step is padded to, and the key of its CUDA graph.

    Attributes:
        num_tokens: query tokens, a multiple of ``q_padding_interval_size`` (capped at the token budget's).
        num_requests: requests (rows of block tables, sequence lengths and sampled logits), a power of two.
        num_kv_blocks: block-table width, enough blocks for a multiple of ``kv_padding_interval_size`` tokens.
        num_logit_rows: rows of logits computed: at least ``num_requests``, then powers of two.
    """

    num_tokens: int
    num_requests: int
    num_kv_blocks: int
    num_logit_rows: int


@dataclass(frozen=True)
class PaddingPolicy:
    """How steps are padded.

    Args:
        q_padding_interval_size: query tokens are padded up to a multiple of this.
        kv_padding_interval_size: context length (tokens) the block tables can address is padded to a multiple
            of this.
        max_batch_tokens: the token budget (no step pads past its rounded-up value).
        max_requests: the request limit.
        page_size: tokens per block.
    """

    q_padding_interval_size: int
    kv_padding_interval_size: int
    max_batch_tokens: int
    max_requests: int
    page_size: int

    @classmethod
    def for_cache(cls, config, spec) -> "PaddingPolicy":
        """The policy of an ``EngineConfig``'s padding settings and budgets over a ``CacheSpec``'s pages."""
        return cls(config.q_padding_interval_size, config.kv_padding_interval_size, config.max_batch_tokens,
                   config.max_requests_per_batch, spec.page_size)

    def shape(self, num_tokens: int, num_requests: int, max_seqlen_k: int, num_logit_rows: int) -> PaddedShape:
        """The padded shape of a step with these true sizes.

        Raises:
            ValueError: when a true size exceeds the limits the policy was built for.
        """
        if num_tokens > self.max_batch_tokens or num_requests > self.max_requests:
            raise ValueError(f"step of {num_tokens} tokens / {num_requests} requests exceeds the padding limits "
                             f"({self.max_batch_tokens} / {self.max_requests})")
        tokens = min(round_up(num_tokens, self.q_padding_interval_size),
                     round_up(self.max_batch_tokens, self.q_padding_interval_size))
        requests = min(next_power_of_two(num_requests), self.max_requests)
        kv_tokens = round_up(max_seqlen_k, self.kv_padding_interval_size)
        logit_rows = max(requests, next_power_of_two(num_logit_rows))
        return PaddedShape(tokens, requests, cdiv(kv_tokens, self.page_size), logit_rows)
