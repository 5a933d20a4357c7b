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

import numpy as np

from engine.config import EngineConfig

logger = logging.getLogger("cbrun.engine")

#: Id of a proposal slot planned for a draft model's token (``speculative = "draft"``): the scheduler plans the
#: slots, ``engine.draft_proposer.DraftProposer`` fills them in before the target's forward pass.
DRAFT_PLACEHOLDER = -2


class NgramProposer:
    """Proposes the tokens that followed the latest earlier occurrence of the sequence's last n tokens.

    For n from ``ngram_max`` down to ``ngram_min``, the last n tokens are searched for earlier in the same
    sequence (prompt and output); at the latest match, the up to ``k`` tokens that followed it are proposed. The
    first n with a match wins, so a longer context match is preferred.

    Args:
        ngram_min, ngram_max: the n-gram lengths tried (1 <= ngram_min <= ngram_max).
    """

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` proposed next tokens for a sequence (empty when nothing matches or ``k`` is 0).

        Args:
            token_ids: the request's known tokens, prompt then output.
            k: most tokens to propose.
        """
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens <= self.ngram_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.ngram_max, num_tokens - 1), self.ngram_min - 1, -1):
            # Windows starting at 0 .. num_tokens - n - 1: every earlier occurrence, not the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return token_ids[start:start + k]
        return []


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
        self._active: bool | None = None  # the last step's decision
        self._logged: set[bool] = set()

    def active(self, num_running: int) -> bool:
        """Whether this step speculates, given the running requests; logs the first switch each way."""
        active = num_running <= self.max_batch
        if self._active is not None and active != self._active and active not in self._logged:
            self._logged.add(active)
            logger.info("speculative decoding %s: %d requests running (speculative_max_batch = %d)",
                        "resumed" if active else "paused, decoding plainly", num_running, self.max_batch)
        self._active = active
        return active

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Proposals for a request whose known tokens are ``token_ids``, at most ``min(k, max_tokens)``; with a
        draft model, that many ``DRAFT_PLACEHOLDER`` slots (the draft runs batched once the step is planned)."""
        if self.proposer is None:
            return [DRAFT_PLACEHOLDER] * max(0, min(self.k, max_tokens))
        return self.proposer.propose(token_ids, min(self.k, max_tokens))

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """Count one verify step's proposals and accepted ones."""
        self.num_proposed_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.num_verify_steps += 1
