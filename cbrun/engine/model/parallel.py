"""Tensor parallelism for the lean Llama path: which slice of each weight a rank holds, and the collectives its
forward pass adds (Megatron-LM's split: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter
Language Models Using Model Parallelism", section 3).

Per decoder layer, on rank r of N::

    q/k/v_proj   column-parallel: rank r computes its own heads (H / N query heads, and their KV heads)
    attention    on those heads only, over rank r's slice of the KV cache (its KV heads)
    o_proj       row-parallel: a partial sum over rank r's heads, then one all-reduce, then the bias
    gate/up_proj column-parallel: I / N intermediate features each
    down_proj    row-parallel: a partial sum, one all-reduce, then the bias

The embedding and the LM head are split by vocabulary: rank r holds rows ``[r * V', (r + 1) * V')`` of the
(vocab, hidden) matrix, ``V' = ceil(V / N)``, zero-padded past the vocabulary. A token's embedding is looked up
on the rank that holds it, the others give zeros, and one all-reduce sums them (exact: one non-zero term). The LM
head computes each rank's V' logits and one all-gather joins them; the padded columns are cut off.

KV heads: with at least N of them each rank holds ``num_kv_heads / N``; with fewer (N a multiple of their number)
each KV head is replicated over ``N / num_kv_heads`` ranks, rank r holding KV head ``r // (N / num_kv_heads)``,
the one its query heads attend with (vLLM's ``QKVParallelLinear`` does the same).

Equality with one rank: the row-parallel sums add the ranks' partial sums in another order than one GEMM does, so
logits may differ in their last bits from ``tensor_parallel_size = 1``; greedy tokens are tested equal
(``tests/engine/test_tensor_parallel.py``).

The collectives go through a ``Communicator`` (``cbrun.engine.worker.tp_group.GroupCommunicator`` over
``torch.distributed``), so this module imports nothing from the worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

#: (weight, bias or None, the function that runs it): a lean-path projection (``cbrun.engine.model.lean_llama``).
Projection = tuple[torch.Tensor, "torch.Tensor | None", Callable]


class Communicator(Protocol):
    """The collectives of one tensor-parallel group, as the forward pass calls them."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks, in place."""

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape on all), in rank order."""


@dataclass(frozen=True)
class ShardLayout:
    """Which slice of each tensor rank ``rank`` of ``world_size`` holds, from the model's shapes.

    Attributes:
        rank, world_size: this rank and the group's size.
        num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size: the whole model's shapes.
    """

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, config, rank: int, world_size: int) -> "ShardLayout":
        """The layout of a Llama-family config (``cbrun.engine.model.llama_config.LlamaConfig``) for one rank."""
        return cls(
            rank,
            world_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.intermediate_size,
            config.vocab_size,
        )

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank holds (and its slice of the KV cache has): 1 where they are replicated."""
        return max(1, self.num_kv_heads // self.world_size)

    @property
    def kv_head_start(self) -> int:
        if self.num_kv_heads >= self.world_size:
            return self.rank * self.local_kv_heads
        return self.rank // (self.world_size // self.num_kv_heads)

    @property
    def vocab_per_rank(self) -> int:
        """V' = ceil(vocab / N): every rank's rows of the embedding and logits, padding included."""
        return -(-self.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def split_of(self, name: str) -> tuple[int, int, int] | None:
        """``(dim, start, stop)`` of a checkpoint tensor this rank holds a slice of, or None when it holds it whole.

        ``stop`` may pass the tensor's end for the vocabulary split (the rest is padding, ``read_shard``).
        """
        head, inter = self.head_dim, self.intermediate_size // self.world_size
        kind, _, field = name.rpartition(".")
        if kind.endswith(("embed_tokens", "lm_head")):
            return 0, self.vocab_start, self.vocab_start + self.vocab_per_rank
        if kind.endswith("q_proj"):
            return 0, self.rank * self.local_heads * head, (self.rank + 1) * self.local_heads * head
        if kind.endswith(("k_proj", "v_proj")):
            start = self.kv_head_start * head
            return 0, start, start + self.local_kv_heads * head
        if kind.endswith(("gate_proj", "up_proj")):
            return 0, self.rank * inter, (self.rank + 1) * inter
        if field == "weight" and kind.endswith("o_proj"):  # row-parallel: the bias is added once, after the sum
            return 1, self.rank * self.local_heads * head, (self.rank + 1) * self.local_heads * head
        if field == "weight" and kind.endswith("down_proj"):
            return 1, self.rank * inter, (self.rank + 1) * inter
        return None


def unsupported_reason(config, world_size: int) -> str | None:
    """Why a Llama-family config cannot be split over ``world_size`` ranks, or None when it can."""
    if getattr(config, "moe", None) is not None:
        return "its MoE layers (experts split over ranks are not implemented yet)"
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % world_size:
        return f"num_attention_heads = {heads} is not a multiple of tensor_parallel_size = {world_size}"
    if kv_heads % world_size and world_size % kv_heads:
        return (
            f"num_key_value_heads = {kv_heads} neither divides nor is a multiple of tensor_parallel_size = {world_size}"
        )
    if config.intermediate_size % world_size:
        return (
            f"intermediate_size = {config.intermediate_size} is not a multiple of tensor_parallel_size = {world_size}"
        )
    return None


def read_shard(handle, name: str, layout: ShardLayout) -> torch.Tensor:
    """This rank's slice of tensor ``name`` read from an open safetensors file (only that slice is read).

    Args:
        handle: ``safetensors.safe_open(..., framework="pt")``.
        name: the tensor's checkpoint name.
        layout: this rank's layout.

    Returns:
        The slice, on the CPU in the file's dtype; vocabulary rows past the end are zeros.
    """
    split = layout.split_of(name)
    if split is None:
        return handle.get_tensor(name)
    dim, start, stop = split
    tensor_slice = handle.get_slice(name)
    size = tensor_slice.get_shape()[dim]
    end = min(stop, size)
    part = tensor_slice[start:end] if dim == 0 else tensor_slice[:, start:end]
    if end < stop:  # the last ranks' vocabulary rows past the end
        pad = [0, 0] * (part.dim() - 1 - dim) + [0, stop - max(end, start)]
        part = F.pad(part, pad)
    return part


@dataclass(frozen=True)
class TensorParallelWeights:
    """What a sharded ``LlamaWeights`` adds: this rank's layout and the group's collectives."""

    layout: ShardLayout
    comm: Communicator

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: (T,) int64 ids and this rank's (V', hidden) rows -> (T, hidden), summed over
        the ranks (each token's row comes from the one rank that holds it)."""
        local = input_ids - self.layout.vocab_start
        outside = (local < 0) | (local >= weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), weight)
        h.masked_fill_(outside[:, None], 0.0)
        self.comm.all_reduce(h)
        return h

    def row_parallel(self, projection: Projection) -> Projection:
        """A row-parallel projection: each rank's partial product, summed over the ranks, plus the whole bias."""
        weight, bias, run = projection
        comm = self.comm

        def partial_then_sum(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            y = run(x, w, None)
            comm.all_reduce(y)
            return y if b is None else y.add_(b)

        return weight, bias, partial_then_sum

    def gathered_head(self, projection: Projection) -> Projection:
        """The vocab-parallel LM head: each rank's (N, V') logits, gathered to (N, vocab) on every rank."""
        weight, bias, run = projection
        comm, vocab_size = self.comm, self.layout.vocab_size

        def gather(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            return torch.cat(comm.all_gather(run(x, w, b).contiguous()), dim=-1)[:, :vocab_size]

        return weight, bias, gather
