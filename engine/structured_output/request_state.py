"""A request's grammar state: its compiled grammar (once ready) and the matcher that follows its output."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from engine.structured_output.params import StructuredOutputsParams


class StructuredOutputRequest:
    """The constraint of one request: a future of its compiled grammar, then an ``xgrammar.GrammarMatcher``.

    The scheduler polls ``ready`` before admitting the request and advances the matcher on each committed token
    (``accept``); the engine fills the request's bitmask rows from it (``fill_bitmask``), advancing over a verify
    step's proposals and rolling back afterwards.

    Attributes:
        params: the constraint.
        error: why the grammar cannot be used (compile failure), once known; None otherwise.
    """

    def __init__(self, params: StructuredOutputsParams, compiled: Future) -> None:
        self.params = params
        self._compiled = compiled
        self._matcher = None
        self.error: str | None = None

    @property
    def future(self) -> Future:
        return self._compiled

    def ready(self) -> bool:
        """Whether the grammar is compiled (the matcher is then built), or has failed (``error`` says why)."""
        if self._matcher is not None or self.error is not None:
            return True
        if not self._compiled.done():
            return False
        try:
            compiled = self._compiled.result()
        except Exception as exc:  # the compiler's GrammarCompileError, or anything else it raised
            self.error = str(exc)
            return True
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        return True

    def accept(self, token: int) -> bool:
        """Advance past a committed token; False when the grammar does not allow it."""
        return self._matcher.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a verify step's proposals, after their masks are filled)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """The structure is complete and its end (an EOS token) accepted: nothing more may be generated."""
        return self._matcher is not None and self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, bit ``t % 32`` of word ``t // 32`` set when
        token t is allowed: xgrammar's layout); False when no token at all is allowed (the tokenizer cannot
        express the constraint's next character)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        return bool(bitmask[row].any())
