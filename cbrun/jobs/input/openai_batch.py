"""OpenAI batch input: request lines ``{custom_id, method, url, body}`` become rows (``input.format``).

The format is the one the OpenAI Batch API and ``vllm run-batch`` read (vLLM ``entrypoints/openai/run_batch.py``)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}}
    {"custom_id": "q2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once upon", "n": 2}}

- ``/v1/chat/completions``: ``body.messages`` go through the model's chat template (``cbrun.jobs.input.chat.encode_chat``);
- ``/v1/completions``: ``body.prompt`` is text (encoded as the job encodes a prompt column: with BOS) or a list
  of token ids (used as given);
- the body's sampling fields override the job's ``[sampling]`` values for that row
  (``cbrun.jobs.input.openai_request.BODY_FIELDS``); a field that is absent or null keeps the job's value (note: the job's
  default temperature is 0, OpenAI's is 1);
- ``custom_id`` is the row id (it seeds the row as ``id_column`` does); duplicates are refused before any work;
- ``response_format`` (``json_object``, ``json_schema``) constrains the row's output (``structured_outputs``);
- an unknown url or method, a missing body, or a body field cbrun cannot honour is that row's error, naming the
  field. A field set to its neutral value (``"stream": false``, ``"logit_bias": {}``...) is accepted.

Each row carries ``OPENAI_FIELDS`` (the custom_id as given, null when the line has none; the url; the model name;
the number of top logprobs asked) into its output rows, so ``cbrun.jobs.output.export`` can write ``_results.jsonl`` from the
parts alone.

This module owns the reader (request lines -> rows); each body is parsed by ``cbrun.jobs.input.openai_request``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from cbrun.jobs.input.carry import carried_values, check_kept_columns, keep_role, keep_roles
from cbrun.jobs.input.chat import encode_chat
from cbrun.jobs.input.discovery import input_file_format, list_input_files
from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.openai_request import CHAT_URL, COMPLETIONS_URL, BatchRequest, parse_request
from cbrun.jobs.input.prompts import encode_prompt
from cbrun.jobs.input.reader import InputRow, PromptReader
from cbrun.jobs.input.sources import iter_column_batches, open_source

REQUEST_FIELDS = ("custom_id", "method", "url", "body")
#: Columns every output row of an OpenAI batch job carries (see ``cbrun.jobs.input.carry``).
OPENAI_FIELDS = [
    pa.field("custom_id", pa.string()),
    pa.field("url", pa.string()),
    pa.field("model", pa.string()),
    pa.field("top_logprobs", pa.int32()),
]


def input_fields(path: str | Path, endpoint_url: str | None = None) -> list[str]:
    """The field names of the input's first file, cheaply where its format can (a Parquet footer, the first JSON
    object line: ``InputFormat.field_names``)."""
    kind, files = list_input_files(path, endpoint_url)
    first = files[0]
    if kind == "arrow":
        return []
    fmt = input_file_format(first) if kind == "files" else None
    if fmt is not None and fmt.field_names is not None:
        return fmt.field_names(first)
    # NOTE: an object's footer or schema, read through its source
    return list(open_source(kind, first, endpoint_url=endpoint_url).schema.names)


class OpenAIBatchReader:
    """Reads OpenAI batch request lines as rows whose prompt ids and sampling overrides come from the body.

    It wraps a ``PromptReader`` over the fields ``REQUEST_FIELDS`` (``body`` as JSON text), so row indices,
    ``limit``, resume and per-row errors are the reader's. Prompt ids are computed here, so ``bind_tokenizer``
    must be called before ``iter_rows``.

    Attributes:
        num_rows, num_input_rows, sources: as ``PromptReader``'s.
        schema: the input's schema over the columns read (``PromptReader.schema``).
        num_chat_requests: requests to ``CHAT_URL`` (the job checks the chat template before any work if > 0).

    Raises:
        InputError: from the constructor, when the input does not have the request fields, or custom_ids repeat
            (naming them).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        limit: int | None = None,
        batch_size: int = 1024,
        keep_columns: list[str] = (),
        default_model: str = "",
        endpoint_url: str | None = None,
    ):
        names = input_fields(path, endpoint_url)
        missing = [name for name in REQUEST_FIELDS if name not in names]
        if missing:
            raise InputError(
                f"input {str(path)!r} is read as OpenAI batch requests, but its first line has no "
                f"{', '.join(missing)} (fields: {', '.join(names) or 'none'})"
            )
        self.rows = PromptReader(
            path,
            id_column="custom_id",
            limit=limit,
            batch_size=batch_size,
            extra_columns={name: name for name in REQUEST_FIELDS},
            per_row_settings=False,
            json_text_fields=("body",),
            endpoint_url=endpoint_url,
        )
        check_kept_columns(list(keep_columns), self.rows.column_names)
        self.rows.add_extra_columns(keep_roles(list(keep_columns)))
        self.sources = self.rows.sources
        self.num_rows = self.rows.num_rows
        self.num_input_rows = self.rows.num_input_rows
        self.default_model = default_model
        self.tokenizer = None
        self.num_chat_requests = self._check_custom_ids()

    @property
    def schema(self) -> pa.Schema:
        return self.rows.schema

    def _check_custom_ids(self) -> int:
        """Refuse repeated custom_ids, naming them; returns how many requests go to the chat url."""
        counts: Counter = Counter()
        num_chat = 0
        for batch in iter_column_batches(self.sources, self.num_rows, ["custom_id", "url"], self.rows.batch_size):
            counts.update(str(v) for v in batch.column("custom_id").to_pylist() if v is not None)
            num_chat += batch.column("url").to_pylist().count(CHAT_URL)
        repeated = [(custom_id, n) for custom_id, n in counts.items() if n > 1]
        if repeated:
            named = ", ".join(f"{custom_id!r} ({n} lines)" for custom_id, n in repeated[:5])
            more = f" and {len(repeated) - 5} more" if len(repeated) > 5 else ""
            raise InputError(
                f"custom_id values repeat in {str(self.rows.sources[0].path)!r}: {named}{more}; "
                f"each request needs its own custom_id"
            )
        return num_chat

    def bind_tokenizer(self, tokenizer, model_path: str) -> None:
        """Give the tokenizer that turns prompts and conversations into ids.

        Raises:
            ValueError: when the batch has chat requests and the tokenizer has no chat template.
        """
        if self.num_chat_requests and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the batch has {self.num_chat_requests} {CHAT_URL} requests, but the tokenizer in "
                f"{model_path!r} has no chat template; use a chat (instruction-tuned) model, or send "
                f"{COMPLETIONS_URL} requests"
            )
        self.tokenizer = tokenizer

    def iter_rows(self, done: np.ndarray | None = None) -> Iterator[InputRow]:
        """Yield the rows not marked done, in input order, with prompt ids, overrides and carried columns set."""
        assert self.tokenizer is not None, "bind_tokenizer first"
        for row in self.rows.iter_rows(done):
            yield self._request_row(row)

    def read_span(self, start: int, end: int) -> Iterator[pa.RecordBatch]:
        """The request lines ``start .. end-1`` as ``PromptReader.read_span`` batches."""
        return self.rows.read_span(start, end)

    def rows_of(self, batch: pa.RecordBatch | pa.Table) -> Iterator[InputRow]:
        """The rows of a ``read_span`` batch, as ``iter_rows`` makes them."""
        assert self.tokenizer is not None, "bind_tokenizer first"
        for row in self.rows.rows_of(batch):
            yield self._request_row(row)

    def _request_row(self, row: InputRow) -> InputRow:
        extra = row.extra
        row.extra = {keep_role(name): value for name, value in carried_values(row).items()}
        custom_id, url = extra.get("custom_id"), extra.get("url")
        # NOTE: setdefault: a column the job keeps as well keeps its input value and type
        row.extra.setdefault(keep_role("custom_id"), None if custom_id is None else str(custom_id))
        row.extra.setdefault(keep_role("url"), url if isinstance(url, str) else None)
        row.extra[keep_role("model")] = self.default_model
        if row.error is not None:
            return row
        try:
            request = parse_request(extra["method"], extra["url"], extra["body"])
            row.extra[keep_role("model")] = request.model or self.default_model
            row.extra[keep_role("top_logprobs")] = request.top_logprobs
            row.sampling_overrides = request.overrides
            row.num_samples = request.num_samples
            row.prompt_token_ids = self._prompt_ids(request)
        except ValueError as exc:
            row.error = f"{row.where('custom_id')}: {exc}"
        return row

    def _prompt_ids(self, request: BatchRequest) -> list[int]:
        if request.messages is not None:
            return encode_chat(self.tokenizer, request.messages)
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        return encode_prompt(self.tokenizer, request.prompt)
