"""``cbrun compact OUT`` (and ``[output] compact = true`` at a job's finish): merge small parts into few big ones.

A long job commits a part every ``commit_every_rows`` rows, so a 100M-row output holds 100k parts; readers and
object stores prefer files of a few hundred MB. Consecutive parts (in commit order) are merged into files of about
``output.target_file_mb`` each. A merged part is committed the way any part is (a local part: temporary file,
fsync, rename; an object-store part: PUT, then its commit record), and only then are the parts it replaces
removed (an object store's records first, then their parts). A kill at any moment leaves every row in the output:
at worst in both the new part and an old one, and the next run's open keeps each row's copy in its earliest part
(removing the merged part's copies), so the output stays resumable and reads as a data set.

It needs the output's lock (``cbrun.jobs.output.lock`` / ``cbrun.jobs.output.lease``): it never runs beside a job writing the same output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from cbrun.jobs.output.lock import Shard
from cbrun.jobs.output.output_dir import open_output
from cbrun.jobs.run.sharding import read_shards_file

logger = logging.getLogger("cbrun")

DEFAULT_TARGET_FILE_MB = 256


@dataclass
class Compaction:
    """What a compaction did: part files before and after, and how many merged files it wrote."""

    num_parts_before: int
    num_parts_after: int
    num_written: int


def compact_output(
    output: str | Path, target_file_mb: float = DEFAULT_TARGET_FILE_MB, *, locked: bool = False
) -> Compaction:
    """Merge the committed parts of ``output`` (a directory or an object-store URI) into files of about
    ``target_file_mb`` MB (``OutputDir.compact``: each store's way of committing a part and removing old ones).

    Args:
        locked: the caller holds the output's lock already (a job finishing); else every shard's lock is taken.

    Raises:
        jobs.output.lock.OutputLocked: when a run holds the output.
        ValueError: when ``output`` holds no cbrun job.
    """
    owner = open_output(output)
    if owner.read_job_file() is None:
        raise ValueError(f"{str(output)!r} holds no cbrun job (no _cbrun/job.json)")
    split = read_shards_file(owner) or {"count": 1}
    shards = [Shard(i, split["count"]) for i in range(split["count"])]
    holders = [] if locked else [owner.parts.lock(shard) for shard in shards]
    try:
        for lock in holders:
            lock.acquire()
        return Compaction(*owner.compact(shards, int(target_file_mb * 2**20)))
    finally:
        for lock in holders:
            lock.release()
