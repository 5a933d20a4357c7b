"""CUDA graphs for the forward pass: one graph per padded shape, replayed with static input buffers.

A captured graph replays fixed kernels on fixed addresses, so every step is padded to a ``PaddedShape`` and its
inputs are copied into buffers allocated once at the largest shape (nano-vllm ``ModelRunner.capture_cudagraph``;
transformers' continuous batching pads with ``q/kv_padding_interval_size`` the same way). Graphs are captured
lazily, the first time a shape is seen, and kept in a bounded LRU cache.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from engine.attention import AttentionMetadata, GroupMetadata
from engine.padding import PaddedShape

logger = logging.getLogger("cbrun.engine")


class GraphCache:
    """A bounded LRU map from padded shape to captured graph.

    Args:
        max_graphs: graphs kept; capturing one more evicts the least recently replayed.
        capture: ``fn(shape) -> graph`` called on a miss.
    """

    def __init__(self, max_graphs: int, capture: Callable[[PaddedShape], object]) -> None:
        if max_graphs < 1:
            raise ValueError(f"max_cached_graphs must be >= 1, got {max_graphs}")
        self.max_graphs = max_graphs
        self.capture = capture
        self._graphs: OrderedDict[PaddedShape, object] = OrderedDict()
        self.num_captures = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, shape: PaddedShape) -> bool:
        return shape in self._graphs

    def get(self, shape: PaddedShape):
        """The graph of ``shape``, captured now if absent."""
        graph = self._graphs.get(shape)
        if graph is not None:
            self._graphs.move_to_end(shape)
            return graph
        graph = self.capture(shape)
        self.num_captures += 1
        self._graphs[shape] = graph
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return graph


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    logits: torch.Tensor  # (num logit rows, vocab) static output


class CudaGraphRunner:
    """Replays the model's forward pass from CUDA graphs. Needs the Triton attention path (no host syncs).

    Args:
        model: the transformers model (loaded with the engine's attention).
        max_tokens, max_requests, max_blocks, max_logit_rows: the largest padded shape.
        group_layers: ``{group name: layers per block}`` of the model's allocators.
        template: any step's ``AttentionMetadata`` (for the layer map, page size and cache tensors).
        max_graphs: graphs kept at once.
    """

    def __init__(self, model: torch.nn.Module, max_tokens: int, max_requests: int, max_blocks: int,
                 max_logit_rows: int, group_layers: dict[str, int], template: AttentionMetadata,
                 max_graphs: int) -> None:
        device = next(model.parameters()).device
        self.model = model
        self.template = template
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.zeros(max_requests + 1, dtype=torch.int32, device=device)
        self.seqlens_k = torch.zeros(max_requests, dtype=torch.int32, device=device)
        self.logits_indices = torch.zeros(max_logit_rows, dtype=torch.int64, device=device)
        self.slots = {g: torch.full((max_tokens,), -1, dtype=torch.int64, device=device) for g in group_layers}
        self.tables = {g: torch.zeros((max_requests, max_blocks), dtype=torch.int32, device=device)
                       for g in group_layers}
        self.group_layers = group_layers
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs = GraphCache(max_graphs, self._capture)

    def run(self, input_ids, positions, md: AttentionMetadata, logits_indices, shape: PaddedShape,
            carry: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Copy the step's padded inputs into the static buffers and replay the shape's graph.

        Args:
            carry: (input rows, token ids) on the device, written over ``input_ids`` after the copy: tokens the
                step in flight sampled (async batching), which the host does not know yet.

        Returns:
            (num logit rows, vocab) logits; a view into the graph's static output, valid until the next replay.
        """
        n, b, w = shape.num_tokens, shape.num_requests, shape.num_kv_blocks
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        if carry is not None:
            self.input_ids.index_copy_(0, carry[0], carry[1])
        self.positions[:n].copy_(positions, non_blocking=True)
        self.cu_seqlens_q[:b + 1].copy_(md.cu_seqlens_q, non_blocking=True)
        self.seqlens_k[:b].copy_(md.seqlens_k, non_blocking=True)
        self.logits_indices[:len(logits_indices)].copy_(logits_indices, non_blocking=True)
        for name, group in md.groups.items():
            self.slots[name][:n].copy_(group.slot_mapping, non_blocking=True)
            self.tables[name][:b, :w].copy_(group.block_tables, non_blocking=True)
        captured = self.graphs.get(shape)
        captured.graph.replay()
        return captured.logits

    def _static_inputs(self, shape: PaddedShape):
        n, b, w = shape.num_tokens, shape.num_requests, shape.num_kv_blocks
        groups = {name: GroupMetadata(self.slots[name][:n], self.tables[name][:b, :w], layers)
                  for name, layers in self.group_layers.items()}
        md = AttentionMetadata(groups=groups, layer_groups=self.template.layer_groups,
                               cu_seqlens_q=self.cu_seqlens_q[:b + 1], seqlens_k=self.seqlens_k[:b],
                               max_seqlen_q=n, page_size=self.template.page_size, k_pages=self.template.k_pages,
                               v_pages=self.template.v_pages, use_triton=True)
        return self.input_ids[:n], self.positions[:n], md, self.logits_indices[:shape.num_logit_rows]

    def _forward(self, input_ids, positions, md, logits_indices) -> torch.Tensor:
        return self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                          logits_to_keep=logits_indices, cbrun_metadata=md).logits[0]

    def _capture(self, shape: PaddedShape) -> _Captured:
        inputs = self._static_inputs(shape)
        # Warm up on a side stream (Triton compiles, allocator settles), then capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(*inputs)
        logger.debug("captured a CUDA graph for %s", shape)
        return _Captured(graph, logits)
