"""Tensor parallelism for the lean Llama path: which slice of each weight a rank holds, and the collectives its
forward pass adds (Megatron-LM's split: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter
Language Models Using Model Parallelism", section 3).

Per decoder layer, on rank r of N::

    q/k/v_proj   column-parallel: rank r computes its own heads (H / N query heads, and their KV heads)
    attention    on those heads only, over rank r's slice of the KV cache (its KV heads)
    o_proj       row-parallel: a partial sum over rank r's heads, then one all-reduce, then the bias
    gate/up_proj column-parallel: I / N intermediate features each
    down_proj    row-parallel: a partial sum, one all-reduce, then the bias

where I is the MLP's own width, read from the tensor's shape: a dense layer's ``intermediate_size``, Qwen2-MoE's
shared expert's ``shared_expert_intermediate_size`` (its ``shared_expert_gate``, one output, is held whole). Each
split width must be a multiple of N (``unsupported_reason`` names the first tensor that is not).

The embedding and the LM head are split by vocabulary: rank r holds rows ``[r * V', (r + 1) * V')`` of the
(vocab, hidden) matrix, ``V' = ceil(V / N)``, zero-padded past the vocabulary. A token's embedding is looked up
on the rank that holds it, the others give zeros, and one all-reduce sums them (exact: one non-zero term). The LM
head computes each rank's V' logits and one all-gather joins them; the padded columns are cut off.

MoE layers (Qwen3-MoE, Qwen2-MoE, Mixtral) split by expert instead: rank r holds experts
``[r * E / N, (r + 1) * E / N)`` whole, and the router on every rank. Every rank routes every token (the same router
on the same replicated hidden states gives the same choice), computes the (token, expert) pairs of its own experts
with the grouped GEMM, zeros the others, and one all-reduce sums each token's experts over the ranks
(``ExpertParallelMoE``). An expert is never cut, so its width (``moe_intermediate_size``, Mixtral's
``intermediate_size``) need not split.

KV heads: with at least N of them each rank holds ``num_kv_heads / N``; with fewer (N a multiple of their number)
each KV head is replicated over ``N / num_kv_heads`` ranks, rank r holding KV head ``r // (N / num_kv_heads)``,
the one its query heads attend with (vLLM's ``QKVParallelLinear`` does the same).

Quantized weights (``cbrun.engine.model.layers.quantization``) split the same way: each rank reads only the part of
each stored tensor (packed codes, scales, zero points) that holds its rows or input features
(``read_quantized_shard``, ``quantization.shards``) and keeps it in the same weight type, so the quantized GEMM runs
each rank's slice unchanged. A slice must start on the layout's block, group or packed word
(``unsupported_quantized_reason`` refuses the model by name otherwise); quantized experts are held whole, as any.

Equality with one rank: the row-parallel sums add the ranks' partial sums in another order than one GEMM does, so
logits may differ in their last bits from ``tensor_parallel_size = 1``; greedy tokens are tested equal
(``tests/engine/model/test_tensor_parallel.py``).

The collectives go through a ``Communicator`` (``cbrun.engine.worker.tp_group.GroupCommunicator`` over
``torch.distributed``), so this module imports nothing from the worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from cbrun.engine.model.layers.linear import Projection
from cbrun.engine.model.layers.moe import MoEWeights, grouped_gemm_unavailable_reason, route
from cbrun.engine.model.layers.quantization import shards
from cbrun.engine.model.layers.quantization.schemes import QuantScheme


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

    An MLP's width is not among them: a "column" or "row" split cuts the dimension the tensor itself has
    (``split``), so MLPs of different widths in one model (a dense layer's and a shared expert's) each split by
    their own.

    Attributes:
        rank, world_size: this rank and the group's size.
        num_heads, num_kv_heads, head_dim, vocab_size: the whole model's shapes.
        num_experts: experts per MoE layer (0 for a dense model).
    """

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int = 0

    @classmethod
    def of(cls, config, rank: int, world_size: int) -> "ShardLayout":
        """The layout of a Llama-family config (``cbrun.engine.model.config.LlamaConfig``) for one rank."""
        return cls(
            rank,
            world_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.vocab_size,
            config.moe.num_experts if getattr(config, "moe", None) is not None else 0,
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
    def local_experts(self) -> range:
        """The MoE experts this rank holds (their ids in the whole model)."""
        per_rank = self.num_experts // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def holds(self, name: str) -> bool:
        """Whether this rank reads checkpoint tensor ``name`` at all (another rank's experts it does not)."""
        _, marker, rest = name.partition(".experts.")
        return not marker or int(rest.split(".", 1)[0]) in self.local_experts

    @property
    def vocab_per_rank(self) -> int:
        """V' = ceil(vocab / N): every rank's rows of the embedding and logits, padding included."""
        return -(-self.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def split(self, style: str | None, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """``(dim, start, stop)`` of this rank's slice of a tensor split in ``style`` (one of ``SPLIT_STYLES``,
        which the model's family gives per tensor), or None (``style`` None) when every rank holds it whole.

        Args:
            style: how the tensor is split.
            shape: the whole tensor's shape (a weight's (out_features, in_features), a bias's (out_features,)):
                a "column" / "row" split cuts its dimension 0 / 1, whatever its size, into ``world_size`` equal
                parts (``unsupported_reason`` refuses a size that is not a multiple of it before any load).

        ``stop`` may pass the tensor's end for the vocabulary split (the rest is padding, ``read_shard``).
        """
        head = self.head_dim
        if style is None:
            return None
        if style == "vocab":
            return 0, self.vocab_start, self.vocab_start + self.vocab_per_rank
        if style == "column_heads":
            return 0, self.rank * self.local_heads * head, (self.rank + 1) * self.local_heads * head
        if style == "column_kv_heads":
            start = self.kv_head_start * head
            return 0, start, start + self.local_kv_heads * head
        if style == "column":
            return self._even(0, shape)
        if style == "row_heads":
            return 1, self.rank * self.local_heads * head, (self.rank + 1) * self.local_heads * head
        if style == "row":
            return self._even(1, shape)
        raise ValueError(f"unknown tensor-parallel split {style!r}; one of {SPLIT_STYLES}")

    def _even(self, dim: int, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """This rank's 1/N of dimension ``dim`` of a ``shape`` tensor."""
        per_rank, rest = divmod(shape[dim], self.world_size)
        assert not rest, f"a {shape} tensor does not split over {self.world_size} ranks (unsupported_reason)"
        return dim, self.rank * per_rank, (self.rank + 1) * per_rank

    def local_shape(self, shape: tuple[int, ...], style: str | None) -> tuple[int, ...]:
        """The shape of this rank's slice of a ``shape`` tensor split in ``style`` (padding included)."""
        split = self.split(style, shape)
        if split is None:
            return shape
        dim, start, stop = split
        return (*shape[:dim], stop - start, *shape[dim + 1 :])


#: How a tensor is split over the ranks (Megatron-LM's): "vocab" (rows, by vocabulary), "column_heads" /
#: "column_kv_heads" (output rows, by query / KV head), "column" (output rows, by its MLP's intermediate feature),
#: "row_heads" / "row" (input columns, by query head / its MLP's intermediate feature: the product is a partial sum;
#: a row-parallel bias is held whole, added once after the sum).
SPLIT_STYLES = ("vocab", "column_heads", "column_kv_heads", "column", "row_heads", "row")


def unsupported_reason(
    config, shapes: dict[str, tuple[int, ...]], style_of: Callable[[str], str | None], world_size: int
) -> str | None:
    """Why a Llama-family model cannot be split over ``world_size`` ranks, or None when it can: its experts,
    query heads or KV heads do not divide among the ranks, or a tensor split by intermediate feature (an MLP's
    gate/up rows or down_proj inputs) has a width that is not a multiple of ``world_size``, named with its width.

    Args:
        config: the model's ``LlamaConfig``.
        shapes: every checkpoint tensor's name and whole shape (the family's ``checkpoint_shapes``), in order.
        style_of: the family's ``shard_style`` (a tensor name -> its split style, None for whole).
        world_size: the number of ranks.
    """
    moe = getattr(config, "moe", None)
    if moe is not None and moe.num_experts % world_size:
        return f"{moe.num_experts} experts per MoE layer are not a multiple of tensor_parallel_size = {world_size}"
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % world_size:
        return f"num_attention_heads = {heads} is not a multiple of tensor_parallel_size = {world_size}"
    if kv_heads % world_size and world_size % kv_heads:
        return (
            f"num_key_value_heads = {kv_heads} neither divides nor is a multiple of tensor_parallel_size = {world_size}"
        )
    for name, shape in shapes.items():
        dim = {"column": 0, "row": 1}.get(style_of(name) or "")
        if dim is not None and shape[dim] % world_size:
            return (
                f"{name}'s {shape[dim]} {shards.DIM_NAMES[dim]} (its MLP's width) do not split over "
                f"tensor_parallel_size = {world_size} ranks: {shape[dim]} is not a multiple of {world_size}"
            )
    return None


def read_shard(handle, name: str, layout: ShardLayout, style: str | None) -> torch.Tensor:
    """This rank's slice of tensor ``name`` read from an open safetensors file (only that slice is read).

    Args:
        handle: ``safetensors.safe_open(..., framework="pt")``.
        name: the tensor's checkpoint name.
        layout: this rank's layout.
        style: how the tensor is split (``ShardLayout.split``: the family's ``shard_style``), None for whole.

    Returns:
        The slice, on the CPU in the file's dtype, in memory of its own (contiguous, allocator-aligned); vocabulary
        rows past the end are zeros.
    """
    tensor_slice = handle.get_slice(name)
    shape = tuple(tensor_slice.get_shape())
    split = layout.split(style, shape)
    if split is None:
        return handle.get_tensor(name)
    dim, start, stop = split
    size = shape[dim]
    end = min(stop, size)
    part = tensor_slice[start:end] if dim == 0 else tensor_slice[:, start:end]
    if end < stop:  # the last ranks' vocabulary rows past the end
        pad = [0, 0] * (part.dim() - 1 - dim) + [0, stop - max(end, start)]
        part = F.pad(part, pad)
    # NOTE: a column slice (o_proj, down_proj) is a strided view, and a row slice may start anywhere in the file's
    # buffer; oneDNN's linear ran such a weight up to 1000x slower than the same values in their own aligned
    # memory (a (1024, 2048) down_proj slice: 3.5 s against 3.3 ms for 64 rows, benchmarks/tensor_parallel.py)
    return torch.empty(part.shape, dtype=part.dtype).copy_(part)


def unsupported_quantized_reason(
    config, weights: dict[str, tuple[int, ...]], style_of: Callable[[str], str | None], world_size: int
) -> str | None:
    """Why a quantized checkpoint's weights cannot be split over ``world_size`` ranks, or None when they can: a
    rank's slice must start on its layout's block, group or packed word (``shards.split_unit``), and a quantized
    weight split by vocabulary (an embedding or LM head) is not split at all.

    Args:
        config: the model's ``LlamaConfig``, whose ``quantization`` is the checkpoint's layout.
        weights: each quantized linear's weight name and its whole (out_features, in_features).
        style_of: the family's ``shard_style`` (a tensor name -> its split style, None for whole).
        world_size: the number of ranks.
    """
    scheme: QuantScheme = config.quantization
    layouts = [ShardLayout.of(config, rank, world_size) for rank in range(world_size)]
    for name, shape in sorted(weights.items()):
        style = style_of(name)
        if style is None:  # held whole: a MoE expert, a row-parallel bias
            continue
        if style == "vocab":
            return (
                f"the quantized weight {name} would be split by vocabulary, which cbrun does for unquantized "
                "weights only"
            )
        splits = [layout.split(style, shape) for layout in layouts]
        dim = splits[0][0]  # type: ignore[index]  # a style that splits
        unit = shards.split_unit(scheme, dim, (shape[0], shape[1]))
        if all(split[1] % unit.multiple == 0 for split in splits):  # type: ignore[index]
            continue
        return (
            f"the quantized weight {name} does not split on its layout's boundaries: its {shape[dim]} "
            f"{shards.DIM_NAMES[dim]} split into {layouts[0].local_shape(shape, style)[dim]} per rank, and a rank's "
            f"slice must start on a multiple of {unit.multiple}: {unit.why}; choose a tensor_parallel_size that "
            "splits it there, or an unquantized checkpoint"
        )
    return None


def read_quantized_shard(
    handle,
    name: str,
    suffix: str,
    shape: tuple[int, int],
    scheme: QuantScheme,
    layout: ShardLayout,
    style: str | None,
) -> torch.Tensor:
    """This rank's part of one stored tensor of a quantized linear, read from an open safetensors file (only that
    part is read: ``shards.stored_slice``), restated for the rank's weight (``shards.rebase``).

    Args:
        handle: ``safetensors.safe_open(..., framework="pt")``.
        name: the stored tensor's checkpoint name.
        suffix: the tensor's name after the linear's (``weight_scale_inv``, ``qweight``, ...).
        shape: the whole weight's (out_features, in_features).
        scheme: the checkpoint's layout.
        layout: this rank's layout.
        style: how the weight is split (the family's ``shard_style``), None for whole.

    Returns:
        The part, on the CPU in the file's dtype, in memory of its own.
    """
    split = layout.split(style, shape)
    if split is None:
        return handle.get_tensor(name)
    assert style != "vocab", "a vocabulary split of a quantized weight is refused before loading"
    dim, start, stop = split
    tensor_slice = handle.get_slice(name)
    where = shards.stored_slice(scheme, suffix, dim, start, stop, shape, tuple(tensor_slice.get_shape()))
    if where is None:
        tensor = handle.get_tensor(name)
    else:
        stored_dim, first, end = where
        piece = tensor_slice[first:end] if stored_dim == 0 else tensor_slice[:, first:end]
        tensor = torch.empty(piece.shape, dtype=piece.dtype).copy_(piece)  # aligned memory, as ``read_shard``
    return shards.rebase(scheme, name, suffix, tensor, dim, start, stop, shape)


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

    def expert_parallel(self, moe) -> "ExpertParallelMoE":
        """A MoE layer (``cbrun.engine.model.layers.moe.SparseMoE`` over this rank's experts) as ``ExpertParallelMoE``."""
        return ExpertParallelMoE(moe.weights, self.layout.local_experts.start, self.comm)


class ExpertParallelMoE:
    """A MoE block over one rank's experts: every rank routes all tokens, computes its own experts' pairs, and one
    all-reduce sums them (see the module docstring).

    Args:
        weights: the router (E, hidden), whole; ``gate_up`` (E / N, 2I, hidden) and ``down`` (E / N, hidden, I) of
            this rank's experts, tensors or ``QuantizedExperts`` (a quantized checkpoint's, dequantized per forward
            as ``cbrun.engine.model.layers.moe.SparseMoE`` does: this rank's experts of one layer at a time).
        expert_start: the id of this rank's first expert.
        comm: the group's collectives.
    """

    def __init__(self, weights: MoEWeights, expert_start: int, comm: Communicator) -> None:
        self.weights, self.expert_start, self.comm = weights, expert_start, comm
        # NOTE: quantized experts are judged on one expert dequantized, as ``SparseMoE`` judges them
        self.fallback_reason = grouped_gemm_unavailable_reason(weights.dense(slice(0, 1)))

    def __call__(self, x: torch.Tensor, silu_mul: Callable | None = None) -> torch.Tensor:
        """(T, hidden) -> (T, hidden) in ``x``'s dtype: every rank's experts' share, summed over the ranks.
        ``silu_mul`` (``SparseMoE``'s batch-invariant activation) is not used: tensor parallelism refuses
        ``batch_invariant = on``."""
        y = local_experts(x, self.weights.dense(), self.expert_start, grouped=self.fallback_reason is None)
        self.comm.all_reduce(y)
        return y.to(x.dtype)


def local_experts(x: torch.Tensor, moe: MoEWeights, expert_start: int, grouped: bool = True) -> torch.Tensor:
    """Each token's weighted sum over those of its chosen experts this rank holds (zero where it holds none).

    The pairs of other ranks' experts sort after the local ones (id ``E / N``) and are left out of the grouped
    GEMM's groups; their rows, which it leaves unwritten, are zeroed by ``torch.where``.

    Args:
        x: (T, hidden) the normed hidden states.
        moe: the router (E, hidden) and this rank's ``E / N`` experts (tensors: ``MoEWeights.dense``).
        expert_start: the id of the first local expert.
        grouped: the grouped GEMM (``torch._grouped_mm``); False computes every local expert on every token.

    Returns:
        (T, hidden) in the experts' output dtype (float32 where the routing weights are, as ``sparse_moe``).
    """
    assert isinstance(moe.gate_up, torch.Tensor) and isinstance(moe.down, torch.Tensor), "dequantize experts first"
    weights, expert_ids = route(x, moe)
    num_local = moe.gate_up.shape[0]
    local_ids = expert_ids - expert_start
    is_local = (local_ids >= 0) & (local_ids < num_local)  # (T, k)
    num_tokens, top_k = expert_ids.shape
    width = moe.down.shape[-1]
    if not grouped:
        gate_up = torch.einsum("th,eoh->eto", x, moe.gate_up)  # (E / N, T, 2I)
        every = torch.einsum("eti,ehi->eth", F.silu(gate_up[..., :width]) * gate_up[..., width:], moe.down)
        tokens = torch.arange(num_tokens, device=x.device)[:, None]
        chosen = every[local_ids.clamp(0, num_local - 1), tokens] * weights[..., None]  # (T, k, hidden)
        return torch.where(is_local[..., None], chosen, 0.0).sum(dim=1)
    flat = torch.where(is_local, local_ids, num_local).reshape(-1)  # (S,), S = T * k
    order = torch.argsort(flat, stable=True)
    rows = x[order // top_k]
    counts = torch.zeros(num_local + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = counts[:num_local].cumsum(0, dtype=torch.int32)
    gate_up = torch._grouped_mm(rows, moe.gate_up.transpose(1, 2), offs=offsets)  # (S, 2I), local rows only
    hidden = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    out = torch._grouped_mm(hidden, moe.down.transpose(1, 2), offs=offsets) * weights.reshape(-1)[order, None]
    out = torch.where(is_local.reshape(-1)[order, None], out, 0.0)
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return unsorted.view(num_tokens, top_k, -1).sum(dim=1)
