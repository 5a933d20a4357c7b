"""The token embedding and the LM head of the lean forward pass, whole or vocab-parallel over a tensor-parallel
group (nano-vllm's ``VocabParallelEmbedding`` / ``ParallelLMHead``; the collectives are
``cbrun.engine.model.layers.parallel.TensorParallelWeights``')."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cbrun.engine.model.layers.linear import Projection
from cbrun.engine.model.layers.parallel import TensorParallelWeights


def embed_tokens(input_ids: torch.Tensor, weight: torch.Tensor, parallel: TensorParallelWeights | None) -> torch.Tensor:
    """(T,) int64 token ids -> (T, hidden) their embedding rows of ``weight`` ((vocab, hidden), or this rank's
    (V', hidden) rows under tensor parallelism, summed over the ranks)."""
    return F.embedding(input_ids, weight) if parallel is None else parallel.embed(input_ids, weight)


def lm_head(head: Projection, parallel: TensorParallelWeights | None) -> Projection:
    """The LM head ((N, hidden) -> (N, vocab) logits) from its projection (``linear.projection``: its GEMM chosen
    as any projection's): under tensor parallelism each rank's (N, V') logits gathered to (N, vocab)."""
    return head if parallel is None else parallel.gathered_head(head)
