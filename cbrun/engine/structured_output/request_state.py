"""A request's grammar state: its compiled grammar (once ready) and the matcher that follows its output."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from cbrun.engine.structured_output.params import StructuredOutputsParams


class GuidanceMatcher:
    """An ``llguidance.LLMatcher`` behind the ``xgrammar.GrammarMatcher`` methods this package calls, so the
    scheduler, the stop check and the bitmask treat both engines' requests alike. llguidance's mask is the same
    layout (int32 words, bit ``t % 32`` of word ``t // 32``).

    llguidance stops as soon as the structure is complete, where xgrammar then still wants the EOS token: here,
    as with xgrammar, the matcher is terminated only once an EOS is accepted (once stopped, its mask allows only
    the EOS tokens), so a completion ends the same way under both engines.
    """

    def __init__(self, grammar) -> None:
        self.matcher = grammar.new_matcher()
        self._eos = grammar.eos_token_ids
        self._ended = False

    def accept_token(self, token: int) -> bool:
        accepted = self.matcher.consume_token(token)
        self._ended = accepted and token in self._eos
        return accepted

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self._ended = False  # an EOS is always the last token accepted

    def is_terminated(self) -> bool:
        return self._ended

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)


class StructuredOutputRequest:
    """The constraint of one request: a future of its compiled grammar, then an ``xgrammar.GrammarMatcher`` (or,
    for a grammar compiled by llguidance, a ``GuidanceMatcher``).

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
        from cbrun.engine.structured_output.compiler import GuidanceGrammar

        if isinstance(compiled, GuidanceGrammar):
            self._matcher = GuidanceMatcher(compiled)
        else:
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

    @property
    def matcher(self):
        """The ``xgrammar.GrammarMatcher`` or ``GuidanceMatcher`` (None until ``ready`` has built it)."""
        return self._matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, bit ``t % 32`` of word ``t // 32`` set when
        token t is allowed: xgrammar's layout); False when no token at all is allowed (the tokenizer cannot
        express the constraint's next character)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        return bool(bitmask[row].any())


def fill_bitmasks(states: list[StructuredOutputRequest], bitmask: torch.Tensor, rows: list[int]) -> list[bool]:
    """``fill_bitmask`` of many ready requests in one call per engine (xgrammar's ``BatchGrammarMatcher``;
    llguidance's ``LLExecutor`` on torch's thread count) into the one
    bitmask: ``states[i]`` fills ``bitmask[rows[i]]``. One call instead of one per request is most of a decode
    step's grammar time at 256 rows.

    Returns:
        Per request, whether its row allows any token (``fill_bitmask``'s result).
    """
    if not states:
        return []
    guided = [
        (state.matcher.matcher, row) for state, row in zip(states, rows) if isinstance(state.matcher, GuidanceMatcher)
    ]
    if len(guided) < len(states):
        import xgrammar as xgr

        plain = [
            (state.matcher, row) for state, row in zip(states, rows) if not isinstance(state.matcher, GuidanceMatcher)
        ]
        # NOTE: one per call (about 10 us to build): engines on other threads never share its thread pool
        xgr.BatchGrammarMatcher().batch_fill_next_token_bitmask([m for m, _ in plain], bitmask, [r for _, r in plain])
    if guided:
        import llguidance.torch

        # NOTE: one call that drops the GIL once for every row: the fill runs beside the forward pass on another
        # thread (``LLMEngine._start_grammar_bitmask``), and a call per row would wait for the GIL at each row
        llguidance.torch.fill_next_token_bitmask_par(_guidance_executor(), guided, bitmask)
    index = torch.tensor(rows, dtype=torch.int64)
    return (bitmask[index] != 0).any(dim=1).tolist()


_EXECUTORS: dict[int, object] = {}


def _guidance_executor():
    """llguidance's thread pool for batched mask fills: as many threads as torch's intra-op pool (the engine's
    ``num_threads`` on the CPU, whose cores are idle while the host fills masks after the forward pass; llguidance's
    own default is 80% of the cores, one thread on two), one pool per size per process, built on first use."""
    threads = max(1, torch.get_num_threads())
    executor = _EXECUTORS.get(threads)
    if executor is None:
        import llguidance

        executor = _EXECUTORS[threads] = llguidance.LLExecutor(threads)
    return executor
