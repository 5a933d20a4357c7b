"""lm-eval's scoring requests as cbrun's engine runs them, built by lm-eval's ``hf`` rules (lm-eval 0.4.13).

This module owns the request encoding of ``cbrun.jobs.integrations.lm_eval_backend.CbrunLM``: the scoring window of a
(context, continuation) pair (``loglikelihood_request``), the strings ``TemplateLM.loglikelihood`` will encode
(``pair_encode_keys``), ``hf``'s rolling windows (``rolling_windows``), the submission order that computes each
shared context once (``scoring_order``), a scoring request's sampling parameters (``score_params``) and a sampled
generation's seed (``request_seed``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Iterator

from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from cbrun.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class LoglikelihoodRequest:
    """One scoring request as the engine runs it.

    Attributes:
        prompt_token_ids: the tokens ``hf`` feeds plus the last continuation token (``hf`` drops it from the input
            because nothing predicts from it; the engine runs it, and drops what its last position samples).
        prompt_logprobs_from: first position whose log-probability counts: ``len(prompt) - len(continuation)``.
    """

    prompt_token_ids: tuple[int, ...]
    prompt_logprobs_from: int

    @property
    def num_continuation_tokens(self) -> int:
        return len(self.prompt_token_ids) - self.prompt_logprobs_from


def loglikelihood_request(context_enc: list[int], continuation_enc: list[int], max_length: int) -> LoglikelihoodRequest:
    """The engine request that scores ``continuation_enc`` after ``context_enc`` exactly as ``hf`` does.

    ``HFLM._loglikelihood_tokens`` (lm-eval 0.4.13) feeds ``(context_enc + continuation_enc)[-(max_length + 1):][:-1]``
    (at most ``max_length`` tokens, the context cut from the left) and sums the log-probabilities the last
    ``len(continuation_enc)`` positions give the continuation tokens. Here the same window is the prompt, with its
    last token kept, and prompt log-probabilities start at the first continuation token.

    Raises:
        ValueError: for an empty context or continuation, or a continuation longer than ``max_length``
            (``hf`` asserts the same).
    """
    if not context_enc or not continuation_enc:
        raise ValueError(
            f"context ({len(context_enc)} tokens) and continuation ({len(continuation_enc)} tokens) "
            "must both encode to at least one token"
        )
    if len(continuation_enc) > max_length:
        raise ValueError(f"the continuation has {len(continuation_enc)} tokens, more than max_length = {max_length}")
    window = tuple(context_enc + continuation_enc)[-(max_length + 1) :]
    return LoglikelihoodRequest(window, len(window) - len(continuation_enc))


def pair_encode_keys(pairs: Iterable[tuple[str, str]]) -> Iterator[tuple[str, bool | None]]:
    """The ``(string, add_special_tokens)`` arguments of every ``tok_encode`` call ``TemplateLM.loglikelihood``
    makes for these ``(context, continuation)`` pairs (lm-eval 0.4.13): an empty context encodes the continuation
    without special tokens; otherwise ``_encode_pair`` moves the context's trailing whitespace to the
    continuation and encodes the whole text and the context. (A key missed here only costs an encode later.)"""
    for context, continuation in pairs:
        if context == "":
            yield continuation, False
            continue
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces > 0:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        yield context + continuation, None
        yield context, None


def rolling_windows(token_ids: list[int], prefix_token_id: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """``(context_enc, continuation_enc)`` windows that score every token of a text once, as ``hf`` makes them."""
    return [
        make_disjoint_window(w)
        for w in get_rolling_token_windows(
            token_list=token_ids, prefix_token=prefix_token_id, max_seq_len=max_length, context_len=1
        )
    ]


def scoring_order(requests, wave_size: int = 256) -> list[LoglikelihoodRequest]:
    """The order to submit scoring requests in, so that shared contexts are computed once and batches are even.

    Requests are grouped by context (the tokens before ``prompt_logprobs_from``); contexts are sorted longest first
    and taken ``wave_size`` at a time. A wave submits one request per context (it computes the context's blocks),
    then the others of its contexts (they find those blocks in the prefix cache and compute only their last
    partial block and continuation). A step thus holds requests of similar query lengths, which the CPU attention
    pads least, and a wave's contexts stay cached until its followers ran.
    """
    groups: dict[tuple[int, ...], list[LoglikelihoodRequest]] = {}
    for request in sorted(requests, key=lambda r: r.prompt_token_ids):
        groups.setdefault(request.prompt_token_ids[: request.prompt_logprobs_from], []).append(request)
    contexts = sorted(groups, key=lambda c: (-len(c), c))
    order = []
    for start in range(0, len(contexts), wave_size):
        wave = contexts[start : start + wave_size]
        order += [groups[c][0] for c in wave]
        order += [r for c in wave for r in groups[c][1:]]
    return order


def score_params(request: LoglikelihoodRequest) -> SamplingParams:
    """Prompt log-probabilities from the first continuation token, nothing generated (the engine runs the whole
    prompt and drops the greedy token its last position samples)."""
    return SamplingParams(max_new_tokens=0, temperature=0.0, seed=0, prompt_logprobs_from=request.prompt_logprobs_from)


def request_seed(seed: int, index: int) -> int:
    """A stable 63-bit seed for request ``index`` of a call under ``seed``."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little") >> 1
