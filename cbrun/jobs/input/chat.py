"""Chat mode (``input.chat = true``): a row's prompt ids are the tokenizer's chat template applied to a conversation.

The conversation is the row's ``input.messages_column`` (a list of {role, content} structs), or else its prompt
text (``input.prompt_column`` or ``input.template``) as one user turn. ``input.system_prompt``, when set, is put
first as a system turn unless the conversation already starts with one. The ids are
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``: the template writes its own
special tokens (BOS), none are added on top.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from cbrun.jobs.input.arrow_types import is_list_type, is_text_type
from cbrun.jobs.input.errors import InputError


def check_chat_template(tokenizer, model_path: str) -> None:
    """Raise ``ValueError`` naming the fix when the tokenizer has no chat template."""
    if getattr(tokenizer, "chat_template", None):
        return
    raise ValueError(
        f"input.chat = true, but the tokenizer in {model_path!r} has no chat template; use a chat "
        f"(instruction-tuned) model whose tokenizer has one (tokenizer_config.json 'chat_template' or "
        f"chat_template.jinja), e.g. --model PATH, or set input.chat = false and write the prompt "
        f"format with input.template"
    )


def check_messages_column(schema: pa.Schema, column: str, path: str) -> None:
    """Raise ``InputError`` unless ``column`` is a list of structs with text fields ``role`` and ``content``."""
    kind = schema.field(column).type
    ok = is_list_type(kind) and pa.types.is_struct(kind.value_type)
    if ok:
        names = {
            kind.value_type.field(i).name: kind.value_type.field(i).type for i in range(kind.value_type.num_fields)
        }
        ok = all(name in names and is_text_type(names[name]) for name in ("role", "content"))
    if not ok:
        raise InputError(
            f"input.messages_column {column!r} of {path!r} must be a list of structs with text fields "
            f"role and content, but its type is {kind}"
        )


def read_messages(value: Any) -> list[dict[str, str]]:
    """A messages column value as a list of {"role", "content"} dicts.

    Raises:
        ValueError: for a null or empty conversation or a turn with a null role or content.
    """
    if value is None:
        raise ValueError("messages column is null")
    if not value:
        raise ValueError("messages column holds no turns")
    messages = []
    for k, turn in enumerate(value):
        if turn is None or turn.get("role") is None or turn.get("content") is None:
            raise ValueError(f"messages turn {k} has a null role or content")
        messages.append({"role": turn["role"], "content": turn["content"]})
    return messages


def conversation(
    prompt: str | None, messages_value: Any, has_messages_column: bool, system_prompt: str | None
) -> list[dict[str, str]]:
    """The row's conversation: its messages, or its prompt as one user turn; the system prompt put first."""
    messages = read_messages(messages_value) if has_messages_column else [{"role": "user", "content": prompt}]
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Prompt ids of a conversation with the generation prompt (the assistant turn's header) appended."""
    try:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    except Exception as exc:  # NOTE: a template may raise anything (jinja errors, its own raise_exception)
        raise ValueError(f"the chat template cannot be applied: {type(exc).__name__}: {exc}") from None
    return list(encoded["input_ids"])
