"""Speculative decoding: n-gram proposals (prompt lookup decoding), the policy, and greedy acceptance.

A decoding request whose own tokens predict what comes next is scheduled with ``1 + k`` query tokens: its last
known token and ``k`` proposed ones. One forward pass gives the target model's logits at all ``k + 1`` positions;
proposals are accepted while each equals the target's argmax at the position before it, and the target's argmax
after the last accepted one is the bonus token, so a verify step yields 1 to ``k + 1`` tokens, exactly the ones
plain greedy decoding would have produced (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling";
Saxena 2023, "Prompt Lookup Decoding"); draft-model proposals are in ``engine.draft_proposer``. The split of work
follows vLLM v1: the scheduler asks for proposals (``spec_token_ids``) and commits the accepted tokens through its
stop check, the block manager rolls back the slots of rejected ones, the model runner computes logits at every
verified position. The code is ours.
"""

from __future__ import annotations

import logging
import weakref

from engine.config import EngineConfig
from engine.request import Request

logger = logging.getLogger("cbrun.engine")

#: Id of a proposal slot planned for a draft model's token (``speculative = "draft"``): the scheduler plans the
#: slots, ``engine.draft_proposer.DraftProposer`` fills them in before the target's forward pass.
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
        tokens = self.token_ids
        num_tokens = len(tokens)
        if k <= 0 or num_tokens <= self.ngram_min:
            return []
        self._index_through(num_tokens - 1)
        for n in range(min(self.ngram_max, num_tokens - 1), self.ngram_min - 1, -1):
            end = self._latest[n - self.ngram_min].get(tuple(tokens[num_tokens - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []

    def _index_through(self, stop: int) -> None:
        """Index every n-gram ending at or before position ``stop`` (exclusive end)."""
        tokens, low = self.token_ids, self.ngram_min
        for end in range(self._num_indexed + 1, stop + 1):
            for n in range(low, min(self.ngram_max, end) + 1):
                self._latest[n - low][tuple(tokens[end - n:end])] = end
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


def accept_greedy(proposals: list[int], target_argmax: list[int]) -> list[int]:
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
    return target_argmax[:accepted + 1]


class Speculator:
    """The scheduler's speculation policy: whether to speculate this step, and the proposals of one request.

    Speculation runs only while at most ``speculative_max_batch`` requests are running (verifying costs compute
    that a full batch does not have to spare); the switch is logged the first time it happens each way.

    Args:
        config: the engine settings (``speculative``, ``num_speculative_tokens``, ``ngram_*``,
            ``speculative_max_batch``).

    Attributes:
        num_proposed_tokens: proposals verified so far.
        num_accepted_tokens: of those, accepted.
        num_verify_steps: request-steps that verified at least one proposal.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.k = config.num_speculative_tokens
        self.max_batch = config.speculative_max_batch
        self.method = config.speculative
        self.proposer = NgramProposer(config.ngram_min, config.ngram_max) if self.method == "ngram" else None
        self.num_proposed_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verify_steps = 0
        self._indexes: weakref.WeakKeyDictionary[Request, NgramIndex] = weakref.WeakKeyDictionary()
        self._active: bool | None = None  # the last step's decision
        self._logged: set[bool] = set()

    def active(self, num_running: int) -> bool:
        """Whether this step speculates, given the running requests; logs the first switch each way."""
        active = num_running <= self.max_batch
        # NOTE: a run that starts above the switch logs "paused" at its first step (speculating is the default).
        switched = active != self._active and (self._active is not None or not active)
        if switched and active not in self._logged:
            self._logged.add(active)
            logger.info("speculative decoding %s: %d requests running (speculative_max_batch = %d)",
                        "resumed" if active else "paused, decoding plainly", num_running, self.max_batch)
        self._active = active
        return active

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Proposals for a request from its known tokens (prompt then output), at most ``min(k, max_tokens)``;
        with a draft model, that many ``DRAFT_PLACEHOLDER`` slots (the draft runs batched once the step is planned).

        The request's ``NgramIndex`` is kept between steps and only its new tokens are added (a request's known
        tokens only grow while it runs); it goes when the request does (a weak reference).
        """
        if self.proposer is None:
            return [DRAFT_PLACEHOLDER] * max(0, min(self.k, max_tokens))
        index = self._indexes.get(request)
        if index is None:
            index = self._indexes[request] = self.proposer.new_index()
        num_prompt, num_indexed = request.num_prompt_tokens, len(index.token_ids)
        assert num_indexed <= request.num_known_tokens, "a request's known tokens shrank while it ran"
        if num_indexed < num_prompt:
            index.extend(request.prompt_token_ids[num_indexed:])
            num_indexed = num_prompt
        index.extend(request.output_token_ids[num_indexed - num_prompt:])
        return index.propose(min(self.k, max_tokens))

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """Count one verify step's proposals and accepted ones."""
        self.num_proposed_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.num_verify_steps += 1
