"""A step's inputs on the host: the numpy building of token ids, positions, query offsets, logit rows, slot
mappings and block tables from a plan's entries and the persistent batch, padded to a graph's shape when the step
replays one. ``cbrun.engine.worker.model_runner`` uploads them and runs the forward pass."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from cbrun.engine.core.cache_spec import cdiv, page_address, slot_address
from cbrun.engine.core.kv_layout import FULL, SLIDING
from cbrun.engine.core.plan import ScheduledRequest, SchedulerOutput
from cbrun.engine.model.layers.attention import GroupMetadata
from cbrun.engine.sample.step import StepHandle
from cbrun.engine.worker.input_batch import PersistentBatch
from cbrun.engine.worker.padding import GraphBuckets, PaddedShape


@dataclass
class StepInputs:
    """One step's inputs on the host, before upload. Token tensors are (T,), request tensors (B,) / (B + 1,)."""

    input_ids: torch.Tensor  # int64
    positions: torch.Tensor  # int64
    cu_seqlens_q: torch.Tensor  # int32
    seqlens_k: torch.Tensor  # int32
    max_seqlen_q: int
    logits_indices: torch.Tensor  # int64 rows of the flattened batch whose logits are computed
    groups: dict[str, GroupMetadata]
    shape: PaddedShape | None  # the graph's shape, or None for an eager step
    num_rows: int  # real logit rows
    sample_rows: torch.Tensor | None  # logit row of each sampling entry; None when every row samples
    carry: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (input rows, sampled rows, device tokens)
    needs_host_logits: bool  # prompt log-probabilities or host-side sampling read the logits after the step
    # NOTE: False when every sampling entry is processed on the host (sampled at launch or when read, or verified
    # there): none of them reads the device argmax, which at 256 rows of 32000 costs a few ms on a CPU.
    needs_argmax: bool = True  # some sampling entry takes the device argmax as its token


class StepInputBuilder:
    """Builds each step's ``StepInputs``; reads the runner's persistent batch (patching it from the plan's block
    table deltas) and owns nothing else.

    Args:
        input_batch: the runner's persistent batch.
        layers_per_block: layers per block of each allocator (``FULL``, ``SLIDING``; 0 for one the model lacks).
        page_size: tokens per page; ring_blocks: the sliding allocator's ring size.
        graph_buckets: the graphed shapes, or None when every step runs eagerly.
    """

    def __init__(
        self,
        input_batch: PersistentBatch,
        layers_per_block: dict[str, int],
        page_size: int,
        ring_blocks: int,
        graph_buckets: GraphBuckets | None,
    ) -> None:
        self.input_batch = input_batch
        self.layers_per_block = layers_per_block
        self.page_size = page_size
        self.ring_blocks = ring_blocks
        self.graph_buckets = graph_buckets

    def _graph_shape(self, scheduled: list[ScheduledRequest], num_tokens: int, num_rows: int) -> PaddedShape | None:
        """The padded shape of a step that replays a graph, or None when it runs eagerly: graphed are steps where
        every entry has the same number of tokens and samples each of them with no prompt log-probabilities (a
        decode step, or a verify step where every request checks the same number of proposals)."""
        if self.graph_buckets is None or num_rows != num_tokens:
            return None
        query_len = scheduled[0].num_tokens
        if any(
            s.num_tokens != query_len or s.num_sample_rows != query_len or not s.samples or s.prompt_logprob_positions
            for s in scheduled
        ):
            return None
        return self.graph_buckets.shape(len(scheduled), query_len)

    def prepare(self, plan: SchedulerOutput, previous: StepHandle | None) -> StepInputs:
        """The step's inputs as host tensors (padded to the step's shape when padding is on).

        The logit rows follow the plan's ``RowLayout``; with ``plain_greedy`` they are the sampling entries' last
        tokens.

        Per request, only its plan entry's fields are read (a few list comprehensions); everything per token is
        computed with numpy from the per-request starts and lengths, and the block tables are one gather from the
        persistent batch. A decode step (one token per entry, the common step) skips the per-token arrays: its
        positions are the starts and its query offsets a range.
        """
        scheduled, plain_greedy = plan.scheduled, plan.plain_greedy
        full = FULL if self.layers_per_block[FULL] else None
        sliding = SLIDING if self.layers_per_block[SLIDING] else None
        num_requests = len(scheduled)
        starts = np.array([s.start for s in scheduled], dtype=np.int64)
        q_lens = [s.num_tokens for s in scheduled]
        num_tokens = sum(q_lens)
        if num_tokens == num_requests:  # a decode step (one token each): positions are the starts
            token_ids = np.array([s.token_ids[0] for s in scheduled], dtype=np.int64)
            cu_seqlens_q = np.arange(num_requests + 1, dtype=np.int64)
            request_of_token = cu_seqlens_q[:-1]
            positions = starts
            seqlens_k = starts + 1
            max_seqlen_q = 1
        else:
            token_ids = np.fromiter(
                chain.from_iterable([s.token_ids for s in scheduled]), dtype=np.int64, count=num_tokens
            )
            q_len_array = np.array(q_lens, dtype=np.int64)
            cu_seqlens_q = np.zeros(num_requests + 1, dtype=np.int64)
            np.cumsum(q_len_array, out=cu_seqlens_q[1:])
            request_of_token = np.repeat(np.arange(num_requests), q_len_array)
            positions = np.arange(num_tokens) + (starts - cu_seqlens_q[:-1])[request_of_token]
            seqlens_k = starts + q_len_array
            max_seqlen_q = int(q_len_array.max())
        carry = self._carry(scheduled, cu_seqlens_q, previous, token_ids)
        rows, num_blocks, num_sliding = self.input_batch.update(scheduled, full, sliding)
        logits_indices, sample_rows, needs_host_logits = self._logit_rows(plan, cu_seqlens_q)
        num_rows = len(logits_indices)
        max_seqlen_k = int(seqlens_k.max())
        shape = self._graph_shape(scheduled, num_tokens, num_rows)
        if shape is not None:
            # Padded tokens and requests: token 0 at position 0, no query rows, no context, no cache write.
            token_ids = _pad(token_ids, shape.num_tokens)
            positions = _pad(positions, shape.num_tokens)
            cu_seqlens_q = np.concatenate((cu_seqlens_q, np.full(shape.num_requests - num_requests, num_tokens)))
            seqlens_k = _pad(seqlens_k, shape.num_requests)
            logits_indices = _pad(logits_indices, shape.num_logit_rows)
        max_blocks = cdiv(max_seqlen_k, self.page_size)  # a graph's static tables keep their other columns
        num_slots, num_table_rows = len(token_ids), len(seqlens_k)
        groups = {}
        for kind, lengths in ((full, num_blocks), (sliding, num_sliding)):
            if kind is not None:
                assert lengths is not None  # ``PersistentBatch.update`` gives the lengths of each kept table
                groups[kind] = self._group_metadata(
                    kind, rows, lengths, positions[:num_tokens], request_of_token, max_blocks, num_table_rows, num_slots
                )
        return StepInputs(
            input_ids=torch.from_numpy(token_ids),
            positions=torch.from_numpy(positions),
            cu_seqlens_q=torch.from_numpy(cu_seqlens_q.astype(np.int32)),
            seqlens_k=torch.from_numpy(seqlens_k.astype(np.int32)),
            max_seqlen_q=max_seqlen_q,
            logits_indices=torch.from_numpy(logits_indices),
            groups=groups,
            shape=shape,
            num_rows=num_rows,
            sample_rows=sample_rows,
            carry=carry,
            needs_host_logits=needs_host_logits,
            needs_argmax=plain_greedy or not all(s.needs_host_sampling for s in scheduled if s.samples),
        )

    @staticmethod
    def _logit_rows(plan: SchedulerOutput, cu_seqlens_q: np.ndarray) -> tuple[np.ndarray, torch.Tensor | None, bool]:
        """Which rows of the flattened batch get logits, and which of those are sampled (``plan.layout``'s rows).

        Returns:
            (logits_indices (N,) int64, sample_rows (S,) int64 tensor or None when every logit row samples,
            whether the host reads the logits).
        """
        scheduled = plan.scheduled
        if plan.plain_greedy:  # the common step: one logit row per sampling entry, its last token
            logits_indices = cu_seqlens_q[1:] - 1
            samples = [s.samples for s in scheduled]
            if not all(samples):
                logits_indices = logits_indices[np.array(samples, dtype=bool)]
            return logits_indices, None, False
        needs_host_sampling = any(s.needs_host_sampling for s in scheduled if s.samples)
        layout = plan.layout
        if layout.num_rows == len(layout.sample_index_of) == len(scheduled):  # each entry: one sample row, its last
            return cu_seqlens_q[1:] - 1, None, needs_host_sampling
        if layout.num_rows == layout.num_sample_rows:  # e.g. a verify step: every logit row samples
            num_sample_rows = np.array([s.num_sample_rows for s in scheduled], dtype=np.int64)
            first_rows = cu_seqlens_q[1:] - num_sample_rows  # each entry's rows are its last num_sample_rows
            first_of_row = np.repeat(first_rows - (np.cumsum(num_sample_rows) - num_sample_rows), num_sample_rows)
            logits_indices = first_of_row + np.arange(len(first_of_row))
            return logits_indices, None, needs_host_sampling
        logit_rows: list[int] = []
        sample_rows: list[int] = []
        for item, offset, first in zip(scheduled, cu_seqlens_q.tolist(), layout.first_sample_rows):
            positions = item.prompt_logprob_positions
            if positions:
                logit_rows.extend(range(offset + positions.start - item.start, offset + positions.stop - item.start))
            if item.samples:  # one row, or one per verified position (speculative decoding)
                end = offset + item.num_tokens
                logit_rows.extend(range(end - item.num_sample_rows, end))
                sample_rows.extend(range(first, first + item.num_sample_rows))
        return (
            np.array(logit_rows, dtype=np.int64),
            torch.tensor(sample_rows, dtype=torch.int64),
            True,
        )

    def _carry(
        self,
        scheduled: list[ScheduledRequest],
        cu_seqlens_q: np.ndarray,
        previous: StepHandle | None,
        token_ids: np.ndarray,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(input rows, sampled rows, device tokens) of inputs the step in flight sampled (async batching), or None.

        Their host ids (``PENDING_TOKEN``) are set to 0 in ``token_ids``: a real id for the host copy, which the
        device value replaces.
        """
        pending = [i for i, s in enumerate(scheduled) if s.num_pending_inputs]
        if not pending:
            return None
        carry_dst: list[int] = []
        carry_src: list[int] = []
        for i in pending:
            item = scheduled[i]
            self._carry_pending(item, int(cu_seqlens_q[i]), previous, carry_dst, carry_src)
        assert previous is not None  # ``_carry_pending`` raises without the step in flight
        token_ids[carry_dst] = 0
        return (
            torch.tensor(carry_dst, dtype=torch.int64),
            torch.tensor(carry_src, dtype=torch.int64),
            previous.sampled,
        )

    @staticmethod
    def _carry_pending(
        item: ScheduledRequest, offset: int, previous: StepHandle | None, carry_dst: list[int], carry_src: list[int]
    ) -> None:
        """Record that the entry's last input (at ``offset + num_tokens - 1``) comes from the device."""
        row = previous.sample_row_of.get(item.request_index) if previous is not None else None
        if row is None or item.num_pending_inputs != 1:
            raise RuntimeError(
                f"request {item.request_id!r} is scheduled with an input token that the step in flight did not sample"
            )
        carry_dst.append(offset + item.num_tokens - 1)
        carry_src.append(row)

    def _group_metadata(
        self,
        kind: str,
        rows: np.ndarray,
        lengths: np.ndarray,
        positions: np.ndarray,
        request_of_token: np.ndarray,
        num_logical_blocks: int,
        num_rows: int,
        num_slots: int,
    ) -> GroupMetadata:
        """Block tables (in pages of the group's first layer) and slot mapping of one allocator's layers.

        Args:
            rows: (B,) the scheduled requests' rows in the persistent batch; lengths: (B,) their tables' lengths.
            positions: (T,) positions of the real tokens; request_of_token: (T,) their request (0..B-1).
            num_logical_blocks: block-table width (covers the longest context, or the padded shape's).
            num_rows: block-table rows (requests, padding included; padding rows read reserved chunk 0).
            num_slots: slot-mapping length (tokens, padding included); padded tokens get slot -1.
        """
        page = self.page_size
        width = max(1, int(lengths.max()))
        blocks = self.input_batch.tables[kind].gather(rows, lengths, width)
        if num_rows > len(rows):  # padded requests: no table (column 0 reads the padding chunk)
            blocks = np.concatenate((blocks, np.zeros((num_rows - len(rows), width), dtype=np.int64)))
        if kind == SLIDING:  # logical block j lives in ring block j % ring size
            blocks = blocks[:, np.minimum(np.arange(num_logical_blocks) % self.ring_blocks, width - 1)]
        elif num_logical_blocks > width:  # columns past every table (padded shapes) read the padding chunk
            wide = np.zeros((num_rows, num_logical_blocks), dtype=np.int64)  # (not np.pad: 50x slower)
            wide[:, :width] = blocks
            blocks = wide
        elif num_logical_blocks < width:
            blocks = blocks[:, :num_logical_blocks]
        pages = page_address(blocks, self.layers_per_block[kind])
        block_of_token, offset = np.divmod(positions, page)
        slots = slot_address(pages[request_of_token, block_of_token], offset, page)
        if num_slots == len(slots):
            slot_mapping = slots
        else:
            slot_mapping = np.full(num_slots, -1, dtype=np.int64)
            slot_mapping[: len(slots)] = slots
        # NOTE: the sliding ring's column gather gives a column-major array; the Triton kernel needs rows contiguous
        tables = np.ascontiguousarray(pages, dtype=np.int32)
        return GroupMetadata(
            slot_mapping=torch.from_numpy(slot_mapping),
            block_tables=torch.from_numpy(tables),
            layers_per_block=self.layers_per_block[kind],
        )


def _pad(values: np.ndarray, size: int) -> np.ndarray:
    """``values`` followed by zeros up to ``size``."""
    out = np.zeros(size, dtype=values.dtype)
    out[: len(values)] = values
    return out
