"""Stop strings: detect them in a request's generated text and cut the output before the first one."""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    """What a stop-string check needs of a tokenizer (``FastTokenizer`` and transformers' tokenizers have it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class StopStringMatcher:
    """Finds stop strings in generated text with a tokenizer's ``decode``.

    Each step decodes only a tail of the output long enough to hold any stop string (a character may take up to
    4 byte-fallback tokens), so the per-step cost does not grow with the output. The exact cut is computed once,
    when a stop string is found.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=True) -> str``.
    """

    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def find(self, output_token_ids: list[int], stops: tuple[str, ...]) -> str | None:
        """The stop string present in the output's tail, or None."""
        tail_tokens = 4 * max(len(s) for s in stops) + 4
        tail = self._decode(output_token_ids[-tail_tokens:])
        return next((s for s in stops if s in tail), None)

    def cut(
        self, output_token_ids: list[int], stops: tuple[str, ...], include: bool = False
    ) -> tuple[str, list[int], str]:
        """Cut the output exactly before the earliest stop string (after it, with ``include``).

        Returns:
            (text before the stop string, the longest prefix of the token ids whose text is a prefix of it, the
            stop string). When a stop string begins inside a token, the text keeps that token's leading part and
            the ids end before that token. With ``include`` (vLLM's ``include_stop_str_in_output``) the text ends
            with the stop string and the ids with the token that completes it.
        """
        text = self._decode(output_token_ids)
        index, stop = min((text.find(s), s) for s in stops if s in text)
        if include:
            kept_text = text[: index + len(stop)]
            for n in range(1, len(output_token_ids) + 1):
                if self._decode(output_token_ids[:n]).startswith(kept_text):
                    return kept_text, output_token_ids[:n], stop
            return kept_text, list(output_token_ids), stop
        kept_text = text[:index]
        for n in range(len(output_token_ids), -1, -1):
            if kept_text.startswith(self._decode(output_token_ids[:n])):
                return kept_text, output_token_ids[:n], stop
        return kept_text, [], stop
