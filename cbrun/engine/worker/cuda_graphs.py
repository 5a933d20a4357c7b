"""CUDA graphs for decode and uniform verify steps: one graph per ``PaddedShape`` (``cbrun.engine.worker.padding``), replayed
over static input buffers; real on CUDA, or emulated on any device (``cbrun.engine.worker.graph_emulation``).

A replay reads only the static buffers, the weights and the KV cache::

    step inputs --copy--> static buffers --(captured: metadata, per-layer shifts, kernels)--> static logits

Everything the captured forward derives from its inputs, the ``AttentionMetadata`` and each layer's shifted slot
mapping and block tables included, is computed inside the captured region from the static buffers, so a replay
recomputes it from the new step's values. The eager warm-up before a capture builds its own metadata, which is
dropped. (Static buffers allocated once at the largest shape and sliced per graph: nano-vllm
``ModelRunner.capture_cudagraph``.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cbrun.engine.model.layers.attention import AttentionMetadata, GroupMetadata
from cbrun.engine.worker.graph_emulation import EmulatedGraph
from cbrun.engine.worker.padding import GraphBuckets, PaddedShape

if TYPE_CHECKING:
    from torch.cuda.graphs import _POOL_HANDLE

logger = logging.getLogger("cbrun.engine")


class _CudaGraph:
    """``torch.cuda.CUDAGraph`` behind ``EmulatedGraph``'s interface; all graphs share one memory pool."""

    def __init__(self, pool: _POOL_HANDLE | None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, static: list[torch.Tensor] | None = None) -> torch.cuda.graph:
        """Stream capture into the graph; ``static`` is ``EmulatedGraph``'s check, which a real graph needs not."""
        return torch.cuda.graph(self.graph, pool=self.pool)

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class _Captured:
    graph: _CudaGraph | EmulatedGraph
    logits: torch.Tensor  # (num logit rows, vocab) static output


@dataclass(frozen=True)
class AttentionSetup:
    """What every step's ``AttentionMetadata`` shares: the layer map, the cache and the kernel choice."""

    layer_groups: list[tuple[str, int]]
    page_size: int
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    use_triton: bool
    use_cpu_kernel: bool
    cpu_kernel_threads: int | None


class CudaGraphRunner:
    """Captures and replays the transformers forward pass of graphed steps. Owns the static buffers, the graphs
    and their counters (``num_captures``, ``num_replays``).

    Args:
        model: the transformers model (loaded with the engine's attention).
        buckets: the graphed shapes; captures happen lazily, at most one per shape.
        group_layers: ``{group name: layers per block}`` of the model's allocators.
        setup: the attention setup of every step.
        emulate: record and replay on any device (``EmulatedGraph``) instead of CUDA graphs; the kernels are then
            called through ``cbrun.kernels.custom_ops`` so that they are recorded.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        buckets: GraphBuckets,
        group_layers: dict[str, int],
        setup: AttentionSetup,
        emulate: bool = False,
    ) -> None:
        device = next(model.parameters()).device
        self.model = model
        self.setup = setup
        self.emulate = emulate
        top = buckets.max_shape
        self.input_ids = torch.zeros(top.num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top.num_tokens, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.zeros(top.num_requests + 1, dtype=torch.int32, device=device)
        self.seqlens_k = torch.zeros(top.num_requests, dtype=torch.int32, device=device)
        self.logits_indices = torch.zeros(top.num_logit_rows, dtype=torch.int64, device=device)
        self.slots = {g: torch.full((top.num_tokens,), -1, dtype=torch.int64, device=device) for g in group_layers}
        self.tables = {
            g: torch.zeros((top.num_requests, top.num_kv_blocks), dtype=torch.int32, device=device)
            for g in group_layers
        }
        self.group_layers = group_layers
        self.pool = None if emulate else torch.cuda.graph_pool_handle()
        self._graphs: dict[PaddedShape, _Captured] = {}
        self.num_captures = 0
        self.num_replays = 0

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        logits_indices: torch.Tensor,
        shape: PaddedShape,
        carry: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Copy the step's padded inputs into the static buffers and replay the shape's graph (captured first if
        this shape is new).

        Args:
            input_ids, positions: (shape.num_tokens,) int64; logits_indices: (shape.num_logit_rows,) int64.
            md: the step's metadata, padded to ``shape`` (block tables: as wide as its longest context): only its
                tensors are read (copied).
            carry: (input rows, token ids) on the device, written over ``input_ids`` after the copy: tokens the
                step in flight sampled (async batching), which the host does not know yet.

        Returns:
            (num logit rows, vocab) logits; a view into the graph's static output, valid until the next replay.
        """
        n, b = shape.num_tokens, shape.num_requests
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        if carry is not None:
            self.input_ids.index_copy_(0, carry[0], carry[1])
        self.positions[:n].copy_(positions, non_blocking=True)
        self.cu_seqlens_q[: b + 1].copy_(md.cu_seqlens_q, non_blocking=True)
        self.seqlens_k[:b].copy_(md.seqlens_k, non_blocking=True)
        self.logits_indices[: shape.num_logit_rows].copy_(logits_indices, non_blocking=True)
        for name, group in md.groups.items():
            self.slots[name][:n].copy_(group.slot_mapping, non_blocking=True)
            # NOTE: only the step's columns: those past its longest context keep earlier steps' page ids (valid
            # pages), which no kernel reads: each reads only the blocks its request's context length covers.
            self.tables[name][:b, : group.block_tables.shape[1]].copy_(group.block_tables, non_blocking=True)
        captured = self._graphs.get(shape)
        if captured is None:
            captured = self._graphs[shape] = self._capture(shape)
            self.num_captures += 1
        captured.graph.replay()
        self.num_replays += 1
        return captured.logits

    def _static_inputs(self, shape: PaddedShape) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Views of the static buffers at ``shape``, and a new ``AttentionMetadata`` over them (a new one on each
        call: whatever a forward caches in it stays with that forward)."""
        n, b = shape.num_tokens, shape.num_requests
        groups = {
            name: GroupMetadata(self.slots[name][:n], self.tables[name][:b], layers)
            for name, layers in self.group_layers.items()
        }
        s = self.setup
        md = AttentionMetadata(
            groups=groups,
            layer_groups=s.layer_groups,
            cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            seqlens_k=self.seqlens_k[:b],
            max_seqlen_q=shape.query_len,
            page_size=s.page_size,
            k_pages=s.k_pages,
            v_pages=s.v_pages,
            use_triton=s.use_triton,
            use_cpu_kernel=s.use_cpu_kernel,
            cpu_kernel_threads=s.cpu_kernel_threads,
            kernels_as_ops=self.emulate,
        )
        return self.input_ids[:n], self.positions[:n], md, self.logits_indices[: shape.num_logit_rows]

    def _static_tensors(self) -> list[torch.Tensor]:
        """Every tensor a replay may read that the captured region does not make: the static input buffers, the
        model's weights and buffers, and the KV cache (the emulation checks that nothing else is read)."""
        buffers = [
            self.input_ids,
            self.positions,
            self.cu_seqlens_q,
            self.seqlens_k,
            self.logits_indices,
            *self.slots.values(),
            *self.tables.values(),
        ]
        return [*buffers, *self.model.parameters(), *self.model.buffers(), self.setup.k_pages, self.setup.v_pages]

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        logits: torch.Tensor = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=logits_indices,
            cbrun_metadata=md,
        ).logits[0]
        return logits

    def _capture(self, shape: PaddedShape) -> _Captured:
        """Warm up eagerly (Triton compiles, the allocator settles), then capture a forward whose inputs, the
        metadata included, are all made inside the captured region."""
        graph: EmulatedGraph | _CudaGraph = EmulatedGraph() if self.emulate else _CudaGraph(self.pool)
        if self.emulate:
            self._forward(*self._static_inputs(shape))
        else:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(*self._static_inputs(shape))
            torch.cuda.current_stream().wait_stream(stream)
        with graph.capture(self._static_tensors() if self.emulate else None):
            logits = self._forward(*self._static_inputs(shape))
        logger.debug("captured a %s graph for %s", "emulated" if self.emulate else "CUDA", shape)
        return _Captured(graph, logits)
