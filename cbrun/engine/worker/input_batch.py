"""The model runner's persistent batch: each running request's block tables kept in a row, patched by plan deltas.

Rebuilding every scheduled request's block table from Python lists each step costs host time that grows with the
batch and the context length. Instead (vLLM v1 ``gpu_input_batch.InputBatch`` and ``block_table.BlockTable``; the
code is ours) the runner keeps one row per running request in a preallocated array and writes only what a plan says
changed: a request's whole tables when it joins the batch, the blocks it gained otherwise (one new block every
``page_size`` decode steps), and frees the rows of requests that left. A step's tables are then one gather of the
scheduled rows::

    ids (rows x width, int64)       plan entries of this step            block tables of the step (B x W)
    row 0: [4, 9, 12, 0 ...]   <-  req 7 (row 0): num_blocks 3    ->    [[4, 9, 12],
    row 1: [2, 0, ...]         <-  req 3 (row 1): num_blocks 1    ->     [2,  0,  0]]   (0 past each table)

The block manager still owns the tables; this is the runner's copy, written from plans only (``cbrun.engine.core.plan``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import numpy as np

from cbrun.engine.core.plan import ScheduledRequest


class BlockTableRows:
    """One allocator's block ids (full or sliding), a row per request, columns in position order.

    Args:
        num_rows: rows allocated at first (grown as needed).
        width: columns allocated at first (grown as needed).
    """

    def __init__(self, num_rows: int, width: int) -> None:
        # Zeros, not garbage: a gathered row is masked past its table, but a stale id must still be a real block.
        self.ids = np.zeros((max(1, num_rows), max(1, width)), dtype=np.int64)

    def write(self, row: int, start: int, block_ids: Sequence[int]) -> None:
        """Set columns ``start:start + len(block_ids)`` of ``row``."""
        end = start + len(block_ids)
        if end > self.ids.shape[1]:
            self._grow(self.ids.shape[0], max(end, 2 * self.ids.shape[1]))
        self.ids[row, start:end] = block_ids

    def ensure_rows(self, num_rows: int) -> None:
        if num_rows > self.ids.shape[0]:
            self._grow(max(num_rows, 2 * self.ids.shape[0]), self.ids.shape[1])

    def _grow(self, num_rows: int, width: int) -> None:
        ids = np.zeros((num_rows, width), dtype=np.int64)
        ids[: self.ids.shape[0], : self.ids.shape[1]] = self.ids
        self.ids = ids

    def gather(self, rows: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
        """(len(rows), width) int64 block tables of ``rows``: each row's first ``lengths[i]`` ids, then 0.

        Column 0 of a row without blocks is 0 too (block 0 is in a reserved padding chunk, never handed out).
        """
        if width <= self.ids.shape[1]:
            tables = self.ids[rows, :width]  # a copy (an index array selects the rows)
        else:
            tables = np.zeros((len(rows), width), dtype=np.int64)
            tables[:, : self.ids.shape[1]] = self.ids[rows]
        tables[np.arange(width) >= lengths[:, None]] = 0
        return tables


class PersistentBatch:
    """Rows of the requests the model runner has seen planned and not yet released, with their block tables.

    Owned by the model runner. ``release`` then ``update`` once per plan, in that order.

    Args:
        group_kinds: the allocators whose tables are kept (``FULL`` and/or ``SLIDING``).
        num_rows: rows allocated at first (``max_requests_per_batch``); more are added if ever needed.
        width: block-table columns allocated at first (blocks of the model's length); grown if ever needed.
    """

    def __init__(self, group_kinds: Iterable[str], num_rows: int, width: int) -> None:
        self.row_of: dict[int, int] = {}  # Request.index -> row
        self._free_rows = list(range(max(1, num_rows) - 1, -1, -1))  # popped from the end: low rows first
        self._num_rows = max(1, num_rows)
        self.tables = {kind: BlockTableRows(num_rows, width) for kind in group_kinds}

    def __len__(self) -> int:
        return len(self.row_of)

    def release(self, request_indices: list[int]) -> None:
        """Free the rows of requests that left the batch (indices the batch does not hold are ignored)."""
        for index in request_indices:
            row = self.row_of.pop(index, None)
            if row is not None:
                self._free_rows.append(row)

    def update(
        self, scheduled: list[ScheduledRequest], full: str | None, sliding: str | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Apply a plan's table deltas; give each entry's row and its tables' lengths after this step.

        Args:
            scheduled: the plan's entries.
            full, sliding: the kinds under which the full-attention and sliding tables are kept, or None for an
                allocator the model does not have.

        Returns:
            (rows, full table lengths, sliding table lengths or None), each (B,) int64 in plan order.

        Raises:
            RuntimeError: when an entry gives blocks from a position the batch does not hold (a plan the runner
                never saw was skipped: a bug in the caller).
        """
        row_of = self.row_of
        known = list(map(row_of.get, [s.request_index for s in scheduled]))
        if None in known:  # requests joining the batch
            rows = [row if row is not None else self._join(item) for row, item in zip(known, scheduled)]
        else:
            rows = cast("list[int]", known)
        full_rows = self.tables.get(full) if full is not None else None
        sliding_rows = self.tables.get(sliding) if sliding is not None else None
        # Decodes gain a block once every page_size steps: only the entries with new blocks are written.
        for i in [i for i, s in enumerate(scheduled) if s.new_block_ids or s.new_sliding_block_ids]:
            item = scheduled[i]
            if item.new_block_ids and full_rows is not None:
                full_rows.write(rows[i], item.block_table_start, item.new_block_ids)
            if item.new_sliding_block_ids and sliding_rows is not None:
                sliding_rows.write(rows[i], item.sliding_block_start, item.new_sliding_block_ids)
        lengths = np.array([s.block_table_start + len(s.new_block_ids) for s in scheduled], dtype=np.int64)
        sliding_lengths = None
        if sliding_rows is not None:
            sliding_lengths = np.array(
                [s.sliding_block_start + len(s.new_sliding_block_ids) for s in scheduled], dtype=np.int64
            )
        return np.array(rows, dtype=np.int64), lengths, sliding_lengths

    def _join(self, item: ScheduledRequest) -> int:
        if item.block_table_start or item.sliding_block_start:
            raise RuntimeError(
                f"request {item.request_id!r} is planned with blocks from "
                f"{item.block_table_start} / {item.sliding_block_start} on, but the model runner "
                "holds none of its earlier blocks: a plan was not launched"
            )
        if not self._free_rows:
            self._free_rows.append(self._num_rows)
            self._num_rows += 1
            for table in self.tables.values():
                table.ensure_rows(self._num_rows)
        row = self._free_rows.pop()
        self.row_of[item.request_index] = row
        return row
