"""Find the files of an input and say how each is read: by one of ``cbrun.jobs.input.formats`` (Parquet, JSON Lines),
or as a ``datasets`` save_to_disk data set.

An input is one file, a directory of them (searched recursively, in sorted order) or an object-store prefix. A
directory never skips a file silently: names starting with "." or "_" (Spark and Hive's ``_SUCCESS``, ``.crc``) and
``.md`` / ``.rst`` documents are ignored, and any other file that is not a format cbrun reads is refused, naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.formats import InputFormat, format_by_suffix, input_formats, one_of, supported_inputs, titles
from cbrun.jobs.store.files import StorageError, basename, is_uri, list_files, local_path

#: Files of a directory that are documentation, not data: ignored (a Hugging Face data set's README.md).
DOC_SUFFIXES = (".md", ".rst")


def input_file_format(path: Path) -> InputFormat | None:
    """The format one input file is read as (``cbrun.jobs.input.formats``), or None (not a format cbrun reads).

    By name, letter case ignored: the format claiming the name's longest suffix (``.parquet``; ``.jsonl``, ``.json``
    and their ``.gz``), which may look at the bytes and refuse the file (a ``.json`` file that is not JSON Lines).
    A name no format claims is read by the first format whose ``sniff`` knows its bytes (Hive and some Spark
    writers leave Parquet files without a suffix).

    Raises:
        InputError: for a file its suffix's format refuses (a ``.json`` file that holds a JSON document rather
            than JSON Lines, or one that cannot be read).
    """
    fmt = format_by_suffix(path.name)
    if fmt is not None:
        if fmt.check_file is not None:
            fmt.check_file(path)
        return fmt
    return next((f for f in input_formats() if f.sniff is not None and f.sniff(path)), None)


def _is_hidden(relative: Path) -> bool:
    """Spark/Hive's rule: a path part starting with "." or "_" (``_SUCCESS``, ``.part-0.crc``) is not data."""
    return any(part.startswith((".", "_")) for part in relative.parts)


def _is_doc(path: Path) -> bool:
    return path.suffix.lower() in DOC_SUFFIXES


def list_input_files(path: str | Path, endpoint_url: str | None = None) -> tuple[str, list[Path]]:
    """Find the files of an input: one file of a format cbrun reads, a directory of them (mixed or not, searched
    recursively), or a ``save_to_disk`` data set. What a file is read as: ``input_file_format``.

    In a directory, files and folders whose name starts with "." or "_" are ignored, as Spark and Hive do
    (``_SUCCESS``, ``.crc`` files, ``_cbrun/``), and so are ``.md`` / ``.rst`` documents (a data set's README.md);
    any other file that is not a format cbrun reads is refused, so that no rows are left out unseen.

    Args:
        endpoint_url: an object-store input's S3 endpoint (the job's ``[storage] endpoint_url``).

    Returns:
        (kind, files in reading order): "files" (local files of the formats, see ``open_source``), "objects"
        (object-store URIs of such files) or "arrow" (a saved data set's Arrow stream files). The kind
        is how the rest of the input room knows where a file lives: the path is classified here, once.

    Raises:
        InputError: when the path does not exist, holds nothing readable, is a file of a format cbrun does not
            read, or is a directory that holds such files (named, with the formats cbrun reads).
    """
    if is_uri(path):
        return "objects", list_object_files(str(path), endpoint_url)
    path = Path(local_path(path))
    if not path.exists():
        raise InputError(f"input {str(path)!r} not found: give a {titles()} file, or a directory of them")
    if path.is_file():
        if input_file_format(path) is None:
            raise InputError(f"input file {str(path)!r} is not a format cbrun reads; cbrun reads {supported_inputs()}")
        return "files", [path]
    saved = _saved_dataset_files(path)
    if saved:
        return "arrow", saved
    return "files", _directory_files(path)


def _saved_dataset_files(path: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` data set at ``path`` ([] when it is not one).

    Raises:
        InputError: for a saved ``DatasetDict`` (naming a split to point at).
    """
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise InputError(
            f"input {str(path)!r} is a DatasetDict; point the input at one split, e.g. "
            f"{str(path / (splits[0] if splits else 'train'))!r}"
        )
    if not (path / "state.json").is_file():
        return []
    data_files = json.loads((path / "state.json").read_text()).get("_data_files", [])
    return [path / f["filename"] for f in data_files]


def _directory_files(path: Path) -> list[Path]:
    """The data files of an input directory, in reading order (``list_input_files``'s rules).

    Raises:
        InputError: naming the files cbrun cannot read, or when there is none.
    """
    candidates = sorted(
        p for p in path.rglob("*") if p.is_file() and not _is_hidden(p.relative_to(path)) and not _is_doc(p)
    )
    unreadable = [p for p in candidates if input_file_format(p) is None]
    if unreadable:
        names = ", ".join(repr(p.relative_to(path).as_posix()) for p in unreadable[:10])
        more = f" and {len(unreadable) - 10} more" if len(unreadable) > 10 else ""
        raise InputError(
            f"input directory {str(path)!r} holds files cbrun cannot read: {names}{more}; cbrun reads "
            f"{supported_inputs()} (names starting with '.' or '_' are ignored). Move them out, or point "
            f"--input at the files to read"
        )
    if not candidates:
        kinds = [f"no {fmt.suffixes[0]} files" for fmt in input_formats()]
        raise InputError(f"input directory {str(path)!r} holds {one_of([*kinds, 'no saved data set'], 'and')}")
    return candidates


def object_file_format(uri: str) -> InputFormat | None:
    """The format one input object is read as, by its suffix alone (``input_file_format``'s rules without
    opening it), or None."""
    return format_by_suffix(basename(uri))


def list_object_files(uri: str, endpoint_url: str | None = None) -> list[str]:
    """The input objects under an object-store URI (one object, or every object below a prefix, in name order),
    with ``list_input_files``'s rules: names starting with "." or "_" and documents skipped, others refused.

    Raises:
        InputError: when nothing is there, or an object's suffix is none of a format's (``.parquet``, ``.jsonl``, ...).
    """
    try:
        objects = list_files(uri, endpoint_url)
    except (ImportError, StorageError) as exc:
        raise InputError(f"input {uri!r} cannot be listed: {exc}") from None
    root = uri.rstrip("/")
    relative = {o: o[len(root) + 1 :] if o != root else basename(o) for o in objects}
    candidates = [o for o in objects if not _is_hidden(Path(relative[o])) and not _is_doc(Path(relative[o]))]
    if not candidates:
        raise InputError(f"input {uri!r} not found: no objects there (give a {titles()} object, or a prefix of them)")
    unreadable = [relative[o] for o in candidates if object_file_format(o) is None]
    if unreadable:
        raise InputError(
            f"input {uri!r} holds objects cbrun cannot read: {', '.join(map(repr, unreadable[:10]))}; "
            f"in an object store cbrun reads {one_of([s for f in input_formats() for s in f.suffixes], 'and')} objects"
        )
    return candidates
