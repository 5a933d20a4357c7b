"""The parts of a local output directory (``LocalParts``, the ``PartLog`` of ``cbrun.jobs.output.output_dir.OutputDir``):
each part is written under a temporary name and renamed into place (``cbrun.jobs.output.writer``), so a part that
exists is committed.

Which rows are done is read back from the committed parts themselves (their ``row_index`` and ``finish_reason``
columns only) into a bitmap of one byte per input row, 100 MB for a 100M-row input; nothing else is kept, so there
is no second record that could disagree with the parts. With ``n`` samples per row, a row is done when its
``row_index`` is in a committed part: the job commits all the samples of a row in the same part
(``PartWriter.add_group``), so a done row always has every sample. A row found in two parts (written by an older
cbrun, or by two runs without a lock) keeps the copy in its earliest part; ``open`` removes the later copies.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cbrun.jobs.output.lock import CBRUN_DIR, OutputLock, Shard, held_locks
from cbrun.jobs.output.part_log import JOB_FILE, STATS_FILE, OutputState, groups_by_size
from cbrun.jobs.output.writer import (
    PART_RE,
    TEMP_RE,
    PartWriter,
    committed_parts,
    conform_table,
    part_name,
    part_shard,
    read_parts,
    write_part_atomically,
)
from cbrun.jobs.store.store import LocalStore

logger = logging.getLogger("cbrun")


class LocalParts:
    """The committed parts of a local output directory: read, rewritten, cleared, compacted; its flock per shard.

    Args:
        store: the output directory's ``LocalStore``.
    """

    what = "part files"

    def __init__(self, store: LocalStore) -> None:
        self.output_dir = Path(store.root)

    def lock(self, shard: Shard) -> OutputLock:
        return OutputLock(self.output_dir, shard)

    def has_parts(self) -> bool:
        return bool(committed_parts(self.output_dir))

    def num_parts(self) -> int:
        return len(committed_parts(self.output_dir))

    def part_files(self) -> Iterator[Path]:
        """The committed parts, in the order they were written."""
        yield from committed_parts(self.output_dir)

    def read_state(self, num_rows: int, within: np.ndarray | None = None) -> OutputState:
        """The done bitmap and error counts of rows 0..num_rows-1, from the parts' row_index and finish_reason."""
        done = np.zeros(num_rows, dtype=bool)
        failed = np.zeros(num_rows, dtype=bool)
        num_output_rows = num_error_rows = 0
        for part in committed_parts(self.output_dir):
            for batch in pq.ParquetFile(part).iter_batches(columns=["row_index", "finish_reason"], batch_size=65536):
                indices = batch.column(0).to_numpy()
                # NOTE: score-mode rows have a null finish_reason: not errors.
                is_error = pc.fill_null(pc.equal(batch.column(1), "error"), False).to_numpy(zero_copy_only=False)
                keep = indices < num_rows
                if within is not None:
                    keep[keep] = within[indices[keep]]
                indices, is_error = indices[keep], is_error[keep]
                done[indices] = True
                failed[indices[is_error]] = True
                num_output_rows += len(indices)
                num_error_rows += int(is_error.sum())
        return OutputState(done, np.flatnonzero(failed), num_output_rows, num_error_rows)

    def remove_duplicates(self) -> int:
        """Keep each row in its earliest part only, rewriting later parts without it; returns copies removed.

        Never happens to a locked run's output; parts written by an older cbrun (an interrupt during a commit) or
        by two runs at once can hold a row twice.
        """
        seen = np.zeros(0, dtype=bool)
        later: dict[Path, np.ndarray] = {}
        for part in committed_parts(self.output_dir):
            indices = np.unique(pq.read_table(part, columns=["row_index"]).column(0).to_numpy())
            if len(indices) and indices[-1] >= len(seen):
                seen = np.concatenate([seen, np.zeros(int(indices[-1]) + 1 - len(seen), dtype=bool)])
            repeated = indices[seen[indices]]
            if len(repeated):
                later[part] = repeated
            seen[indices] = True
        if not later:
            return 0
        removed = sum(self._rewrite_without(part, rows) for part, rows in later.items())
        logger.warning(
            "cbrun: %s held %d rows written more than once (by an older cbrun, or by two runs at once); "
            "kept each row's copy in its earliest part and removed the later copies from %s",
            self.output_dir,
            len(np.unique(np.concatenate(list(later.values())))),
            ", ".join(p.name for p in later),
        )
        return removed

    def remove_rows(self, row_indices: np.ndarray) -> int:
        """Take rows (all their output rows) out of the committed parts; returns the output rows removed."""
        return sum(self._rewrite_without(part, row_indices) for part in committed_parts(self.output_dir))

    def _rewrite_without(self, part: Path, row_indices: np.ndarray) -> int:
        """Rewrite one part without the given rows, atomically (a part left empty is deleted)."""
        table = conform_table(pq.read_table(part))
        drop = pc.is_in(table.column("row_index"), value_set=pa.array(row_indices, pa.int64()))
        if not pc.any(drop).as_py():
            return 0
        kept = table.filter(pc.invert(drop))
        if kept.num_rows:
            write_part_atomically(part, kept)
        else:
            part.unlink()
        return table.num_rows - kept.num_rows

    def writer(
        self, commit_every_rows: int, commit_every_seconds: float, carried_fields: Sequence[pa.Field], lock
    ) -> PartWriter:
        return PartWriter(
            self.output_dir, commit_every_rows, commit_every_seconds, carried_fields=carried_fields, shard=lock.shard
        )

    def clear(self) -> None:
        """Remove every part and half-written part of the directory."""
        for path in self.output_dir.iterdir():
            if PART_RE.match(path.name) or TEMP_RE.match(path.name):
                path.unlink()

    def remove_stray(self, shard: Shard) -> None:
        self.remove_temp_files(shard)

    def recover(self) -> int:
        return self.remove_duplicates()  # NOTE: a part that exists is committed: nothing else to delete

    def remove_temp_files(self, shard: Shard = Shard()) -> list[Path]:
        """Delete the half-written files a killed run left behind; returns them."""
        if not self.output_dir.is_dir():
            return []
        cbrun_dir = self.output_dir / CBRUN_DIR
        # NOTE: a shard of a sharded run removes its own temporary files only: the others may be being written.
        stray = [
            p
            for p in self.output_dir.iterdir()
            if (m := TEMP_RE.match(p.name)) and (shard.count == 1 or part_shard(m) == shard)
        ]
        # NOTE: ``.NAME.tmp`` from older versions, ``.NAME.PID.tmp`` from ``cbrun.jobs.store.files.write_file``
        stray += [
            p
            for d in (self.output_dir, cbrun_dir)
            for name in (JOB_FILE, STATS_FILE)
            for p in d.glob(f".{name}*.tmp")
            if p.is_file()
        ]
        for path in stray:
            path.unlink()
        return stray

    def write_empty_part(self, schema: pa.Schema, shard: Shard) -> None:
        write_part_atomically(self.output_dir / part_name(0, shard), schema.empty_table())

    def settle(self) -> None:
        pass  # NOTE: a locked run's parts hold each row once

    def held_locks(self) -> dict[str, dict] | None:
        return held_locks(self.output_dir)

    def compact(self, shards: list[Shard], target_bytes: int) -> tuple[int, int, int]:
        """Merge each shard's parts into parts of about ``target_bytes``, each written whole and renamed into place
        before the parts it replaces are deleted (a kill between leaves rows twice; ``open`` keeps the first)."""
        before = after = written = 0
        for shard in shards:
            # NOTE: an unsharded output's parts are shard 0/1's; a sharded output's parts are named for their shard
            parts = [p for p in committed_parts(self.output_dir) if _shard_of(p) == shard]
            groups = groups_by_size([p.stat().st_size for p in parts], target_bytes)
            number = PartWriter(self.output_dir, shard=shard).next_part
            for group in groups:
                table = read_parts([parts[i] for i in group])
                assert table is not None
                write_part_atomically(self.output_dir / part_name(number, shard), table)
                number += 1
                for i in group:
                    parts[i].unlink()
            before += len(parts)
            after += len(parts) - sum(len(g) for g in groups) + len(groups)
            written += len(groups)
        return before, after, written


def _shard_of(part: Path) -> Shard:
    """The shard a committed part's name says wrote it (an unsharded output's parts: 0/1)."""
    match = PART_RE.match(part.name)
    assert match is not None, part
    return part_shard(match)
