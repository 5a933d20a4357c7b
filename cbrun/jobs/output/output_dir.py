"""cbrun's own files of an output, the same on a local directory and on an object store, over its ``Store``.

The files: ``_cbrun/job.json`` (the job's fingerprint), ``_cbrun/stats.json`` (the finished job's summary), the
empty ``_SUCCESS`` marker, and cbrun's other JSON files ``_cbrun/<name>`` (``write_meta``). An older cbrun wrote
job.json and stats.json beside the parts; they are read there too, and removed with the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cbrun.jobs.output.lock import CBRUN_DIR
from cbrun.jobs.store.store import Store, read_json, write_json

JOB_FILE = "job.json"
SUCCESS_FILE = "_SUCCESS"
STATS_FILE = "stats.json"


class OutputDir:
    """The owner of an output's job file, finished marker, stats and metadata files, over ``store``.

    ``Checkpoint`` (a local directory) and ``ObjectCheckpoint`` (an object-store prefix) are this with their parts
    and their lock; neither asks where the files live.

    Args:
        store: the output's files (``cbrun.jobs.store.store.open_store``).
        local_dir: the local directory ``store`` is over, or None for an object store.
    """

    def __init__(self, store: Store, local_dir: Path | None) -> None:
        self.store = store
        #: The output's local directory; None on an object store (where each writer commits its own parts and
        #: nothing is recorded beside them on this machine).
        self.local_dir = local_dir

    def read_job_file(self) -> dict[str, Any] | None:
        """The recorded fingerprint (``_cbrun/job.json``, else an older cbrun's ``job.json``); None when none."""
        for name in (f"{CBRUN_DIR}/{JOB_FILE}", JOB_FILE):
            value = read_json(self.store, name)
            if value is not None:
                return dict(value)
        return None

    def write_job_file(self, fingerprint: dict[str, Any]) -> None:
        write_json(self.store, f"{CBRUN_DIR}/{JOB_FILE}", fingerprint)

    def write_meta(self, name: str, value: dict[str, Any]) -> None:
        """Write cbrun's own JSON file ``_cbrun/<name>`` (the split of the rows, a shard's summary, ...)."""
        write_json(self.store, f"{CBRUN_DIR}/{name}", value)

    def read_meta(self, name: str) -> dict[str, Any] | None:
        """cbrun's own JSON file ``_cbrun/<name>``; None when it is absent."""
        value = read_json(self.store, f"{CBRUN_DIR}/{name}")
        return None if value is None else dict(value)

    def is_finished(self) -> bool:
        return self.store.read(SUCCESS_FILE) is not None

    def clear_finished(self) -> None:
        """Remove the finished marker and the stats (an older cbrun's too)."""
        for name in (SUCCESS_FILE, f"{CBRUN_DIR}/{STATS_FILE}", STATS_FILE):
            self.store.delete(name)

    def write_finished(self, stats: dict[str, Any]) -> None:
        """Write stats.json, then the empty _SUCCESS marker (a reader that sees the marker finds the stats)."""
        write_json(self.store, f"{CBRUN_DIR}/{STATS_FILE}", stats)
        self.store.write_atomic(SUCCESS_FILE, b"")

    def read_stats(self) -> dict[str, Any] | None:
        """The finished job's stats (an older cbrun's beside the parts); None when absent."""
        for name in (f"{CBRUN_DIR}/{STATS_FILE}", STATS_FILE):
            value = read_json(self.store, name)
            if value is not None:
                return dict(value)
        return None
