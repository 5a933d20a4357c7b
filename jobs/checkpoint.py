"""Resume state of an output directory: the job fingerprint, the done-row bitmap, and the finished marker.

An output directory belongs to one job, identified by ``job.json``: the settings that change what a row's output is
(model files, input and prompt settings, sampling defaults, cbrun version). Engine settings that only change speed
(page_size, max_batch_tokens, ...) are left out, so a job may resume with another batch size. ``limit`` is left out
too: raising it extends a job. So is ``input.order_window``: it changes the order of work, never a row's output.

With ``n`` samples per row, a row is done when its ``row_index`` is in a committed part: the job commits all the
samples of a row in the same part (``PartWriter.add_group``), so a done row always has every sample.

Which rows are done is read back from the committed parts themselves (their ``row_index`` column only) into a
bitmap of one byte per input row, 100 MB for a 100M-row input; nothing else is kept, so there is no second record
that could disagree with the parts.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jobs.writer import PART_RE, TEMP_RE, PartWriter, committed_parts

JOB_FILE = "job.json"
SUCCESS_FILE = "_SUCCESS"
STATS_FILE = "stats.json"
#: Files of the model directory whose bytes define the model's outputs besides the weights.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
               "chat_template.jinja", "chat_template.json")


def cbrun_version() -> str:
    try:
        return metadata.version("cbrun")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def hash_model_files(model_path: str | Path) -> str:
    """sha256 over the names and bytes of the model's config and tokenizer files (weights are not read)."""
    model_path = Path(model_path)
    digest = hashlib.sha256()
    for name in MODEL_FILES:
        path = model_path / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def job_fingerprint(manifest, num_input_rows: int) -> dict[str, Any]:
    """The settings that determine a job's outputs, as a JSON-ready dict.

    Args:
        manifest: the ``JobManifest``.
        num_input_rows: rows in the whole input, so that a replaced input file of another length is noticed.
    """
    sampling = asdict(manifest.sampling)
    sampling.pop("seed")
    inp = manifest.input
    fingerprint = {
        "cbrun_version": cbrun_version(),
        "model": {"path": str(Path(manifest.model.path).resolve()),
                  "files_sha256": hash_model_files(manifest.model.path),
                  "dtype": manifest.engine.dtype},
        "input": {"path": str(Path(inp.path).resolve()), "num_rows": num_input_rows,
                  "prompt_column": inp.prompt_column, "prompt_ids_column": inp.prompt_ids_column,
                  "id_column": inp.id_column, "template": inp.template, "mode": inp.mode,
                  "candidates_column": inp.candidates_column, "corruptions": inp.corruptions, "chat": inp.chat,
                  "messages_column": inp.messages_column, "system_prompt": inp.system_prompt,
                  "per_row_settings": inp.per_row_settings, "boundary": inp.boundary},
        "sampling": {**sampling, "job_seed": manifest.seed, "n": manifest.n},
    }
    # NOTE: added only when set, so the jobs of earlier versions keep their fingerprint
    if inp.format != "auto":
        fingerprint["input"]["format"] = inp.format
    if manifest.output.keep_columns:
        fingerprint["output"] = {"keep_columns": list(manifest.output.keep_columns)}
    # NOTE: a JSON round trip (tuples become lists) so it compares equal to the job.json it is written to.
    return json.loads(json.dumps(fingerprint))


def fingerprint_differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted names of the settings that differ between two fingerprints."""
    names = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            names += fingerprint_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            names.append(f"{prefix}{key}")
    return names


class FingerprintMismatch(ValueError):
    """The output directory holds another job's results."""


class Checkpoint:
    """The one owner of an output directory: job.json, part files, temporary files, _SUCCESS, stats.json.

    A run ``open``s it (is it this job's, which rows are done), ``start``s writing (its ``PartWriter`` is the
    directory's only appender) and ``mark_finished``es it.
    """

    def __init__(self, output_dir: str | Path):
        self.output_dir = Path(output_dir)

    def open(self, fingerprint: dict[str, Any], num_rows: int, *, overwrite: bool = False) -> np.ndarray:
        """Check that the directory may take this job and read which of its rows are done; touches nothing.

        Args:
            fingerprint: the job's ``job_fingerprint``.
            num_rows: rows the job covers.
            overwrite: the directory's results will be discarded: nothing is done.

        Returns:
            Bool array over row indices 0..num_rows-1, True for rows in a committed part.

        Raises:
            FingerprintMismatch: when the directory holds another job's results (or parts but no job.json) and
                ``overwrite`` is false.
            ValueError: when the output path exists and is not a directory.
        """
        self.check(fingerprint, overwrite=overwrite)
        if overwrite:
            return np.zeros(num_rows, dtype=bool)
        if not self.job_file.is_file() and committed_parts(self.output_dir):
            raise FingerprintMismatch(
                f"output directory {str(self.output_dir)!r} holds part files but no job.json; rerun with "
                f"--overwrite to discard them, or choose another --output")
        return self.done_rows(num_rows)

    def start(self, fingerprint: dict[str, Any], commit_every_rows: int, commit_every_seconds: float, *,
              overwrite: bool = False, carried_fields: Sequence[pa.Field] = ()) -> PartWriter:
        """Make the directory ready to take rows (``prepare``, the finished marker removed); returns its appender
        (``carried_fields``: the input columns its rows carry, ``jobs.carry``)."""
        self.prepare(fingerprint, overwrite=overwrite)
        self.clear_finished()
        return PartWriter(self.output_dir, commit_every_rows, commit_every_seconds, carried_fields=carried_fields)

    @property
    def job_file(self) -> Path:
        return self.output_dir / JOB_FILE

    def check(self, fingerprint: dict[str, Any], *, overwrite: bool = False) -> None:
        """Make sure the directory may take this job; touches nothing.

        Raises:
            FingerprintMismatch: when ``job.json`` holds another fingerprint and ``overwrite`` is false.
            ValueError: when the output path exists and is not a directory.
        """
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise ValueError(f"output path {str(self.output_dir)!r} exists and is not a directory")
        if overwrite or not self.job_file.is_file():
            return
        old = json.loads(self.job_file.read_text())
        if old != fingerprint:
            changed = ", ".join(fingerprint_differences(old, fingerprint))
            raise FingerprintMismatch(
                f"output directory {str(self.output_dir)!r} holds the results of a different job (changed: "
                f"{changed}); rerun with --overwrite to discard them, or choose another --output"
            )

    def prepare(self, fingerprint: dict[str, Any], *, overwrite: bool = False) -> None:
        """Check, create the directory, clear it when ``overwrite``, remove stray temporary files, write job.json.

        Raises:
            FingerprintMismatch: see ``check``.
        """
        self.check(fingerprint, overwrite=overwrite)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if overwrite:
            self.clear()
        self.remove_temp_files()
        if not self.job_file.is_file():
            tmp = self.output_dir / f".{JOB_FILE}.tmp"
            tmp.write_text(json.dumps(fingerprint, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, self.job_file)

    def clear(self) -> None:
        """Remove every cbrun file of the directory (other files are left alone)."""
        for path in self.output_dir.iterdir():
            if path.name in (JOB_FILE, SUCCESS_FILE, STATS_FILE) or PART_RE.match(path.name) \
                    or TEMP_RE.match(path.name):
                path.unlink()

    def remove_temp_files(self) -> list[Path]:
        """Delete the half-written parts a killed run left behind; returns them."""
        own_temps = (f".{JOB_FILE}.tmp", f".{STATS_FILE}.tmp")
        stray = [p for p in self.output_dir.iterdir() if TEMP_RE.match(p.name) or p.name in own_temps]
        for path in stray:
            path.unlink()
        return stray

    def done_rows(self, num_rows: int) -> np.ndarray:
        """Bool array over row indices 0..num_rows-1, True for rows in a committed part.

        Reads only the ``row_index`` column of each part, one part at a time. Rows past ``num_rows`` (from a run
        with a larger limit) are ignored.
        """
        done = np.zeros(num_rows, dtype=bool)
        for part in committed_parts(self.output_dir):
            for batch in pq.ParquetFile(part).iter_batches(columns=["row_index"], batch_size=65536):
                indices = batch.column(0).to_numpy()
                done[indices[indices < num_rows]] = True
        return done

    def is_finished(self) -> bool:
        return (self.output_dir / SUCCESS_FILE).is_file()

    def clear_finished(self) -> None:
        for name in (SUCCESS_FILE, STATS_FILE):
            (self.output_dir / name).unlink(missing_ok=True)

    def mark_finished(self, fingerprint: dict[str, Any], stats: dict[str, Any]) -> None:
        """Write job.json (when missing), stats.json, then the empty _SUCCESS marker."""
        self.prepare(fingerprint)
        tmp = self.output_dir / f".{STATS_FILE}.tmp"
        tmp.write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.output_dir / STATS_FILE)
        (self.output_dir / SUCCESS_FILE).touch()

    def read_stats(self) -> dict[str, Any] | None:
        path = self.output_dir / STATS_FILE
        return json.loads(path.read_text()) if path.is_file() else None
