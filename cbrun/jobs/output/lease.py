"""One writer per object-store output: a lease object with an expiry, taken and renewed by conditional writes.

An object store has no ``flock``. A run takes ``OUT/_cbrun/lease-<index>-of-<count>.json`` with a create-only PUT
(S3's ``If-None-Match: *``); the object names the holder (host, pid, start) and when the lease expires. A thread
renews it every ``ttl_s / 3`` with a PUT conditional on the ETag it last wrote (``If-Match``), so a run that dies
stops renewing and its lease expires ``ttl_s`` later. A second run finds an unexpired lease and stops with exit 2
naming the holder; one that finds an expired lease, or one whose holder ran on this host and is gone (a killed
run), takes it over with the same conditional PUT (of two runs racing for it, one wins). Before each commit the writer checks that the lease is still held (``check``).

What it cannot prevent:
  - a holder paused longer than ``ttl_s`` (SIGSTOP, a VM migration, a network partition) that then finishes one
    commit before it notices that its lease was taken over: its part and record carry its own attempt's unique
    names, so nothing is overwritten, but its rows may then be committed twice; the next run's open keeps each
    row's earliest copy and removes the later one;
  - clocks that disagree by more than ``ttl_s``: expiry is judged on the reading host's clock;
  - a store without conditional writes (fsspec stores other than S3 fall back to create-only, or to plain PUTs):
    two runs started at the same instant may both take the lease.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

from cbrun.jobs.output.lock import CBRUN_DIR, OutputLocked, Shard, describe_holder
from cbrun.jobs.store.files import PreconditionFailed, StorageError
from cbrun.jobs.store.store import FsspecStore

logger = logging.getLogger("cbrun")

#: Seconds a lease lasts without renewal.
DEFAULT_TTL_S = 60.0


class LeaseLost(RuntimeError):
    """This run's lease expired or was taken over: it must stop writing."""


class Lease:
    """An exclusive, expiring lease on one shard of an object-store output, held as a context manager.

    Args:
        store: the output's store (it holds the endpoint).
        shard: which share of the output this process writes.
        ttl_s: seconds the lease lasts without renewal; it is renewed every ``ttl_s / 3``.

    Raises:
        OutputLocked: from ``acquire``, when another run holds an unexpired lease.
        StorageError: when the store cannot be reached.
    """

    def __init__(self, store: FsspecStore, shard: Shard = Shard(), ttl_s: float = DEFAULT_TTL_S):
        self.store = store
        self.name = f"{CBRUN_DIR}/lease-{shard.index}-of-{shard.count}.json"
        self.uri = store.path(self.name)
        self.shard = shard
        self.ttl_s = ttl_s
        self.token = os.urandom(8).hex()
        self._etag: str | None = None
        self._expires = 0.0
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._thread is not None

    def _record(self) -> tuple[bytes, float]:
        expires = time.time() + self.ttl_s
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "shard": str(self.shard),
            "token": self.token,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "expires": expires,
        }
        return json.dumps(record).encode(), expires

    def acquire(self) -> None:
        assert not self.held, "lease already held"
        body, expires = self._record()
        try:
            self._etag = self.store.put(self.name, body, create_only=True)
        except PreconditionFailed:
            self._take_over(body)
        self._expires = expires
        self._thread = threading.Thread(target=self._renew_loop, name="cbrun-lease", daemon=True)
        self._thread.start()

    def _take_over(self, body: bytes) -> None:
        info = self.store.info(self.name)
        current = read_holder(self.store, self.name)
        if info is not None and current.get("expires", 0) > time.time() and not _holder_died_here(current):
            left = current["expires"] - time.time()
            raise OutputLocked(
                f"output {self.uri.rsplit('/_cbrun/', 1)[0]!r} is in use by another cbrun run "
                f"({describe_holder(current)}, shard {self.shard}; its lease expires in {left:.0f} s "
                f"unless renewed); wait for it to end, or stop it, then rerun (lease: {self.uri})"
            )
        try:
            if info is None:
                self._etag = self.store.put(self.name, body, create_only=True)
            else:
                self._etag = self.store.put(self.name, body, if_match=info.get("ETag"))
        except PreconditionFailed:
            raise OutputLocked(
                f"output {self.uri.rsplit('/_cbrun/', 1)[0]!r}: another cbrun run took its expired "
                f"lease first (shard {self.shard}); rerun once it ends"
            ) from None
        if current:
            logger.warning("cbrun: took over the expired lease of %s (%s)", self.uri, describe_holder(current))

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            body, expires = self._record()
            try:
                self._etag = self.store.put(self.name, body, if_match=self._etag)
                self._expires = expires
            except PreconditionFailed:
                self._lost = f"another run took over the lease {self.uri}"
                return
            except StorageError as exc:
                logger.warning("cbrun: could not renew the lease %s: %s", self.uri, exc)

    def check(self) -> None:
        """Raise ``LeaseLost`` unless the lease is held and at least a third of its time is left."""
        if self._lost is not None:
            raise LeaseLost(self._lost)
        if time.time() > self._expires - self.ttl_s / 3:
            raise LeaseLost(f"the lease {self.uri} could not be renewed in time (the store was unreachable)")

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this run's; a no-op when not held."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            if self._lost is None and read_holder(self.store, self.name).get("token") == self.token:
                self.store.delete(self.name)
        except StorageError as exc:  # NOTE: it expires on its own
            logger.warning("cbrun: could not delete the lease %s (it expires in %.0f s): %s", self.uri, self.ttl_s, exc)

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def read_holder(store: FsspecStore, name: str) -> dict:
    """A lease object's record ({} when absent or unreadable)."""
    try:
        record = json.loads(store.read(name) or b"{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _holder_died_here(record: dict) -> bool:
    """Whether the lease's holder ran on this host and its process is gone (killed, crashed): its lease need not
    be waited out. NOTE: a reused pid reads as alive, which only means waiting for the expiry."""
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
