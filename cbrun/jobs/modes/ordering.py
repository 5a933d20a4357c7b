"""How the job submits work: rows in prefix-aware order, and the samples of one row together.

Prefix-aware ordering looks ahead over a bounded window of prepared rows and submits each window sorted by prompt
token ids, so rows that share a prompt prefix (a few-shot template, a system prompt) run close together while the
engine's prefix cache still holds that prefix::

    input order:   A1 B1 A2 C1 B2 A3 | A4 C2 ...      (window = 6; A, B, C: three shared prefixes)
    submitted:     A1 A2 A3 B1 B2 C1 | A4 C2 ...

It changes the order of work, never its content: each row keeps its ``row_index`` and ``id``, and its request is
the one it would be in input order. The window bounds memory: at most ``window`` prepared rows wait here, besides
the engine's in-flight requests.

The ``n`` samples of a row are submitted back to back, so the first one's prompt blocks serve the others from the
prefix cache. ``SampleGroups`` holds a row's finished samples until all of them are back; the job then hands them
to the writer as one group, which commits them in the same part (a row is done only when all its samples are).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from cbrun.jobs.input.reader import RowPlace, row_where

T = TypeVar("T")


def prompt_sort_key(prompt_token_ids: Sequence[int]) -> bytes:
    """The token ids as big-endian uint64 bytes.

    Bytes compare like the id list (a prefix sorts before its extensions), but at ``memcmp`` speed: a window of
    prompts that share a 400-token prefix sorts without 400 Python int comparisons per pair.
    """
    return np.asarray(prompt_token_ids, dtype=">u8").tobytes()


def order_by_prefix(items: Iterable[T], key: Callable[[T], Sequence[int]], window: int) -> Iterator[T]:
    """Yield ``items`` window by window, each window sorted by ``key`` (prompt token ids); ties keep input order.

    Args:
        items: pulled lazily, at most ``window`` ahead of what was yielded.
        key: an item's prompt token ids.
        window: items per sorted window; 0 yields the items in input order.
    """
    assert window >= 0, window
    if window == 0:
        yield from items
        return
    buffer: list[T] = []
    for item in items:
        buffer.append(item)
        if len(buffer) == window:
            batch, buffer = buffer, []
            yield from sorted(batch, key=lambda it: prompt_sort_key(key(it)))
    yield from sorted(buffer, key=lambda it: prompt_sort_key(key(it)))


@dataclass
class RowWork:
    """One prepared row on its way to the engine.

    Attributes:
        row_index / id: the input row's.
        prompt_token_ids: the prompt as run (the sort key).
        requests: ``((row_index, sample_index), prompt_token_ids, SamplingParams)``, one per sample.
    """

    row_index: int
    id: str
    prompt_token_ids: list[int]
    requests: list[tuple] = field(default_factory=list)


@dataclass
class _Group:
    id: str
    num_samples: int
    place: RowPlace | None = None
    finished: list = field(default_factory=list)


class SampleGroups:
    """The rows in flight: each row's id and its finished samples, until all of its samples are back.

    Request ids are ``(row_index, sample_index)``; a row with ``n`` samples is in flight from its first submitted
    request until its ``n``-th output comes back.
    """

    def __init__(self) -> None:
        self._groups: dict[int, _Group] = {}

    def __len__(self) -> int:
        return len(self._groups)

    def start(self, row_index: int, row_id: str, num_samples: int, place: RowPlace | None = None) -> None:
        """Put a row in flight: its id, its samples, and its place in its file (``InputRow.place``)."""
        assert row_index not in self._groups, f"row {row_index} submitted twice"
        self._groups[row_index] = _Group(row_id, num_samples, place)

    def row_id(self, row_index: int) -> str:
        return self._groups[row_index].id

    def where(self, row_index: int) -> str:
        """How a message names the row in flight (``row_where``)."""
        group = self._groups[row_index]
        return row_where(row_index, group.id, group.place)

    def add(self, row_index: int, row) -> list | None:
        """Record one finished sample (an ``OutputRow``); return the row's samples, by sample index, once all are
        back (the row then leaves the group), else None."""
        group = self._groups[row_index]
        group.finished.append(row)
        if len(group.finished) < group.num_samples:
            return None
        del self._groups[row_index]
        return sorted(group.finished, key=lambda r: r.sample_index)
