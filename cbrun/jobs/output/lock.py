"""One writer per output: an exclusive OS lock (``fcntl.flock``) on a shard's share of an output directory.

A run takes the lock before it reads what is done and holds it until it exits, whatever the exit. The kernel drops
a ``flock`` when its process dies (a crash, ``kill -9``, a power cut), so a dead run's lock never blocks the next
one; the lock file stays behind and names its last holder. A second run into the same output finds the lock held
and stops with the holder's host, pid and start time.

Shards: the lock is per shard, ``_cbrun/lock-<index>-of-<count>``, so that a sharded run (many processes, one
output directory, each writing only its own rows) can lock each share on its own. A plain run is shard ``0/1``,
the whole output. Steps that touch the whole directory (``--overwrite``, ``_SUCCESS``) belong to a process holding
every shard's lock.

NOTE: ``flock`` locks are advisory (they exclude cbrun runs, not other programs) and on NFS they work only where
the client maps them to NFS locks (Linux does since 2.6.12); on other network file systems one host cannot see
another host's lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

#: cbrun's own folder in an output directory (data readers skip names starting with "_").
CBRUN_DIR = "_cbrun"


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (0-based); ``Shard()`` is the whole job."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard must be INDEX/COUNT with 0 <= INDEX < COUNT, got {self}")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def lock_name(self) -> str:
        return f"lock-{self.index}-of-{self.count}"

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"I/N"`` (as ``--shard`` and ``input.shard`` take it) as a ``Shard``.

        Raises:
            ValueError: when it is not two integers ``I/N`` with ``0 <= I < N``.
        """
        index, slash, count = str(text).partition("/")
        try:
            if not slash:
                raise ValueError
            shard = cls(int(index), int(count))
        except ValueError:
            raise ValueError(
                f"input.shard (--shard) must be INDEX/COUNT with 0 <= INDEX < COUNT (e.g. 3/8, as in "
                f"$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT), got {text!r}"
            ) from None
        return shard


class OutputLocked(RuntimeError):
    """Another live process holds the lock; the message names it."""


class OutputLock:
    """An exclusive, non-blocking ``flock`` on one shard of an output directory, held as a context manager.

    Args:
        output_dir: the output directory; it and its ``_cbrun/`` folder are created when missing.
        shard: which share of the output this process writes.

    Raises:
        OutputLocked: from ``acquire`` (or ``with``), when another process holds the lock.
        OSError: when the directory or the lock file cannot be created.
    """

    def __init__(self, output_dir: str | Path, shard: Shard = Shard()):
        self.path = Path(output_dir) / CBRUN_DIR / shard.lock_name
        self.shard = shard
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        assert self._fd is None, "lock already held"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise OutputLocked(
                f"output directory {str(self.path.parent.parent)!r} is in use by another cbrun run "
                f"({holder}, shard {self.shard}); wait for it to end, or stop it, then rerun "
                f"(lock file: {self.path})"
            ) from None
        # NOTE: the holder's identity is for messages only; the flock itself is the lock.
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "shard": str(self.shard),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (closing the file drops the flock); a no-op when not held."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        record = {}
    return describe_holder(record if isinstance(record, dict) else {})


def describe_holder(record: dict) -> str:
    """A lock file's holder record in words ("host H, pid P, started T")."""
    if not record:
        return "holder unknown"
    return f"host {record.get('host')}, pid {record.get('pid')}, started {record.get('started')}"


class DirectoryLock:
    """A short, blocking, exclusive ``flock`` over the steps of a sharded run that touch the whole output directory
    (clearing it for ``--overwrite``, job.json, removing duplicates, writing ``_SUCCESS``): the shards of one output
    take turns at them. Held as a context manager; the kernel drops it when the process dies.

    Args:
        output_dir: the output directory; it and its ``_cbrun/`` folder are created when missing.
    """

    NAME = "lock-directory"

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / CBRUN_DIR / self.NAME
        self._fd: int | None = None

    def __enter__(self) -> DirectoryLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)  # NOTE: blocking: the steps it guards take a fraction of a second
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def held_locks(output_dir: str | Path) -> dict[str, dict] | None:
    """The shard locks of ``output_dir`` that a live process holds now, without taking any lock.

    Read from Linux's ``/proc/locks`` (every ``flock`` on this host, by device and inode), so a ``cbrun status``
    run next to a job can never make that job's lock attempt fail, as probing with ``flock`` itself could.

    Returns:
        ``{"I/N": holder record}`` (the record the holder wrote: host, pid, shard, started; ``{}`` when unreadable)
        for each held shard lock, or None when this host has no ``/proc/locks`` (other systems, or a lock held on
        another NFS client, cannot be seen from here).
    """
    try:
        with open("/proc/locks") as f:
            held = {
                _lock_key(fields) for fields in (line.split() for line in f) if len(fields) > 5 and fields[1] == "FLOCK"
            }
    except OSError:
        return None
    found: dict[str, dict] = {}
    for path in sorted((Path(output_dir) / CBRUN_DIR).glob("lock-*-of-*")):
        try:
            st = path.stat()
        except OSError:
            continue
        if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in held:
            index, _, count = path.name.removeprefix("lock-").partition("-of-")
            found[f"{index}/{count}"] = _read_record(path)
    return found


def _lock_key(fields: list[str]) -> tuple[int, int, int] | None:
    """(major, minor, inode) of a held lock's ``/proc/locks`` line, split into fields: ``N: FLOCK ADVISORY WRITE
    PID MAJOR:MINOR:INODE START END``, major and minor in hex. (Waiters' lines read ``N: -> FLOCK ...``; the caller
    leaves them out.)"""
    try:
        major, minor, inode = fields[5].split(":")
        return int(major, 16), int(minor, 16), int(inode)
    except ValueError:
        return None


def _read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
