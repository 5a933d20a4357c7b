"""Local copies of objects: a model given as a URI, downloaded once into a cache, and JSON Lines inputs.

The cache lives in ``$CBRUN_CACHE`` (default ``~/.cache/cbrun``): ``models/<hash of the URI>/`` holds a model's
files, ``objects/`` single objects. A copy is keyed by the objects' sizes and ETags, so a changed object is
downloaded again; a download is made under a temporary name and renamed into place, so an interrupted one is never
used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from cbrun.jobs.store.files import (
    basename,
    filesystem,
    is_uri,
    list_files,
    local_path,
    object_info,
    read_file,
    retried,
    write_file,
)

logger = logging.getLogger("cbrun")


def local_copy(uri: str, endpoint_url: str | None = None) -> Path:
    """A local copy of one object, in ``$CBRUN_CACHE/objects`` keyed by its URI, size and ETag (downloaded once).

    Raises:
        StorageError: when the download failed after its retries.
    """
    root = os.environ.get("CBRUN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "cbrun")
    key = hashlib.sha256(json.dumps([uri, _object_tag(uri, endpoint_url)]).encode()).hexdigest()[:24]
    target = Path(root) / "objects" / f"{key}-{basename(uri)}"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        data = read_file(uri, endpoint_url)
        if data is None:
            raise FileNotFoundError(uri)
        write_file(target, data)
    return target


def model_cache_dir() -> Path:
    """Where models given as URIs are downloaded: ``$CBRUN_CACHE/models`` (default ``~/.cache/cbrun/models``)."""
    root = os.environ.get("CBRUN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "cbrun")
    return Path(root) / "models"


def local_model(path: str, endpoint_url: str | None = None) -> str:
    """A model directory on local disk: ``path`` itself, or a URI's copy downloaded into ``model_cache_dir()``.

    The copy is refreshed when an object's size or ETag changed since it was downloaded (a ``.cbrun-source.json``
    in the copy records them); a download is made in a temporary folder and renamed into place, so an interrupted
    one is never used.

    Raises:
        FileNotFoundError: when the URI holds no objects.
        StorageError: when a download failed after its retries.
    """
    if not is_uri(path):
        return str(local_path(path))
    objects = list_files(path, endpoint_url)
    if not objects:
        raise FileNotFoundError(f"model {path!r} holds no files")
    root = path.rstrip("/")
    source = {uri[len(root) + 1 :]: _object_tag(uri, endpoint_url) for uri in objects}
    target = model_cache_dir() / hashlib.sha256(root.encode()).hexdigest()[:16]
    marker = target / ".cbrun-source.json"
    if marker.is_file() and json.loads(marker.read_text()) == {"uri": root, "objects": source}:
        return str(target)
    logger.info("cbrun: downloading the model %s to %s", root, target)
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fs, _ = filesystem(path, endpoint_url)
    for name in source:
        destination = staging / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        key = filesystem(f"{root}/{name}", endpoint_url)[1]
        retried(f"downloading {root}/{name}", lambda key=key, to=str(destination): fs.get_file(key, to))
    (staging / marker.name).write_text(json.dumps({"uri": root, "objects": source}))
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staging, target)
    return str(target)


def _object_tag(uri: str, endpoint_url: str | None = None) -> list:
    info = object_info(uri, endpoint_url) or {}
    return [int(info.get("size") or 0), str(info.get("ETag") or info.get("mtime") or "")]
