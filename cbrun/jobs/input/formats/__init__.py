"""The input file formats cbrun reads, one module per format in this package (datatrove's one reader per format).

Each module of this package exposes ``FORMAT``, an ``InputFormat``: the format's name, the file suffixes it claims,
and how a local file or an object-store object of it opens as a source (``InputSource``). The package is the
registry: ``input_formats`` imports every module found on the package's ``__path__`` (``pkgutil.iter_modules``), so
adding a format is one new file here; ``cbrun.jobs.input.discovery`` recognises files and
``cbrun.jobs.input.sources.open_source`` opens them through it. A ``datasets`` save_to_disk directory is a layout of
Arrow stream files, not a file format: ``discovery`` and ``sources`` know it.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa

#: Name of the hidden string column a source's batch may carry beside the asked columns: the row's error (a line
#: that is not JSON, say), or null. A source whose rows always read leaves it out.
ROW_ERROR_COLUMN = "__cbrun_row_error__"


class InputSource(Protocol):
    """One opened input file: what the reader (``cbrun.jobs.input.reader.PromptReader``) reads through.

    A source may also have ``row_place(row: int) -> str``, saying where the file's row ``row`` (0-based) is in the
    terms its users know the file by (JSON Lines: ``line 5 of prompts.jsonl``); a row's error messages then name
    it. Without it they name ``row 3 of FILE`` when the input has several files (``cbrun.jobs.input.reader.RowPlace``).

    Attributes:
        path: the file (an object-store URI for a Parquet object read in place).
        schema: the file's Arrow schema (the reader unifies the files' schemas).
        num_rows: the file's rows.
    """

    @property
    def path(self) -> Path | str: ...

    @property
    def schema(self) -> pa.Schema: ...

    @property
    def num_rows(self) -> int: ...

    def iter_batches(
        self, columns: list[str], batch_size: int, first_row: int, skip: np.ndarray | None
    ) -> Iterator[tuple[int, pa.RecordBatch]]:
        """Yield (global row index of the batch's first row, batch of ``columns`` [+ ``ROW_ERROR_COLUMN``]).

        Args:
            first_row: the global row index of this file's first row.
            skip: bool array over this file's rows, True where the row needs no reading; None reads all. A batch
                whose rows are all skipped need not be yielded.
        """
        ...


@dataclass(frozen=True)
class OpenOptions:
    """What a job passes to every source it opens.

    Attributes:
        json_text_fields: fields read as their JSON text (a string column), for formats that hold JSON values (an
            OpenAI batch request's ``body``); other formats ignore it.
        endpoint_url: an object-store input's S3 endpoint (the job's ``[storage] endpoint_url``).
    """

    json_text_fields: tuple[str, ...] = ()
    endpoint_url: str | None = None


@dataclass(frozen=True)
class InputFormat:
    """One input file format: which files it claims and how they open.

    Attributes:
        name: short name ("parquet", "jsonl").
        title: the name said to users ("Parquet", "JSON Lines").
        suffixes: lower-case name endings it claims (letter case of file names is ignored); the longest match over
            all formats wins, and two formats may not claim one suffix.
        open_file: opens a local file as a source; raises ``InputError`` when the file does not read.
        open_object: opens an object-store URI as a source; None copies the object to a local file first
            (``cbrun.jobs.store.cache.local_copy``) and opens that with ``open_file``.
        check_file: for a local file its suffix claims, raises ``InputError`` when its bytes say it is not this
            format after all (a ``.json`` document that is not JSON Lines); None trusts the name.
        sniff: whether a local file that no suffix claims is this format by its bytes (Parquet's magic); None:
            only by name.
        field_names: the field names of a local file, read cheaply (the first line); None opens the source.
        listing: how the error messages list the names it claims; "" lists ``suffixes``.
        sniff_listing: how they say which other files ``sniff`` claims.
        order: place in those lists, lowest first (ties by name).
    """

    name: str
    title: str
    suffixes: tuple[str, ...]
    open_file: Callable[[Path, OpenOptions], InputSource]
    open_object: Callable[[str, OpenOptions], InputSource] | None = None
    check_file: Callable[[Path], None] | None = None
    sniff: Callable[[Path], bool] | None = None
    field_names: Callable[[Path], list[str]] | None = None
    listing: str = ""
    sniff_listing: str = ""
    order: int = 100

    def __post_init__(self) -> None:
        bad = [s for s in self.suffixes if not s.startswith(".") or s != s.lower()]
        if not self.suffixes or bad:
            raise ValueError(f"input format {self.name!r}: suffixes must be lower-case names starting with '.'")


def input_formats() -> tuple[InputFormat, ...]:
    """Every format of this package, in ``order``: the ``FORMAT`` of each module on the package's ``__path__``.

    Raises:
        TypeError: when a module has no ``FORMAT`` (an ``InputFormat``).
        ValueError: when two formats share a name or a suffix.
    """
    return _load(tuple(sys.modules[__name__].__path__))


@functools.cache
def _load(search_path: tuple[str, ...]) -> tuple[InputFormat, ...]:
    # NOTE: cached per search path, so that a format added to ``__path__`` (a test's, a plugin's) is seen at once
    formats: list[InputFormat] = []
    for info in pkgutil.iter_modules(list(search_path)):
        module = importlib.import_module(f"{__name__}.{info.name}")
        fmt = getattr(module, "FORMAT", None)
        if not isinstance(fmt, InputFormat):
            raise TypeError(f"input format module {module.__name__} has no FORMAT (an InputFormat)")
        formats.append(fmt)
    claimed: dict[str, str] = {}
    for fmt in formats:
        for key in (f"name {fmt.name}", *fmt.suffixes):
            if key in claimed:
                raise ValueError(f"input formats {claimed[key]!r} and {fmt.name!r} both claim {key}")
            claimed[key] = fmt.name
    return tuple(sorted(formats, key=lambda f: (f.order, f.name)))


def format_by_suffix(name: str) -> InputFormat | None:
    """The format whose longest suffix ends the file name ``name`` (letter case ignored), or None."""
    name = name.lower()
    best, length = None, 0
    for fmt in input_formats():
        for suffix in fmt.suffixes:
            if name.endswith(suffix) and len(suffix) > length:
                best, length = fmt, len(suffix)
    return best


def one_of(words: list[str], conjunction: str = "or") -> str:
    """``a, b or c``."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {conjunction} {words[-1]}"


def titles(conjunction: str = "or") -> str:
    """The formats' titles as a list: "Parquet or JSON Lines"."""
    return one_of([fmt.title for fmt in input_formats()], conjunction)


def help_listing() -> str:
    """Each format's title and the file names it claims, for help texts: "Parquet: .parquet, or a Parquet file of
    any name (e.g. Hive's 000000_0); JSON Lines: .jsonl, ..." (``cbrun run --help``'s ``--input``)."""
    parts = []
    for fmt in input_formats():
        names = fmt.listing or ", ".join(fmt.suffixes)
        if fmt.sniff is not None and fmt.sniff_listing:
            names += f", or {fmt.sniff_listing}"
        parts.append(f"{fmt.title}: {names}")
    return "; ".join(parts)


def supported_inputs() -> str:
    """What cbrun reads, for error messages: every format's names, the files they claim by their bytes, and a
    ``datasets`` save_to_disk directory."""
    formats = input_formats()
    names = ", ".join(fmt.listing or ", ".join(fmt.suffixes) for fmt in formats) + " (any letter case)"
    sniffed = [fmt.sniff_listing for fmt in formats if fmt.sniff is not None and fmt.sniff_listing]
    return ", ".join([names, *sniffed, "or a datasets save_to_disk directory"])
