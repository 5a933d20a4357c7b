"""Export an output directory's parts as JSON Lines: OpenAI batch output (``_results.jsonl``) or plain rows.

The default names start with ``_`` so that the directory stays a data set: ``pq.read_table(OUT)``,
``pandas.read_parquet(OUT)`` and other Parquet data-set readers skip them.

The parts stay the record (resume reads them alone); these files are derived from them, whole or not at all
(written under a temporary name, fsynced, then renamed), and can be written again at any time with
``cbrun export OUT_DIR --format openai-batch|jsonl [--to FILE]``.

OpenAI batch output has one line per input row, in input order, as the OpenAI Batch API and ``vllm run-batch``
write it::

    {"id": "batch_req_...", "custom_id": "q1", "error": null,
     "response": {"status_code": 200, "request_id": "req_...", "body": {ChatCompletion or Completion}}}

The body is the object the endpoint returns (``openai.types.chat.ChatCompletion`` for ``/v1/chat/completions``,
``openai.types.Completion`` otherwise): one choice per sample with its text, finish reason and, when asked, its
log-probabilities; ``usage``; ``model`` (the request's, else the model directory's name); ``created`` (when the
part holding the row was committed). A failed row has ``status_code`` 400, no body, and ``error`` {code, message}.
Ids are derived from the job and row, so exporting again writes the same file.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import functools
import hashlib
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from cbrun.jobs.input.openai_request import CHAT_URL, COMPLETIONS_URL
from cbrun.jobs.output.output_dir import open_output
from cbrun.jobs.output.writer import committed_parts
from cbrun.jobs.store.files import write_file

RESULTS_FILE = "_results.jsonl"  # "_": data-set readers skip it
ROWS_FILE = "_output.jsonl"
EXPORT_FORMATS = ("openai-batch", "jsonl")
#: Stands for a log-probability the output does not hold (vLLM writes the same for -inf).
MISSING_LOGPROB = -9999.0


class ExportError(ValueError):
    """The directory holds no cbrun output to export."""


def read_rows(output_dir: str | Path) -> list[dict[str, Any]]:
    """Every committed row (carried columns included) as dicts sorted by (row_index, sample_index); each has
    ``_created``, the Unix time its part was committed.

    Raises:
        ExportError: when the directory holds no job.json.
    """
    output_dir = Path(output_dir)
    if open_output(output_dir).read_job_file() is None:
        raise ExportError(f"{str(output_dir)!r} holds no cbrun job (no job.json)")
    tables = []
    for part in committed_parts(output_dir):
        table = pq.read_table(part)
        created = int(part.stat().st_mtime)
        tables.append(table.append_column("_created", pa.array([created] * table.num_rows, pa.int64())))
    if not tables:
        return []
    table = pa.concat_tables(tables).sort_by([("row_index", "ascending"), ("sample_index", "ascending")])
    return table.to_pylist()


def export(output_dir: str | Path, fmt: str, to: str | Path | None = None, tokenizer=None) -> Path:
    """Write the directory's rows in format ``fmt`` ("openai-batch" or "jsonl") to ``to`` (default
    ``OUT_DIR/_results.jsonl`` or ``OUT_DIR/_output.jsonl``); returns the path written.

    Raises:
        ExportError: for an unknown format or a directory without a job.
    """
    if fmt == "openai-batch":
        return export_openai_batch(output_dir, to, tokenizer)
    if fmt == "jsonl":
        to = Path(to) if to is not None else Path(output_dir) / ROWS_FILE
        _write_lines(to, (_json_line(row) for row in read_rows(output_dir)))
        return to
    raise ExportError(f"unknown export format {fmt!r}; formats: {', '.join(EXPORT_FORMATS)}")


def export_openai_batch(output_dir: str | Path, to: str | Path | None = None, tokenizer=None) -> Path:
    """Write OpenAI batch output lines for every committed row (see the module docstring); returns the path.

    Args:
        tokenizer: turns token ids into log-probability token texts; None loads the job's when a row has
            log-probabilities.

    Raises:
        ExportError: when the directory holds no job.
    """
    output_dir = Path(output_dir)
    rows = read_rows(output_dir)
    if any(row.get("candidate_logprobs") is not None for row in rows):
        raise ExportError(
            f"{str(output_dir)!r} holds a score-mode job, which has no completions to write as OpenAI "
            f"batch output; use --format jsonl"
        )
    job_bytes = open_output(output_dir).job_file_bytes() or b"{}"
    model = json.loads(job_bytes).get("model", {})
    # NOTE: a Hub model (a recorded commit) by its repo id, a directory by its name
    default_model = (model.get("path") if model.get("commit") else Path(model.get("path", "")).name) or "cbrun"
    if tokenizer is None and any(row.get("logprobs") is not None for row in rows):
        from cbrun.engine.core.tokenizer import load_tokenizer
        from cbrun.jobs.model.source import recorded_model_path

        tokenizer = load_tokenizer(recorded_model_path(model))
    formatter = _ResultFormatter(hashlib.sha256(job_bytes).hexdigest(), default_model, tokenizer)
    to = Path(to) if to is not None else output_dir / RESULTS_FILE
    _write_lines(to, (json.dumps(formatter.line(group), ensure_ascii=False) for group in _row_groups(rows)))
    return to


def _row_groups(rows: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """The output rows of each input row (its samples), in row order."""
    group: list[dict[str, Any]] = []
    for row in rows:
        if group and row["row_index"] != group[0]["row_index"]:
            yield group
            group = []
        group.append(row)
    if group:
        yield group


class _ResultFormatter:
    """Builds one OpenAI batch output line from the output rows of one input row."""

    def __init__(self, job_hash: str, default_model: str, tokenizer):
        self.job_hash = job_hash
        self.default_model = default_model
        self.tokenizer = tokenizer

    def line(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        first = rows[0]
        key = hashlib.sha256(f"{self.job_hash}\0{first['row_index']}".encode()).hexdigest()[:24]
        # NOTE: OpenAI batch input carries custom_id (null for a line without one); other inputs use the id
        custom_id = first["custom_id"] if "custom_id" in first else first["id"]
        line = {"id": f"batch_req_{key}", "custom_id": custom_id}
        failed = [row for row in rows if row["finish_reason"] == "error"]
        if failed:
            line["response"] = {"status_code": 400, "request_id": f"req_{key}", "body": None}
            line["error"] = {"code": "invalid_request", "message": failed[0]["error"]}
            return line
        line["response"] = {"status_code": 200, "request_id": f"req_{key}", "body": self.body(rows, key)}
        line["error"] = None
        return line

    def body(self, rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
        """The ChatCompletion (chat url) or Completion object of a row's samples."""
        first = rows[0]
        chat = (first.get("url") or COMPLETIONS_URL) == CHAT_URL
        top = first.get("top_logprobs")
        choices = []
        for row in rows:
            logprobs = None if row.get("logprobs") is None else self.logprobs(row, top, chat)
            choice: dict[str, Any] = {
                "index": row["sample_index"],
                "finish_reason": row["finish_reason"],
                "logprobs": logprobs,
            }
            if chat:
                choice["message"] = {"role": "assistant", "content": row["completion"]}
            else:
                choice["text"] = row["completion"]
            choices.append(choice)
        completion_tokens = sum(row["num_completion_tokens"] for row in rows)
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{key}",
            "object": "chat.completion" if chat else "text_completion",
            "created": first["_created"],
            "model": first.get("model") or self.default_model,
            "choices": choices,
            "usage": {
                "prompt_tokens": first["num_prompt_tokens"],
                "completion_tokens": completion_tokens,
                "total_tokens": first["num_prompt_tokens"] + completion_tokens,
            },
        }

    def logprobs(self, row: dict[str, Any], top: int | None, chat: bool) -> dict[str, Any]:
        """Chat ``{content: [...], refusal}`` or completions ``{tokens, token_logprobs, top_logprobs,
        text_offset}`` log-probabilities of a sample's tokens."""
        tokens = []
        for token_id, entry in zip(row["completion_token_ids"], row["logprobs"]):
            candidates = token_logprobs(entry)
            best = sorted(candidates.items(), key=lambda item: -item[1])
            tokens.append((token_id, candidates.get(token_id, MISSING_LOGPROB), best if top is None else best[:top]))
        ids = [token_id for token_id, _, _ in tokens]
        if chat:
            content = [
                {
                    **self.token(ids[:i], token_id, logprob),
                    "top_logprobs": [self.token(ids[:i], alt, lp) for alt, lp in best],
                }
                for i, (token_id, logprob, best) in enumerate(tokens)
            ]
            return {"content": content, "refusal": None}
        texts = [self.text(ids[:i], token_id) for i, token_id in enumerate(ids)]
        offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        return {
            "tokens": texts,
            "token_logprobs": [lp for _, lp, _ in tokens],
            "top_logprobs": [
                {self.text(ids[:i], alt): lp for alt, lp in best} for i, (_, _, best) in enumerate(tokens)
            ],
            "text_offset": offsets,
        }

    def text(self, previous_ids: list[int], token_id: int) -> str:
        """The text ``token_id`` adds after ``previous_ids``, decoded in context (as vLLM's incremental
        detokenizer does): a SentencePiece token keeps its leading space, so the tokens join to the completion.
        Falls back to the token decoded alone when the context's text is not a prefix (a split character)."""
        before = self.tokenizer.decode(previous_ids)
        after = self.tokenizer.decode([*previous_ids, token_id])
        return after[len(before) :] if after.startswith(before) else self.tokenizer.decode([token_id])

    def token(self, previous_ids: list[int], token_id: int, logprob: float) -> dict[str, Any]:
        text = self.text(previous_ids, token_id)
        return {"token": text, "logprob": logprob, "bytes": token_bytes(self.tokenizer, token_id, text)}


def token_bytes(tokenizer, token_id: int, text: str) -> list[int]:
    """The bytes a token stands for: its text's UTF-8 bytes, or, when the token is part of a character (its
    text decodes to U+FFFD), its raw byte(s) from a byte-fallback piece ``<0xHH>`` or a byte-level BPE piece
    (GPT-2's bytes-to-unicode table)."""
    if "\ufffd" not in text:
        return list(text.encode("utf-8"))
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
        return [int(piece[3:5], 16)]
    byte_of = _byte_level_decoder()
    if isinstance(piece, str) and piece and all(ch in byte_of for ch in piece):
        return [byte_of[ch] for ch in piece]
    return list(text.encode("utf-8"))


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE table, reversed: printable stand-in character -> byte (Radford et al. 2019,
    openai/gpt-2 ``encoder.py``)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    stand_ins = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            stand_ins.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, stand_ins)}


def token_logprobs(entry: Any) -> dict[int, float]:
    """One generated token's {token id: log-probability}, from the output's ``logprobs`` value: a map (read as
    (key, value) pairs) or a list of structs with an integer and a float field."""
    if isinstance(entry, dict):
        return {int(k): float(v) for k, v in entry.items()}
    result = {}
    for item in entry or ():
        if isinstance(item, tuple):
            token_id, logprob = item
        else:
            token_id = next(v for v in item.values() if isinstance(v, int) and not isinstance(v, bool))
            logprob = next(v for v in item.values() if isinstance(v, float))
        result[int(token_id)] = float(logprob)
    return result


def _json_line(row: dict[str, Any]) -> str:
    row = {name: value for name, value in row.items() if name != "_created"}
    return json.dumps(_jsonable(row), ensure_ascii=False, allow_nan=False)


def _jsonable(value: Any) -> Any:
    """A Python value read from Arrow, as JSON: maps (lists of pairs) become objects, bytes base64 text,
    dates ISO text, decimals text, non-finite floats null."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        if value and all(isinstance(item, tuple) and len(item) == 2 for item in value):
            return {str(k): _jsonable(v) for k, v in value}
        return [_jsonable(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal | datetime.timedelta):
        return str(value)
    return value


def _write_lines(path: Path, lines) -> None:
    """Write text lines to ``path`` atomically (``cbrun.jobs.store.files.write_file``)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(f) -> None:
        for line in lines:
            f.write((line + "\n").encode("utf-8"))

    write_file(path, write)
