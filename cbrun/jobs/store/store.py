"""One file API over a local directory and an object-store prefix: the ``Store`` an output owner writes through.

A path is classified once, by ``open_store``, where it enters; the store's users name files relative to its root
("_cbrun/stats.json") and never ask whether the root is a URI (datatrove's ``DataFolder`` is the model: an fsspec
``DirFileSystem`` over any root). The object store's endpoint is held by the store that talks to it.

Both stores give the same guarantees: a reader never sees half a file (``write_atomic``), and of two writers of
one name with ``put_if_absent`` exactly one wins.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from cbrun.jobs.store import files as storage


class Store(Protocol):
    """Files under one root, named by ``/``-separated paths relative to it."""

    #: The root as given (a local path or a URI), for messages and for readers that take a path (pyarrow).
    root: str

    def path(self, name: str) -> str:
        """Where ``name`` lives: a local path or a URI."""
        ...

    def read(self, name: str) -> bytes | None:
        """The file's bytes; None when it does not exist."""
        ...

    def write_atomic(self, name: str, data: bytes) -> None:
        """Write the whole file, replacing any old one; a reader sees the old bytes or the new, never a mix."""
        ...

    def put_if_absent(self, name: str, data: bytes) -> bool:
        """Create the file with ``data`` unless it exists; True when this call created it."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """The names of every file under ``prefix`` (a folder, recursively), sorted; [] when there is none."""
        ...

    def delete(self, name: str) -> None:
        """Remove the file; a missing one is no error."""
        ...

    def append(self, name: str, data: bytes) -> None:
        """Add ``data`` at the end of the file (created when missing), for a log only one writer holds."""
        ...


class LocalStore:
    """A ``Store`` over a local directory (created on the first write).

    ``write_atomic`` is ``cbrun.jobs.store.files.write_file`` (temporary file, fsync, rename, directory fsync);
    ``put_if_absent`` writes a temporary file (fsynced, named as ``write_file``'s) and hard-links it to the name, which fails when the name exists: the file appears whole or not
    at all.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = str(storage.local_path(root))
        self._root = Path(self.root)

    def path(self, name: str) -> str:
        return str(self._root / name)

    def read(self, name: str) -> bytes | None:
        try:
            return (self._root / name).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write_atomic(self, name: str, data: bytes) -> None:
        target = self._root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        storage.write_file(target, data)

    def put_if_absent(self, name: str, data: bytes) -> bool:
        target = self._root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        storage.fsync_dir(target.parent)
        return True

    def list(self, prefix: str = "") -> list[str]:
        base = self._root / prefix if prefix else self._root
        if base.is_file():
            return [prefix]
        if not base.is_dir():
            return []
        return sorted(p.relative_to(self._root).as_posix() for p in base.rglob("*") if p.is_file())

    def delete(self, name: str) -> None:
        (self._root / name).unlink(missing_ok=True)

    def append(self, name: str, data: bytes) -> None:
        target = self._root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


class FsspecStore:
    """A ``Store`` over an object-store prefix (``s3://bucket/prefix``, ``gs://...``) through fsspec.

    Every write is one PUT of the whole object (an object appears whole or not at all); ``put_if_absent`` is S3's
    ``If-None-Match: *`` (``cbrun.jobs.store.files.put_object``). Calls are retried on transient errors
    (``cbrun.jobs.store.files.retried``). ``append`` reads the object and writes it back whole: object stores have no
    append, so it is for a log that only one writer (the lease holder) writes.

    Args:
        root: the prefix's URI.
        endpoint_url: the S3 endpoint (a MinIO or other S3-compatible server); None: the environment's
            (``AWS_ENDPOINT_URL``).
    """

    def __init__(self, root: str, endpoint_url: str | None = None) -> None:
        self.root = root.rstrip("/")
        self.endpoint_url = endpoint_url
        self._fs, self._key = storage.filesystem(self.root, endpoint_url=endpoint_url)
        self._scheme = self.root.split("://", 1)[0]

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _key_of(self, name: str) -> str:
        return f"{self._key.rstrip('/')}/{name}"

    def read(self, name: str) -> bytes | None:
        key = self._key_of(name)
        try:
            data: bytes = storage.retried(f"reading {self.path(name)}", lambda: self._fs.cat_file(key))
        except FileNotFoundError:
            return None
        return data

    def write_atomic(self, name: str, data: bytes) -> None:
        storage.put_object(self.path(name), data, fs=self._fs)

    def put_if_absent(self, name: str, data: bytes) -> bool:
        try:
            storage.put_object(self.path(name), data, create_only=True, fs=self._fs)
        except storage.PreconditionFailed:
            return False
        return True

    def list(self, prefix: str = "") -> list[str]:
        base = self._key_of(prefix).rstrip("/") if prefix else self._key.rstrip("/")
        self._fs.invalidate_cache(base)
        found: list[str] = storage.retried(f"listing {self.path(prefix)}", lambda: self._fs.find(base))
        root = self._key.rstrip("/") + "/"
        return sorted(k.removeprefix(f"{self._scheme}://").removeprefix(root) for k in found)

    def delete(self, name: str) -> None:
        key = self._key_of(name)
        try:
            storage.retried(f"deleting {self.path(name)}", lambda: self._fs.rm_file(key))
        except FileNotFoundError:
            pass
        self._fs.invalidate_cache(key)

    def append(self, name: str, data: bytes) -> None:
        self.write_atomic(name, (self.read(name) or b"") + data)

    # ---- what the object-store commit protocol needs beyond ``Store`` (``cbrun.jobs.output.object_parts``) ----
    def put(self, name: str, data: bytes, *, create_only: bool = False, if_match: str | None = None) -> str | None:
        """One conditional PUT (``cbrun.jobs.store.files.put_object``); returns the new ETag when the store says it.

        Raises:
            PreconditionFailed: when the condition does not hold.
        """
        return storage.put_object(self.path(name), data, create_only=create_only, if_match=if_match, fs=self._fs)

    def info(self, name: str) -> dict[str, Any] | None:
        """The object's metadata (``size``, ``ETag``, ...); None when it does not exist."""
        key = self._key_of(name)
        self._fs.invalidate_cache(key)
        try:
            info: dict[str, Any] = storage.retried(f"looking up {self.path(name)}", lambda: self._fs.info(key))
        except FileNotFoundError:
            return None
        return info

    def open(self, name: str) -> Any:
        """A seekable binary file over the object (read by ranges, as the reader asks)."""
        key = self._key_of(name)
        return storage.retried(f"opening {self.path(name)}", lambda: self._fs.open(key, "rb"))

    def read_many(self, names: Sequence[str]) -> dict[str, bytes]:
        """The bytes of many objects, fetched concurrently (fsspec's async ``cat``), by name; missing ones left out."""
        if not names:
            return {}
        keys = {self._key_of(name): name for name in names}
        found = storage.retried(
            f"reading {len(names)} objects of {self.root}", lambda: self._fs.cat(list(keys), on_error="omit")
        )
        by_key = {key.removeprefix(f"{self._scheme}://"): data for key, data in found.items()}
        return {keys[key]: data for key, data in by_key.items() if key in keys}


def open_store(root: str | Path, endpoint_url: str | None = None) -> LocalStore | FsspecStore:
    """The store of ``root``: the one place a path is classified (``cbrun.jobs.store.files.is_uri``).

    Args:
        root: a local directory, a ``file://`` URI, or an object-store URI.
        endpoint_url: the S3 endpoint an object store talks to (the manifest's ``[storage] endpoint_url``).

    Raises:
        ImportError: naming the extra to install when the object store's fsspec package is missing.
    """
    if storage.is_uri(root):
        return FsspecStore(str(root), endpoint_url)
    return LocalStore(root)


def read_json(store: Store, name: str) -> Any:
    """A JSON file's value; None when it does not exist."""
    data = store.read(name)
    return None if data is None else json.loads(data)


def write_json(store: Store, name: str, value: Any) -> None:
    """``value`` as indented, key-sorted JSON, written atomically (the same bytes as ``storage.write_json``)."""
    store.write_atomic(name, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())
