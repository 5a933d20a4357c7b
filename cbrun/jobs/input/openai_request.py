"""OpenAI batch request bodies: one line's ``method``, ``url`` and ``body`` parsed into a ``BatchRequest``.

The rules of ``cbrun.jobs.input.openai_batch``'s format, field by field:

- ``/v1/chat/completions``: ``body.messages`` as [{"role", "content"}] (``chat_messages``);
- ``/v1/completions``: ``body.prompt`` is text or a list of token ids (``completion_prompt``);
- the body's sampling fields become ``SamplingParams`` overrides (``BODY_FIELDS``); a field that is absent or null
  keeps the job's value;
- ``response_format`` (``json_object``, ``json_schema``) becomes a ``StructuredOutputsParams`` (``response_format``);
- an unknown url or method, a missing body, or a body field cbrun cannot honour raises ``ValueError``, naming the
  field. A field set to its neutral value (``"stream": false``, ``"logit_bias": {}``...) is accepted.

The reader (``cbrun.jobs.input.openai_batch.OpenAIBatchReader``) turns such an error into the row's error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cbrun.engine.sampling_params import coerce_num_samples, coerce_sampling_value
from cbrun.engine.structured_output import StructuredOutputsParams, coerce_structured_outputs

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
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
