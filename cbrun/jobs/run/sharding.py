"""Sharded runs: shard I of N takes a deterministic, disjoint, contiguous range of the job's rows.

The N ranges cover rows ``0 .. num_rows-1`` exactly once. They fall on row-group boundaries where the input allows
(every shard gets at least one whole row group), so a shard reads only its own row groups; otherwise (fewer row
groups than shards, or row groups too uneven) they are an even split of the rows. A row keeps its ``row_index``,
its position in the whole input, so the shards' outputs together equal the single-process run's.

It is the split Slurm job arrays and Kubernetes indexed jobs need: ``cbrun run job.toml --shard
$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT``. Each shard locks its own share of the output (``cbrun.jobs.output.lock``), writes
parts named for it (``cbrun.jobs.output.writer.part_name``) and resumes on its own; the last shard to finish writes ``_SUCCESS``.
``_cbrun/shards.json`` records the split, for ``cbrun status``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SHARDS_FILE = "shards.json"


def unit_starts(reader) -> list[int]:
    """The first row index of every unit a reader reads whole (a Parquet row group; a file otherwise), ascending."""
    starts, first_row = [], 0
    for source in reader.sources:
        sizes = getattr(source, "row_group_sizes", None) or [source.num_rows]
        for size in sizes:
            if size:
                starts.append(first_row)
            first_row += size
    return starts


def shard_ranges(starts: list[int], num_rows: int, count: int) -> list[tuple[int, int]]:
    """Split rows ``0 .. num_rows-1`` into ``count`` contiguous ranges ``[start, end)``, on unit boundaries if it can.

    A unit (row group) goes to the shard its middle row falls in under an even split; when that leaves a shard
    without a unit, the split is the even split of the rows itself.

    Args:
        starts: ascending first rows of the input's units (``unit_starts``); units past ``num_rows`` are cut off.
        num_rows: rows the job covers.
        count: the number of shards N.

    Returns:
        ``count`` ranges; ``ranges[i]`` is shard i's.
    """
    even = [(i * num_rows // count, (i + 1) * num_rows // count) for i in range(count)]
    starts = [s for s in starts if s < num_rows]
    if len(starts) < count:
        return even
    ends = starts[1:] + [num_rows]
    owner = [min(count - 1, (s + e) * count // (2 * num_rows)) for s, e in zip(starts, ends)]
    if len(set(owner)) < count:
        return even
    first = {}
    for start, shard in zip(starts, owner):
        first.setdefault(shard, start)
    bounds = [first[i] for i in range(count)] + [num_rows]
    bounds[0] = 0
    return [(bounds[i], bounds[i + 1]) for i in range(count)]


def shard_mask(num_rows: int, row_range: tuple[int, int]) -> np.ndarray:
    """Bool over rows ``0 .. num_rows-1``: True for the rows of ``row_range``."""
    mask = np.zeros(num_rows, dtype=bool)
    mask[row_range[0] : row_range[1]] = True
    return mask


def write_shards_file(owner, count: int, num_rows: int, ranges: list[tuple[int, int]]) -> None:
    """Record the split in ``_cbrun/shards.json`` through the output's owner (``cbrun.jobs.output.output_dir.OutputDir``),
    for ``cbrun status``."""
    owner.write_meta(SHARDS_FILE, {"count": count, "num_rows": num_rows, "ranges": [list(r) for r in ranges]})


def read_shards_file(owner) -> dict[str, Any] | None:
    """The split ``write_shards_file`` recorded, read through the output's owner; None when there is none."""
    return owner.read_meta(SHARDS_FILE)
