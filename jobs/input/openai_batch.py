"""OpenAI batch input: request lines ``{custom_id, method, url, body}`` become rows (``input.format``).

The format is the one the OpenAI Batch API and ``vllm run-batch`` read (vLLM ``entrypoints/openai/run_batch.py``)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}}
    {"custom_id": "q2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once upon", "n": 2}}

- ``/v1/chat/completions``: ``body.messages`` go through the model's chat template (``jobs.input.chat.encode_chat``);
- ``/v1/completions``: ``body.prompt`` is text (encoded as the job encodes a prompt column: with BOS) or a list
  of token ids (used as given);
- the body's sampling fields override the job's ``[sampling]`` values for that row (``BODY_FIELDS``); a field
  that is absent or null keeps the job's value (note: the job's default temperature is 0, OpenAI's is 1);
- ``custom_id`` is the row id (it seeds the row as ``id_column`` does); duplicates are refused before any work;
- ``response_format`` (``json_object``, ``json_schema``) constrains the row's output (``structured_outputs``);
- an unknown url or method, a missing body, or a body field cbrun cannot honour is that row's error, naming the
  field. A field set to its neutral value (``"stream": false``, ``"logit_bias": {}``...) is accepted.

Each row carries ``OPENAI_FIELDS`` (the custom_id as given, null when the line has none; the url; the model name;
the number of top logprobs asked) into its output rows, so ``jobs.output.export`` can write ``_results.jsonl`` from the
parts alone.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from engine.sampling_params import coerce_num_samples, coerce_sampling_value
from engine.structured_output import StructuredOutputsParams, coerce_structured_outputs
from jobs.input.carry import carried_values, check_kept_columns, keep_role, keep_roles
from jobs.input.chat import encode_chat
from jobs.input.discovery import list_input_files
from jobs.input.errors import InputError
from jobs.input.jsonl_source import is_jsonl, numbered_rows
from jobs.input.prompts import encode_prompt
from jobs.input.reader import InputRow, PromptReader
from jobs.input.sources import iter_column_batches

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
REQUEST_FIELDS = ("custom_id", "method", "url", "body")
#: Columns every output row of an OpenAI batch job carries (see ``jobs.input.carry``).
OPENAI_FIELDS = [
    pa.field("custom_id", pa.string()),
    pa.field("url", pa.string()),
    pa.field("model", pa.string()),
    pa.field("top_logprobs", pa.int32()),
]
#: Body field -> SamplingParams field it sets (vLLM's extra fields included).
BODY_FIELDS = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "structured_outputs": "structured_outputs",
}
#: Body fields that change nothing cbrun computes.
IGNORED_FIELDS = ("model", "user", "metadata", "store", "service_tier", "stream_options")
#: Body fields accepted only with these values (their neutral values: they ask for nothing).
NEUTRAL_VALUES = {
    "stream": (False,),
    "echo": (False,),
    "best_of": (1,),
    "logit_bias": ({},),
    "tools": ([],),
    "parallel_tool_calls": (True, False),
    "skip_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
}


def is_openai_batch_input(inp) -> bool:
    """Whether the job's prompts come from OpenAI batch requests: ``input.format = "openai-batch"``, or "auto"
    with no prompt setting (the input must then have the request shape; ``OpenAIBatchReader`` checks)."""
    return inp.format == "openai-batch" or (
        inp.format == "auto"
        and inp.prompt_column is None
        and inp.template is None
        and inp.prompt_ids_column is None
        and inp.messages_column is None
    )


def input_fields(path: str | Path) -> list[str]:
    """The field names of the input's first file: a Parquet footer, or the first JSON object line (cheap)."""
    kind, files = list_input_files(path)
    first = files[0]
    if kind == "parquet" and not is_jsonl(first):
        return pq.read_schema(first).names
    if kind == "parquet":
        for _, line in numbered_rows(first):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return list(value)
    return []


@dataclass
class BatchRequest:
    """One parsed request body.

    Attributes:
        url: ``CHAT_URL`` or ``COMPLETIONS_URL``.
        messages: chat: the conversation as [{"role", "content"}].
        prompt: completions: the prompt text; None with token ids.
        prompt_token_ids: completions: the prompt as token ids, used as given.
        overrides: SamplingParams field -> value, from the body.
        num_samples: ``n``; None keeps the job's.
        top_logprobs: how many top log-probabilities per token were asked; None: logprobs not asked.
        model: ``body.model``, when given.
    """

    url: str
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    num_samples: int | None = None
    top_logprobs: int | None = None
    model: str | None = None


def parse_request(method: Any, url: Any, body: Any) -> BatchRequest:
    """Parse one request line's method, url and body (a dict, or its JSON text).

    Raises:
        ValueError: naming the field, for an unknown method or url, a missing or malformed body, a missing
            prompt or messages, a bad sampling value, or a body field cbrun cannot honour.
    """
    if method is not None and str(method).upper() != "POST":
        raise ValueError(f'method {method!r} is not supported: use "POST"')
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise ValueError(f"url {url!r} is not supported: cbrun serves {CHAT_URL!r} and {COMPLETIONS_URL!r}")
    fields_ = {name: value for name, value in _body_object(body).items() if value is not None}
    request = BatchRequest(url=url, model=_text_field(fields_.pop("model", None), "model"))
    if url == CHAT_URL:
        request.messages = chat_messages(fields_.pop("messages", None))
    else:
        request.prompt, request.prompt_token_ids = completion_prompt(fields_.pop("prompt", None))
    request.top_logprobs = _top_logprobs(fields_, chat=url == CHAT_URL)
    if request.top_logprobs is not None:
        request.overrides["logprobs"] = request.top_logprobs
    if "n" in fields_:
        request.num_samples = _field(coerce_num_samples, "n", fields_.pop("n"))
    constraint = response_format(fields_.pop("response_format", None))
    if constraint is not None:
        request.overrides["structured_outputs"] = constraint
    request.overrides.update(_sampling_overrides(fields_))
    return request


def response_format(value: Any) -> StructuredOutputsParams | None:
    """The constraint of a body's ``response_format`` (OpenAI's spec, on chat and completions alike):
    ``{"type": "text"}`` or absent: none; ``{"type": "json_object"}``: any JSON object; ``{"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: a JSON value valid under ``schema``.

    Raises:
        ValueError: naming the field, for another type or a malformed or invalid schema.
    """
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise ValueError(
            f"body.response_format = {json.dumps(value)} is not supported: its type must be "
            '"text", "json_object" or "json_schema"'
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ValueError("body.response_format.json_schema.schema must be a JSON schema object")
    return _field(
        lambda v: coerce_structured_outputs("structured_outputs", {"json": v}),
        "response_format.json_schema.schema",
        spec["schema"],
    )


def _body_object(body: Any) -> dict[str, Any]:
    """The body as a dict, from a dict or its JSON text."""
    if body is None:
        raise ValueError("the request has no body")
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError as exc:
            raise ValueError(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError(f"body must be a JSON object, got {type(body).__name__}")
    return body


def _sampling_overrides(fields_: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams values from the remaining body fields; a field cbrun cannot honour raises, naming it."""
    if (
        "max_tokens" in fields_
        and "max_completion_tokens" in fields_
        and fields_["max_tokens"] != fields_["max_completion_tokens"]
    ):
        raise ValueError("body.max_tokens and body.max_completion_tokens differ: give one of them")
    overrides = {}
    for name, value in fields_.items():
        if name in BODY_FIELDS:
            target = BODY_FIELDS[name]
            overrides[target] = _field(lambda v: coerce_sampling_value(target, v), name, value)
        elif name in NEUTRAL_VALUES and value not in NEUTRAL_VALUES[name]:
            raise ValueError(
                f"body.{name} = {json.dumps(value)} is not supported by cbrun (only "
                f"{' or '.join(json.dumps(v) for v in NEUTRAL_VALUES[name])})"
            )
        elif name not in NEUTRAL_VALUES and name not in IGNORED_FIELDS:
            raise ValueError(f"body field {name!r} is not supported by cbrun; remove it from the request")
    return overrides


def _field(convert, name: str, value: Any) -> Any:
    try:
        return convert(value)
    except ValueError as exc:
        raise ValueError(f"body.{name}: {exc}") from None


def _text_field(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"body.{name} must be a string, got {value!r}")
    return value


def _top_logprobs(fields_: dict[str, Any], chat: bool) -> int | None:
    """Pop ``logprobs`` / ``top_logprobs``: chat takes ``logprobs: true`` and ``top_logprobs: k``, completions
    ``logprobs: k``. Returns k, or None when log-probabilities are not asked."""
    logprobs = fields_.pop("logprobs", None)
    top = fields_.pop("top_logprobs", None)
    if not chat:
        if top is not None:
            raise ValueError("body field 'top_logprobs' is a chat field; /v1/completions takes body.logprobs = k")
        if logprobs is None:
            return None
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0:
            raise ValueError(
                f"body.logprobs must be an integer >= 0 (top log-probabilities per token), got {logprobs!r}"
            )
        return logprobs
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ValueError(f"body.logprobs must be true or false, got {logprobs!r}")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
        raise ValueError(f"body.top_logprobs must be an integer >= 0, got {top!r}")
    if top is not None and not logprobs:
        raise ValueError("body.top_logprobs needs body.logprobs = true")
    return (top or 0) if logprobs else None


def chat_messages(value: Any) -> list[dict[str, str]]:
    """``body.messages`` as [{"role", "content"}]; text content parts are joined.

    Raises:
        ValueError: naming the message, for missing messages, a turn without role, or non-text content.
    """
    if value is None:
        raise ValueError("body.messages is missing")
    if not isinstance(value, list) or not value:
        raise ValueError("body.messages must be a non-empty list of {role, content} objects")
    messages = []
    for k, turn in enumerate(value):
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str):
            raise ValueError(f"body.messages[{k}] must be an object with a text role")
        messages.append({"role": turn["role"], "content": _message_content(turn.get("content"), k)})
    return messages


def _message_content(content: Any, k: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ValueError(
        f"body.messages[{k}].content must be text (a string or a list of text parts), got {json.dumps(content)[:60]}"
    )


def completion_prompt(value: Any) -> tuple[str | None, list[int] | None]:
    """``body.prompt`` as (text, None) or (None, token ids); a list of one prompt is that prompt.

    Raises:
        ValueError: for a missing or empty prompt, several prompts, or a negative token id.
    """
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if value is None:
        raise ValueError("body.prompt is missing")
    if isinstance(value, str):
        if not value:
            raise ValueError("body.prompt is empty")
        return value, None
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if min(value) < 0:
            raise ValueError("body.prompt holds a negative token id")
        return None, list(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        raise ValueError(f"body.prompt holds {len(value)} prompts; cbrun takes one prompt per request line")
    raise ValueError("body.prompt must be a string or a list of token ids")


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
    ):
        names = input_fields(path)
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
        where = f"row {row.row_index} (custom_id {row.id!r})"
        try:
            request = parse_request(extra["method"], extra["url"], extra["body"])
            row.extra[keep_role("model")] = request.model or self.default_model
            row.extra[keep_role("top_logprobs")] = request.top_logprobs
            row.sampling_overrides = request.overrides
            row.num_samples = request.num_samples
            row.prompt_token_ids = self._prompt_ids(request)
        except ValueError as exc:
            row.error = f"{where}: {exc}"
        return row

    def _prompt_ids(self, request: BatchRequest) -> list[int]:
        if request.messages is not None:
            return encode_chat(self.tokenizer, request.messages)
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        return encode_prompt(self.tokenizer, request.prompt)
