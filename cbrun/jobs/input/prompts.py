"""Prompt text to token ids, with BOS added once.

A tokenizer that adds BOS (Llama's and most others) would give a prompt that already begins with the BOS string
(a chat prompt rendered before it reached cbrun) two BOS tokens, ``[bos, bos, ...]``, which the model never saw in
training. vLLM and transformers' chat path avoid it by not adding special tokens to text that already holds them;
here the encoding is made with them, and a doubled leading BOS is dropped, so every other prompt encodes exactly as
``tokenizer.encode`` does.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("cbrun.job")

_LOGGED: set[int] = set()  # id()s of tokenizers whose dropped BOS was logged (once per tokenizer and process)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """``tokenizer.encode(text)``, without a second BOS when ``text`` already begins with the BOS token.

    Args:
        tokenizer: a transformers tokenizer (``encode``, ``bos_token``, ``bos_token_id``).
        text: the prompt.

    Returns:
        The prompt ids; BOS appears once at the start when the tokenizer adds it or the text holds it.
    """
    ids = list(tokenizer.encode(text))
    bos, bos_text = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "bos_token", None)
    if bos is None or not bos_text or len(ids) < 2 or ids[0] != bos or ids[1] != bos or not text.startswith(bos_text):
        return ids
    if id(tokenizer) not in _LOGGED:
        _LOGGED.add(id(tokenizer))
        logger.info("prompts that already begin with the BOS token %r get no second one (logged once)", bos_text)
    return ids[1:]
