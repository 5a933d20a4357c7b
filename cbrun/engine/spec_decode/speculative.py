"""Speculative decoding: n-gram proposals (prompt lookup decoding), the policy, and greedy acceptance.

A decoding request whose own tokens predict what comes next is scheduled with ``1 + k`` query tokens: its last
known token and ``k`` proposed ones. One forward pass gives the target model's logits at all ``k + 1`` positions;
proposals are accepted while each equals the target's argmax at the position before it, and the target's argmax
after the last accepted one is the bonus token, so a verify step yields 1 to ``k + 1`` tokens, exactly the ones
plain greedy decoding would have produced (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling";
Saxena 2023, "Prompt Lookup Decoding"); draft-model proposals are in ``cbrun.engine.spec_decode.draft_proposer``. The split of work
follows vLLM v1: the scheduler asks for proposals (``spec_token_ids``) and commits the accepted tokens through its
stop check, the block manager rolls back the slots of rejected ones, the model runner computes logits at every
verified position. The code is ours.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from cbrun.engine.config import EngineConfig
from cbrun.engine.core.request import Request

logger = logging.getLogger("cbrun.engine")

#: Id of a proposal slot planned for a draft model's token (``speculative = "draft"``): the scheduler plans the
#: slots, ``cbrun.engine.spec_decode.draft_proposer.DraftProposer`` fills them in before the target's forward pass.
DRAFT_PLACEHOLDER = -2


class NgramIndex:
    """The n-grams of one growing token sequence, indexed as its tokens arrive, for prompt lookup.

    ``latest[n - ngram_min]`` maps each n-gram seen so far (a tuple) to the end (exclusive) of its latest
    occurrence. N-grams are indexed up to, not including, the sequence's last token, so a lookup of the suffix finds
    only earlier occurrences. Each new token costs ``ngram_max - ngram_min + 1`` dictionary updates, once: a decode
    step's lookup does not rescan the sequence (vLLM's n-gram proposer scans the whole context every step).

    Args:
        ngram_min, ngram_max: the n-gram lengths indexed (1 <= ngram_min <= ngram_max).

    Attributes:
        token_ids: the sequence so far (the caller appends with ``extend``).
    """

    __slots__ = ("ngram_min", "ngram_max", "token_ids", "_latest", "_num_indexed")

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.token_ids: list[int] = []
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram_min, ngram_max + 1)]
        self._num_indexed = 0  # n-grams ending at or before this position are in ``_latest``

    def extend(self, token_ids) -> None:
        """Append tokens to the sequence (they are indexed lazily, at the next ``propose``)."""
        self.token_ids.extend(token_ids)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last n tokens.

        n runs from ``ngram_max`` down to ``ngram_min``; the first n with an earlier occurrence wins, so a longer
        context match is preferred. Empty when nothing matches or ``k`` is 0.
        """
        if k <= 0:
            return []
        end, n = self.lookup()
        return self.token_ids[end : end + k] if n else []

    def lookup(self) -> tuple[int, int]:
        """``(end, n)``: the longest suffix n-gram (``ngram_max`` down to ``ngram_min``) that occurred earlier, and
        the end (exclusive) of its latest earlier occurrence, where the proposals start; ``(0, 0)`` when none."""
        tokens, low = self.token_ids, self.ngram_min
        num_tokens = len(tokens)
        if num_tokens <= low:
            return 0, 0
        if self._num_indexed < num_tokens - 1:
            self._index_through(num_tokens - 1)
        latest = self._latest
        for n in range(min(self.ngram_max, num_tokens - 1), low - 1, -1):
            end = latest[n - low].get(tuple(tokens[num_tokens - n :]))
            if end is not None:
                return end, n
        return 0, 0

    def _index_through(self, stop: int) -> None:
        """Index every n-gram ending at or before position ``stop`` (exclusive end)."""
        tokens, low, high = self.token_ids, self.ngram_min, self.ngram_max
        pairs = list(enumerate(self._latest, low))  # (n, its map)
        for end in range(self._num_indexed + 1, stop + 1):
            if end < high:  # the sequence's first tokens: n-grams no longer than the prefix
                for n, latest in pairs[: end - low + 1]:
                    latest[tuple(tokens[end - n : end])] = end
            else:
                for n, latest in pairs:
                    latest[tuple(tokens[end - n : end])] = end
        self._num_indexed = max(self._num_indexed, stop)


class NgramProposer:
    """Proposes the tokens that followed the latest earlier occurrence of the sequence's last n tokens.

    For n from ``ngram_max`` down to ``ngram_min``, the last n tokens are searched for earlier in the same
    sequence (prompt and output); at the latest match, the up to ``k`` tokens that followed it are proposed. The
    first n with a match wins, so a longer context match is preferred. A running request keeps one ``NgramIndex``
    (``new_index``) that grows with it; ``propose`` is the same lookup over a whole sequence at once.

    Args:
        ngram_min, ngram_max: the n-gram lengths tried (1 <= ngram_min <= ngram_max).
    """

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def new_index(self) -> NgramIndex:
        """An empty index for one sequence."""
        return NgramIndex(self.ngram_min, self.ngram_max)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` proposed next tokens for a sequence (empty when nothing matches or ``k`` is 0).

        Args:
            token_ids: the request's known tokens, prompt then output.
            k: most tokens to propose.
        """
        index = self.new_index()
        index.extend(token_ids)
        return index.propose(k)


def accept_greedy(proposals: Sequence[int], target_argmax: list[int]) -> list[int]:
    """The tokens a greedy verify step commits: the accepted proposals, then the bonus token.

    Args:
        proposals: the ``k`` proposed tokens.
        target_argmax: ``k + 1`` target argmax tokens; ``target_argmax[i]`` follows the verified input ``i``
            (input 0 is the last known token, input ``i > 0`` is ``proposals[i - 1]``).

    Returns:
        ``target_argmax[:a + 1]``, where ``a`` is the number of leading proposals equal to the target's choice.
    """
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == target_argmax[accepted]:
        accepted += 1
    return target_argmax[: accepted + 1]


#: What a request's verify entry costs beyond its proposals' rows, in rows: the host's per-entry work (proposals,
#: verification, rollback) and the projections' switch from a matrix-vector to a matrix product for its rows.
#: Measured with stories260K on 2 CPU cores: about 0.15 ms per verifying request against 0.1 ms per row and a
#: 3.9 ms step (``benchmarks/results-speculative.md``).
VERIFY_ENTRY_ROWS = 1.0
#: Acceptance evidence of a request that has verified nothing yet: one accepted proposal out of one, so its first
#: verify step proposes the full ``k`` (and one rejection halves its estimate).
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 1.0
#: Weight of a request's older verify steps against its latest one (exponential forgetting: acceptance changes
#: along an output, e.g. when a repeated passage starts or ends).
ACCEPTANCE_DECAY = 0.8
#: Evidence added, as if one proposal in twenty were accepted, at each step a backed-off request skips: its
#: estimate creeps back up, so it probes with one proposal now and then and resumes when its text starts to repeat.
BACKOFF_PROBE = 0.05


def verify_threshold(row_cost: float, num_rows: int, num_tokens: int) -> float:
    """The least expected tokens a proposal must add for a step to stay at least as fast as plain decoding.

    A step's cost is modelled as ``1 + row_cost * query rows`` (a fixed part, then a share per query row). A plain
    step of ``num_rows`` query rows yields ``num_tokens`` tokens; one more row (a proposal) costs ``row_cost`` and
    yields, on average, the chance it is accepted. Adding rows whose expected tokens per unit of cost exceed the
    plain step's ``num_tokens / (1 + row_cost * num_rows)`` only raises the step's tokens per unit of cost, so a
    step whose every proposal clears this threshold is, in expectation, no slower than plain decoding.

    Args:
        row_cost: a query row's cost as a fraction of a step's fixed cost (``EngineConfig.speculative_row_cost``).
        num_rows: query rows of the step without proposals; num_tokens: tokens it yields (both >= 0).

    Returns:
        The threshold in tokens per proposal, in [0, 1) (0 when rows cost nothing).
    """
    return row_cost * num_tokens / (1.0 + row_cost * num_rows)


def proposal_length(acceptance: float, threshold: float, k: int, entry_rows: float = VERIFY_ENTRY_ROWS) -> int:
    """How many proposals pay: the most ``j <= k`` whose chance of all being accepted, ``acceptance ** j``, exceeds
    ``threshold`` (the j-th proposal adds a token only when the j - 1 before it were accepted; acceptance is
    modelled as independent per position, the geometric model of Leviathan et al. 2023, section 3.3), or 0 when
    even those ``j`` do not pay for the verify entry too: their expected tokens ``acceptance + ... +
    acceptance ** j`` must reach ``(j + entry_rows) * threshold``, a verify entry costing ``entry_rows`` rows
    beyond its proposals' (``VERIFY_ENTRY_ROWS``). That ``j`` is the best length: each proposal up to it adds
    more than its row costs, each after it less."""
    length, chance, tokens = 0, 1.0, 0.0
    while length < k and chance * acceptance > threshold:
        chance *= acceptance
        tokens += chance
        length += 1
    return length if tokens >= (length + entry_rows) * threshold else 0


class _RequestSpeculation:
    """One running request's speculation state: its n-gram index and its recent acceptance evidence.

    The evidence is kept apart per kind of proposal, because how often a proposal is accepted depends on what it
    was drawn from: for n-gram lookup one estimate per match length n (a token that followed an earlier 4-gram
    match is accepted far more often than one that followed a single matching token), for a draft model one.
    ``accepted[i] / trials[i]`` estimates the chance that a proposal of kind ``i`` is accepted given those before it
    were: a verify step that accepted ``a`` of ``j`` proposals counts ``a`` successes in ``a`` trials, plus one
    failed trial when ``a < j`` (the rejected one; the proposals after it were never tried).
    """

    __slots__ = ("index", "greedy", "accepted", "trials", "verifying")

    def __init__(self, index: NgramIndex | None, greedy: bool, num_kinds: int) -> None:
        self.index = index
        self.greedy = greedy  # the request's sampling params are fixed once it is made
        self.accepted = [PRIOR_ACCEPTED] * num_kinds
        self.trials = [PRIOR_TRIALS] * num_kinds
        self.verifying = 0  # the kind of the proposals in flight (``observe`` credits it)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        kind = self.verifying
        self.accepted[kind] = ACCEPTANCE_DECAY * self.accepted[kind] + num_accepted
        self.trials[kind] = ACCEPTANCE_DECAY * self.trials[kind] + num_accepted + (num_accepted < num_proposed)

    def skip(self, kind: int) -> None:
        self.accepted[kind] += BACKOFF_PROBE
        self.trials[kind] += BACKOFF_PROBE


class Speculator:
    """The scheduler's speculation policy: whether to speculate this step, and the proposals of one request.

    Two rules decide, so that speculation never costs more than it saves:

    - the batch switch: speculation runs only while at most ``speculative_max_batch`` requests are running; the
      switch is logged the first time it happens each way;
    - the cost rule, per request and step: a request proposes ``proposal_length(acceptance, threshold, k)``
      tokens, where ``acceptance`` is its own recent acceptance rate for proposals of this kind (n-gram lookup:
      of this match length; ``_RequestSpeculation``) and ``threshold`` is ``verify_threshold`` for the step's
      running requests; the proposals must also pay for their verify entry (``VERIFY_ENTRY_ROWS``). A request
      whose proposals keep being rejected thus backs off to plain decoding, and probes again now and then
      (``BACKOFF_PROBE``); a large batch, where a query row costs more relative to the tokens a step already
      yields, asks for a higher acceptance rate. The
      rule reads only the requests' own tokens and counts, so a run's plans are reproducible (no timing); a
      sampled (non-greedy) row uses the threshold of a batch of one, so its draws never depend on its batch.
      Similar rules: vLLM's ``speculative_disable_by_batch_size`` switches off by running-queue size, and
      TensorRT-LLM's ``acceptance_rate_threshold`` on a low rolling acceptance rate (for the whole engine); the
      per-request, acceptance-driven length follows "dynamic speculation lookahead" (Mamou et al. 2024). The code
      is ours.

    Args:
        config: the engine settings (``speculative``, ``num_speculative_tokens``, ``ngram_*``,
            ``speculative_max_batch``, ``speculative_row_cost``).

    Attributes:
        num_proposed_tokens: proposals verified so far.
        num_accepted_tokens: of those, accepted.
        num_verify_steps: request-steps that verified at least one proposal.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.k = config.num_speculative_tokens
        self.max_batch = config.speculative_max_batch
        self.row_cost = config.speculative_row_cost
        self.method = config.speculative
        self.proposer = NgramProposer(config.ngram_min, config.ngram_max) if self.method == "ngram" else None
        self.ngram_min = config.ngram_min
        self.num_proposed_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verify_steps = 0
        self._active: bool | None = None  # the last step's decision
        self._logged: set[bool] = set()
        self.threshold = 0.0  # this step's ``verify_threshold``
        self._solo_threshold = verify_threshold(self.row_cost, 1, 1)  # a sampled row's (see ``propose``)

    def active(self, num_running: int) -> bool:
        """Whether this step speculates, given the running requests; logs the first switch each way.

        Also sets the step's ``threshold``: each running request is counted as one query row and one token (a
        prefill chunk has more rows and may yield none, which only lowers the true threshold: the estimate errs
        towards plain decoding).
        """
        active = num_running <= self.max_batch
        # NOTE: a run that starts above the switch logs "paused" at its first step (speculating is the default).
        switched = active != self._active and (self._active is not None or not active)
        if switched and active not in self._logged:
            self._logged.add(active)
            logger.info(
                "speculative decoding %s: %d requests running (speculative_max_batch = %d)",
                "resumed" if active else "paused, decoding plainly",
                num_running,
                self.max_batch,
            )
        self._active = active
        self.threshold = verify_threshold(self.row_cost, num_running, num_running)
        return active

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Proposals for a request this step, at most ``min(k, max_tokens)`` and as many as the cost rule pays for:
        from its known tokens (prompt then output) with n-gram lookup, or that many ``DRAFT_PLACEHOLDER`` slots
        with a draft model (the draft runs batched once the step is planned). Empty when none pay.

        The request's state (``_RequestSpeculation``, in ``Request.speculation``) is kept between steps; its
        ``NgramIndex`` only adds the tokens that are new since the last lookup (a request's known tokens only grow
        while it runs). The evidence read is that of the proposal's kind (the n-gram match's length), so the
        lookup comes first; a step without a match proposes nothing and leaves the evidence as it is. A backed-off
        kind costs one comparison and two additions.
        """
        state = request.speculation
        if state is None:
            state = request.speculation = self._new_state(request)
        if max_tokens <= 0:
            return []
        index = state.index
        if index is None:
            kind = 0
        else:
            end, n = self._lookup(index, request)
            if not n:
                return []
            kind = n - self.ngram_min
        # A sampled row's draws depend on how many proposals it verifies: its threshold is the one of a batch of
        # one, so that its proposals, like its random stream, depend only on its own tokens (seeded rows stay
        # reproducible and independent of their batch); a greedy row's tokens do not depend on its proposals.
        threshold = self.threshold if state.greedy else self._solo_threshold
        accepted, trials = state.accepted[kind], state.trials[kind]
        # Backed off: the first test is the cheap one (no proposal pays its row), the length's the exact one.
        length = (
            0
            if accepted <= threshold * trials
            else proposal_length(accepted / trials, threshold, min(self.k, max_tokens))
        )
        if not length:
            state.skip(kind)
            return []
        state.verifying = kind
        if index is None:
            return [DRAFT_PLACEHOLDER] * length
        return index.token_ids[end : end + length]

    def _new_state(self, request: Request) -> _RequestSpeculation:
        if self.proposer is None:
            return _RequestSpeculation(None, request.sampling_params.greedy, 1)
        return _RequestSpeculation(
            self.proposer.new_index(), request.sampling_params.greedy, self.proposer.ngram_max - self.ngram_min + 1
        )

    @staticmethod
    def _lookup(index: NgramIndex, request: Request) -> tuple[int, int]:
        """``index.lookup()`` after appending the request's tokens that are new since the last one."""
        tokens, output = index.token_ids, request.output_token_ids
        num_prompt, num_indexed = len(request.prompt_token_ids), len(tokens)
        if num_indexed < num_prompt:
            tokens += request.prompt_token_ids[num_indexed:]
            num_indexed = num_prompt
        tokens += output[num_indexed - num_prompt :]
        assert len(tokens) == num_prompt + len(output), "a request's known tokens shrank while it ran"
        return index.lookup()

    def record(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """Count one verify step's proposals and accepted ones (totals, and the request's own evidence)."""
        self.num_proposed_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.num_verify_steps += 1
        if request.speculation is not None:
            request.speculation.observe(num_proposed, num_accepted)
