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

import pyarrow as pa
import pyarrow.parquet as pq

from cbrun.jobs.output.checkpoint import Checkpoint
from cbrun.jobs.output.lock import Shard
from cbrun.jobs.output.object_output import ObjectCheckpoint, ObjectPartWriter, output_owner
from cbrun.jobs.output.writer import (
    PART_RE,
    PartWriter,
    committed_parts,
    conform_table,
    part_name,
    part_shard,
)
from cbrun.jobs.run.sharding import read_shards_file
from cbrun.jobs.store.files import join, object_info, open_input, remove, write_file

logger = logging.getLogger("cbrun")

DEFAULT_TARGET_FILE_MB = 256


@dataclass
class Compaction:
    """What a compaction did: part files before and after, and how many merged files it wrote."""

    num_parts_before: int
    num_parts_after: int
    num_written: int


def groups_by_size(sizes: list[int], target_bytes: int) -> list[list[int]]:
    """Split consecutive parts (by their sizes) into runs of about ``target_bytes``; only runs of two or more
    parts are worth merging, so single parts are left out."""
    groups, current, total = [], [], 0
    for i, size in enumerate(sizes):
        if current and total + size > target_bytes:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    groups.append(current)
    return [g for g in groups if len(g) > 1]


def read_parts(parts: list[str | Path]) -> pa.Table:
    """The rows of ``parts``, in order, each conformed to the output schema (``conform_table``)."""
    tables = []
    for part in parts:
        with open_input(part) as f:
            tables.append(conform_table(pq.read_table(f)))
    return pa.concat_tables(tables, promote_options="default")


def compact_output(
    output: str | Path, target_file_mb: float = DEFAULT_TARGET_FILE_MB, *, locked: bool = False
) -> Compaction:
    """Merge the committed parts of ``output`` (a directory or an object-store URI) into files of about
    ``target_file_mb`` MB.

    Args:
        locked: the caller holds the output's lock already (a job finishing); else every shard's lock is taken.

    Raises:
        jobs.output.lock.OutputLocked: when a run holds the output.
        ValueError: when ``output`` holds no cbrun job.
    """
    target = int(target_file_mb * 2**20)
    owner = output_owner(output)
    if owner.read_job_file() is None:
        raise ValueError(f"{str(output)!r} holds no cbrun job (no _cbrun/job.json)")
    split = read_shards_file(owner) or {"count": 1}
    shards = [Shard(i, split["count"]) for i in range(split["count"])]
    holders = [] if locked else [output_owner(output, shard).lock for shard in shards]
    try:
        for lock in holders:
            lock.acquire()
        if isinstance(owner, ObjectCheckpoint):
            return _compact_objects(owner, target)
        return _compact_directory(owner, shards, target)
    finally:
        for lock in holders:
            lock.release()


def _compact_objects(owner: ObjectCheckpoint, target: int) -> Compaction:
    records = owner.records()
    sizes = [int((object_info(str(join(owner.output_dir, r.part))) or {}).get("size") or 0) for r in records]
    writer = ObjectPartWriter(owner.output_dir)
    groups = groups_by_size(sizes, target)
    for group in groups:
        merged = [records[i] for i in group]
        writer.commit_table(read_parts([str(join(owner.output_dir, r.part)) for r in merged]))
        # NOTE: the new part counts from here; the old ones stop counting when their records go, then they go
        for record in merged:
            remove(str(join(owner.output_dir, record.name)))
        for record in merged:
            remove(str(join(owner.output_dir, record.part)))
    after = len(records) - sum(len(g) for g in groups) + len(groups)
    return Compaction(len(records), after, len(groups))


def _compact_directory(owner: Checkpoint, shards: list[Shard], target: int) -> Compaction:
    before = after = written = 0
    for shard in shards:
        # NOTE: an unsharded output's parts are shard 0/1's; a sharded output's parts are named for their shard
        parts = [p for p in committed_parts(owner.output_dir) if part_shard(PART_RE.match(p.name)) == shard]
        groups = groups_by_size([p.stat().st_size for p in parts], target)
        number = PartWriter(owner.output_dir, shard=shard).next_part
        for group in groups:
            path = Path(owner.output_dir) / part_name(number, shard)
            table = read_parts([parts[i] for i in group])
            write_file(path, lambda f, table=table: pq.write_table(table, f))
            number += 1
            for i in group:
                parts[i].unlink()
        before += len(parts)
        after += len(parts) - sum(len(g) for g in groups) + len(groups)
        written += len(groups)
    return Compaction(before, after, written)
