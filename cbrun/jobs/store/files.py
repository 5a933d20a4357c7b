"""Where cbrun's files live: local paths and object-store URIs, and the one way cbrun writes a file.

Any path cbrun reads or writes (input, output, model) may be a plain path, a ``file://`` URI, or an object-store
URI: ``s3://bucket/key`` or ``gs://bucket/key`` (the extra ``cbrun[cloud]``: fsspec's ``s3fs`` / ``gcsfs``).
Credentials come from each store's standard environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``, ``AWS_ENDPOINT_URL``; Google's application default credentials). The endpoint is passed to the
client explicitly (``AWS_ENDPOINT_URL``, or the manifest's ``[storage] endpoint_url``, which wins), so a MinIO or
other S3-compatible server works the same.

``write_file`` is the only way cbrun writes a file: locally a temporary file in the same directory, fsynced,
renamed over the target, then the directory fsynced; on an object store one PUT (an object appears whole or not
at all). A reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import posixpath
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

logger = logging.getLogger("cbrun")

#: URI schemes read through fsspec (object stores); ``file://`` is a local path.
OBJECT_SCHEMES = ("s3", "gs", "gcs")
#: Retries of one object-store call on a transient error (5xx, a dropped connection), with exponential backoff.
NUM_RETRIES = 6
RETRY_BASE_S = 0.25

T = TypeVar("T")


class StorageError(RuntimeError):
    """An object-store call failed after its retries; the message names the object and the cause."""


class PreconditionFailed(Exception):
    """A conditional write found the object in another state (it exists, or its ETag changed)."""


def is_uri(path: str | Path) -> bool:
    """Whether ``path`` names an object in an object store (``s3://``, ``gs://``), not a local file."""
    return isinstance(path, str) and path.split("://", 1)[0].lower() in OBJECT_SCHEMES and "://" in path


def local_path(path: str | Path) -> str | Path:
    """``path`` with a ``file://`` scheme removed; any other path unchanged."""
    if isinstance(path, str) and path.startswith("file://"):
        return path[len("file://") :]
    return path


def join(base: str | Path, *names: str) -> str | Path:
    """``base / name / ...`` for a local path or a URI (whose ``//`` a ``Path`` would collapse)."""
    if is_uri(base):
        return posixpath.join(str(base).rstrip("/"), *names)
    return Path(local_path(base)).joinpath(*names)


def basename(path: str | Path) -> str:
    return posixpath.basename(str(path).rstrip("/"))


def filesystem(uri: str, endpoint_url: str | None = None) -> tuple[Any, str]:
    """The fsspec filesystem of an object-store URI and the URI's path within it (``bucket/key``).

    Args:
        uri: an object-store URI.
        endpoint_url: the S3 endpoint (the manifest's ``[storage] endpoint_url``, passed by whoever holds the
            path: a ``FsspecStore``, the input's reader, the model's source); None: the environment's.

    Raises:
        ImportError: naming the extra to install when the store's fsspec package is missing.
    """
    scheme, _, rest = uri.partition("://")
    scheme = scheme.lower()
    try:
        import fsspec
    except ImportError:
        raise ImportError(f"{uri!r} needs the object-store extra: pip install 'cbrun[cloud]'") from None
    options: dict[str, Any] = {}
    if scheme == "s3":
        # NOTE: passed explicitly: not every client reads AWS_ENDPOINT_URL (pyarrow's does not, arrow #49643)
        endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        client_kwargs = {}
        if endpoint:
            client_kwargs["endpoint_url"] = endpoint
        if os.environ.get("AWS_REGION"):
            client_kwargs["region_name"] = os.environ["AWS_REGION"]
        options = {"client_kwargs": client_kwargs}
    try:
        fs = fsspec.filesystem("gcs" if scheme == "gs" else scheme, **options)
    except ImportError as exc:
        raise ImportError(f"{uri!r} needs the object-store extra: pip install 'cbrun[cloud]' ({exc})") from None
    return fs, rest


def retried(what: str, call: Callable[[], T]) -> T:
    """``call()``, retried with exponential backoff on transient errors (anything but a missing object or a failed
    precondition), ``NUM_RETRIES`` times.

    Raises:
        StorageError: naming ``what`` and the last error, when every try failed.
        FileNotFoundError, PreconditionFailed: at once (they are answers, not faults).
    """
    for attempt in range(NUM_RETRIES + 1):
        try:
            return call()
        except (FileNotFoundError, PreconditionFailed):
            raise
        except Exception as exc:  # NOTE: the store's client raises many types; all are retried
            if _is_precondition_failure(exc):
                raise PreconditionFailed(str(exc)) from None
            if attempt == NUM_RETRIES:
                raise StorageError(f"{what} failed after {NUM_RETRIES + 1} tries: {type(exc).__name__}: {exc}") from exc
            delay = RETRY_BASE_S * 2**attempt * (0.5 + random.random())
            logger.warning("cbrun: %s failed (%s: %s); retrying in %.1f s", what, type(exc).__name__, exc, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def _is_precondition_failure(exc: BaseException) -> bool:
    if isinstance(exc, FileExistsError):  # NOTE: s3fs's translation of HTTP 412
        return True
    text = f"{type(exc).__name__} {exc}"
    return "PreconditionFailed" in text or "412" in text.split("(")[0] or "ConditionalRequestConflict" in text


def write_file(path: str | Path, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Write a whole file atomically: ``data`` (bytes, or a function that writes to a binary file).

    Local: a hidden temporary file beside ``path``, flushed and fsynced, ``os.replace``d over it, then the
    directory fsynced, so a crash leaves the old file or the new one. Object store: one PUT of the whole body.

    Raises:
        StorageError: for an object-store write that failed after its retries.
        OSError: for a local write that failed.
    """
    if is_uri(path):
        body = data if isinstance(data, bytes) else _to_bytes(data)
        put_object(str(path), body)
        return
    path = Path(local_path(path))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            if isinstance(data, bytes):
                f.write(data)
            else:
                data(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json(path: str | Path, value: Any) -> None:
    """``value`` as indented JSON, written with ``write_file``."""
    write_file(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def fsync_dir(directory: str | Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _to_bytes(write: Callable[[BinaryIO], None]) -> bytes:
    buffer = io.BytesIO()
    write(buffer)
    return buffer.getvalue()


def read_file(path: str | Path, endpoint_url: str | None = None) -> bytes | None:
    """A whole file's bytes; None when it does not exist."""
    if is_uri(path):
        fs, key = filesystem(str(path), endpoint_url)
        try:
            return retried(f"reading {path}", lambda: fs.cat_file(key))
        except FileNotFoundError:
            return None
    path = Path(local_path(path))
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def read_files(uris: list[str]) -> dict[str, bytes]:
    """The bytes of many objects of one store, fetched concurrently (fsspec's async ``cat``), by URI; missing
    ones are left out."""
    if not uris:
        return {}
    fs, _ = filesystem(uris[0])
    scheme = uris[0].split("://", 1)[0]
    keys = [filesystem(uri)[1] for uri in uris]
    found = retried(
        f"reading {len(uris)} objects of {uris[0].rsplit('/', 1)[0]}", lambda: fs.cat(keys, on_error="omit")
    )
    return {f"{scheme}://{key.removeprefix(scheme + '://')}": data for key, data in found.items()}


def read_json(path: str | Path) -> Any:
    """A JSON file's value; None when it does not exist."""
    data = read_file(path)
    return None if data is None else json.loads(data)


def exists(path: str | Path) -> bool:
    if is_uri(path):
        fs, key = filesystem(str(path))
        return retried(f"looking up {path}", lambda: fs.exists(key))
    return Path(local_path(path)).exists()


def remove(path: str | Path) -> None:
    """Delete a file; a missing one is no error."""
    if is_uri(path):
        fs, key = filesystem(str(path))
        try:
            retried(f"deleting {path}", lambda: fs.rm_file(key))
        except FileNotFoundError:
            pass
        fs.invalidate_cache(key)
        return
    Path(local_path(path)).unlink(missing_ok=True)


def put_object(
    uri: str, body: bytes, *, create_only: bool = False, if_match: str | None = None, fs: Any = None
) -> str | None:
    """One PUT of a whole object; returns its new ETag when the store says it.

    Args:
        fs: the filesystem to PUT through (a ``cbrun.jobs.store.store.FsspecStore``'s, with its endpoint); None:
            ``filesystem(uri)``'s.
        create_only: fail when the object exists (S3's ``If-None-Match: *``).
        if_match: fail unless the object's ETag is this one (S3's ``If-Match``).

    Raises:
        PreconditionFailed: when a condition does not hold.
        StorageError: when the PUT failed after its retries.
    """
    if fs is None:
        fs, key = filesystem(uri)
    else:
        key = uri.partition("://")[2]
    if uri.lower().startswith("s3://") and hasattr(fs, "call_s3"):
        bucket, _, name = key.partition("/")
        conditions = {}
        if create_only:
            conditions["IfNoneMatch"] = "*"
        if if_match is not None:
            conditions["IfMatch"] = if_match
        reply = retried(
            f"writing {uri}", lambda: fs.call_s3("put_object", Bucket=bucket, Key=name, Body=body, **conditions)
        )
        fs.invalidate_cache(key)
        return reply.get("ETag")
    # NOTE: other stores through fsspec: create-only where the store offers it, no ETag condition (see jobs.output.lease)
    retried(f"writing {uri}", lambda: fs.pipe_file(key, body, **({"mode": "create"} if create_only else {})))
    fs.invalidate_cache(key)
    return None


def object_info(uri: str, endpoint_url: str | None = None) -> dict[str, Any] | None:
    """The store's metadata of one object (``size``, ``ETag`` where it has one, ...); None when it does not exist."""
    fs, key = filesystem(uri, endpoint_url)
    fs.invalidate_cache(key)
    try:
        return retried(f"looking up {uri}", lambda: fs.info(key))
    except FileNotFoundError:
        return None


def list_files(uri: str, endpoint_url: str | None = None) -> list[str]:
    """The URIs of every object under ``uri`` (a folder: recursively), sorted; [] when there is none."""
    fs, key = filesystem(uri, endpoint_url)
    scheme = uri.split("://", 1)[0]
    root = key.rstrip("/")
    fs.invalidate_cache(root)
    found = retried(f"listing {uri}", lambda: fs.find(root))
    return sorted(f"{scheme}://{k}" for k in found)


def open_input(path: str | Path, endpoint_url: str | None = None):
    """A seekable binary file for reading (an object is read by ranges, as the reader asks)."""
    if is_uri(path):
        fs, key = filesystem(str(path), endpoint_url)
        return retried(f"opening {path}", lambda: fs.open(key, "rb"))
    return open(local_path(path), "rb")


def object_digest(uri: str, tail: int = 0, endpoint_url: str | None = None) -> str:
    """sha256 of an object's size, ETag (else its modification time) and its last ``tail`` bytes (a Parquet
    footer: ``parquet_footer_size``); the fingerprint of an object without reading it."""
    info = object_info(uri, endpoint_url)
    if info is None:
        raise FileNotFoundError(uri)
    size = int(info.get("size") or 0)
    tag = (
        info.get("ETag")
        or info.get("etag")
        or info.get("md5Hash")
        or str(info.get("LastModified") or info.get("mtime") or "")
    )
    digest = hashlib.sha256(f"{size}\0{tag}\0".encode())
    if tail and size:
        fs, key = filesystem(uri, endpoint_url)
        digest.update(retried(f"reading {uri}", lambda: fs.cat_file(key, start=max(size - tail, 0), end=size)))
    return digest.hexdigest()


def parquet_footer_size(uri: str, endpoint_url: str | None = None) -> int:
    """How many bytes at the end of a Parquet object hold its footer (with length and magic); 0 when not Parquet."""
    info = object_info(uri, endpoint_url)
    size = int(info.get("size") or 0) if info else 0
    if size < 12:
        return 0
    fs, key = filesystem(uri, endpoint_url)
    tail = retried(f"reading {uri}", lambda: fs.cat_file(key, start=size - 8, end=size))
    if tail[4:] != b"PAR1":
        return 0
    return min(int.from_bytes(tail[:4], "little") + 8, size)
