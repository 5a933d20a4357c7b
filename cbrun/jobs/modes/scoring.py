"""Score mode: the log-probability a model gives each candidate continuation of a row's context.

A row's context is its prompt (``input.prompt_column`` or ``input.template``); its candidates come from
``input.candidates_column`` (a list<string> column, or a string column for one candidate), then one more candidate
per ``input.corruptions`` entry, derived from the first candidate (e.g. the reference answer with its final number
changed). Each candidate becomes one engine request::

    prompt = context_ids + continuation_ids,  max_new_tokens = 1 (sampled token ignored),
    prompt_logprobs_from = len(context_ids)

so the engine returns the log-probability of every continuation token and whether it was the argmax. A row's
candidates are submitted together and share the context's full KV blocks through prefix caching.

Tokenization (``input.boundary = "exact"``, the only rule here): the scored tokens decode to exactly context +
candidate. Trailing whitespace of the context first moves to the front of the candidate ("Answer: " + "18" is
scored as "Answer:" + " 18", as lm-evaluation-harness does); ``context_ids = encode(context)`` with the tokenizer's
special tokens (BOS, added once: ``cbrun.jobs.input.prompts``), as for any prompt. Then:

- a clean cut: when ``encode(context + candidate)`` starts with ``context_ids``, the candidate's ids are the rest,
  so the candidate is tokenized as it would be inside the full text;
- a token straddling the cut ("The dog" + "s ran" tokenized "The", " dogs", " ran"; "3" + "0" as "30"): the
  candidate is encoded alone, after a newline sentinel that is then dropped (so a SentencePiece tokenizer adds no
  word-start space), and checked to decode to exactly context + candidate; a candidate that cannot be is a row
  error. Taking "the rest" here would score " ran" for "s ran", dropping the "s".

lm-evaluation-harness' own ``hf`` rule (tokenize the whole, cut at the context's length) is kept apart, under its
own name, in the lm-eval backend, so that backend reproduces lm-eval bit for bit.

The output row holds, per candidate in order: ``candidate_logprobs`` (summed natural-log probability),
``candidate_num_tokens`` and ``candidate_is_greedy`` (every continuation token was the argmax). The generation
columns (``completion``, ``completion_token_ids``, ``num_completion_tokens``, ``finish_reason``) are null: nothing
is generated. ``num_prompt_tokens`` counts the context only. The job's ``[sampling]`` settings and per-row sampling
columns do not apply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Callable

import pyarrow as pa

from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.input.arrow_types import is_list_type, is_text_type
from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.prompts import encode_prompt
from cbrun.jobs.input.reader import InputRow, RowPlace, row_where
from cbrun.jobs.modes.ordering import RowWork
from cbrun.jobs.output.writer import OutputRow, error_row

_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_number_plus_one(text: str) -> str:
    """``text`` with its last number increased by 1, written in the same style ("1,999" -> "2,000", "2.50" -> "3.50").

    For a GSM8K answer the last number is the final answer after "####".

    Raises:
        ValueError: when the text holds no number.
    """
    matches = list(_NUMBER_RE.finditer(text))
    if not matches:
        raise ValueError("holds no number to change")
    match = matches[-1]
    value = Decimal(match.group().replace(",", "")) + 1
    new = format(value, ",") if "," in match.group() else str(value)
    return text[: match.start()] + new + text[match.end() :]


#: ``input.corruptions`` names -> deterministic transformation of the first candidate into one more candidate.
CORRUPTIONS: dict[str, Callable[[str], str]] = {"last_number_plus_one": last_number_plus_one}


def check_candidates_column(schema: pa.Schema, column: str, path: str) -> None:
    """Raise ``InputError`` unless ``column`` holds text or lists of text."""
    kind = schema.field(column).type
    if is_list_type(kind):
        kind = kind.value_type
    if not is_text_type(kind):
        raise InputError(
            f"input.candidates_column {column!r} of {path!r} must hold text or a list of text, but its "
            f"type is {schema.field(column).type}"
        )


def read_candidates(value: Any, corruptions: list[str]) -> list[str]:
    """A row's candidates: the column's value (one string or a list), then one derived candidate per corruption.

    Raises:
        ValueError: for a null or empty value, a null or empty candidate, or a corruption that cannot apply.
    """
    if value is None:
        raise ValueError("candidates column is null")
    candidates = [value] if isinstance(value, str) else list(value)
    if not candidates:
        raise ValueError("candidates column holds no candidates")
    for k, candidate in enumerate(candidates):
        if not isinstance(candidate, str) or not candidate:
            raise ValueError(f"candidate {k} is {'null' if candidate is None else 'empty'}")
    for name in corruptions:
        try:
            candidates.append(CORRUPTIONS[name](candidates[0]))
        except ValueError as exc:
            raise ValueError(f"corruption {name!r} cannot apply to candidate 0: it {exc}") from None
    return candidates


#: Text put before a candidate encoded alone, then dropped with its tokens: it starts a line, so the candidate's
#: first token is tokenized as inside a text, not as a word start (SentencePiece's added space).
_SENTINEL = "\n"


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) by the "exact" boundary rule (module docstring).

    Raises:
        ValueError: when the continuation cannot be tokenized so that the ids decode to context + continuation.
    """
    stripped = context.rstrip()
    continuation = context[len(stripped) :] + continuation
    context_ids = encode_prompt(tokenizer, stripped)
    whole = encode_prompt(tokenizer, stripped + continuation)
    if len(whole) > len(context_ids) and whole[: len(context_ids)] == context_ids:
        return context_ids, whole[len(context_ids) :]
    ids = _encode_alone(tokenizer, continuation)
    joined = tokenizer.decode(context_ids + ids, skip_special_tokens=True)
    if joined != tokenizer.decode(context_ids, skip_special_tokens=True) + continuation:
        raise ValueError(
            f"{continuation!r} cannot be tokenized after the context so that the tokens decode to "
            f"exactly context + candidate (a token of the joined text straddles the boundary)"
        )
    return context_ids, ids


def _encode_alone(tokenizer, text: str) -> list[int]:
    """``text``'s ids as if it continued a text: encoded after ``_SENTINEL``, whose ids are then dropped."""
    prefix = tokenizer.encode(_SENTINEL, add_special_tokens=False)
    ids = tokenizer.encode(_SENTINEL + text, add_special_tokens=False)
    if prefix and ids[: len(prefix)] == prefix:
        return ids[len(prefix) :]
    return tokenizer.encode(text, add_special_tokens=False)


def score_params(num_context_tokens: int) -> SamplingParams:
    """Settings of one candidate's request: one (ignored) greedy token, log-probabilities from the continuation on."""
    return SamplingParams(max_new_tokens=1, temperature=0.0, seed=0, prompt_logprobs_from=num_context_tokens)


@dataclass
class _PendingRow:
    """A row whose candidates are in the engine; results fill in by candidate index."""

    row_id: str
    row_index: int
    num_context_tokens: int
    num_tokens: list[int]
    logprobs: list[float | None] = field(default_factory=list)
    is_greedy: list[bool | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    num_done: int = 0
    place: RowPlace | None = None


class Scorer:
    """Turns score-mode rows into one request per candidate and gathers the candidates' results back into rows.

    Owns the rows in flight; request ids are ``(row_index, candidate index)``. Implements ``cbrun.jobs.modes.mode.JobMode``
    (``prepare``, ``collect``, ``num_in_flight``).

    Args:
        tokenizer: the model's tokenizer.
        max_model_len: the model's maximum length; context + continuation must stay under it (one token is
            sampled).
        vocab_size: the model's vocabulary size, None when unknown.
        corruptions: ``input.corruptions``.
    """

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int | None, corruptions: list[str]):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.corruptions = list(corruptions)
        self.pending: dict[int, _PendingRow] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self.pending)

    def prepare(self, row: InputRow) -> RowWork | OutputRow:
        """The row's requests (one per candidate of ``input.candidates_column``), or its error row."""
        requests = self.requests(row, row.extra.get("candidates_column"))
        if isinstance(requests, OutputRow):
            return requests
        return RowWork(row.row_index, row.id, requests[0][1], requests)

    def requests(self, row: InputRow, candidates_value: Any) -> list[tuple] | OutputRow:
        """The row's requests, one per candidate, or an error ``OutputRow`` when the row cannot be scored."""
        if row.error is not None:
            return error_row(row.id, row.row_index, row.error, generated=False)
        try:
            candidates = read_candidates(candidates_value, self.corruptions)
            pairs = []
            for k, candidate in enumerate(candidates):
                try:
                    pairs.append(encode_pair(self.tokenizer, row.prompt, candidate))
                except ValueError as exc:
                    raise ValueError(f"candidate {k}: {exc}") from None
            self._check(pairs)
        except ValueError as exc:
            return error_row(row.id, row.row_index, f"{row.where()}: {exc}", generated=False)
        context_ids = pairs[0][0]
        self.pending[row.row_index] = _PendingRow(
            row.id,
            row.row_index,
            len(context_ids),
            [len(ids) for _, ids in pairs],
            [None] * len(pairs),
            [None] * len(pairs),
            place=row.place,
        )
        params = score_params(len(context_ids))
        return [((row.row_index, k), context_ids + ids, params) for k, (_, ids) in enumerate(pairs)]

    def _check(self, pairs: list[tuple[list[int], list[int]]]) -> None:
        context_ids = pairs[0][0]
        if not context_ids:
            raise ValueError("the context encodes to no tokens")
        for k, (_, ids) in enumerate(pairs):
            if not ids:
                raise ValueError(f"candidate {k} encodes to no tokens")
            total = len(context_ids) + len(ids)
            if total >= self.max_model_len:
                raise ValueError(
                    f"candidate {k}: context + candidate have {total} tokens, but the model's maximum "
                    f"length is {self.max_model_len} tokens (one more token is computed)"
                )
            if self.vocab_size is not None and max(context_ids + ids) >= self.vocab_size:
                raise ValueError(
                    f"candidate {k}: token id {max(context_ids + ids)} is out of the model's "
                    f"vocabulary of {self.vocab_size}"
                )

    def collect(self, output) -> list[OutputRow] | None:
        """Record one candidate's ``RequestOutput``; returns the row (a list of one) once all its candidates are in."""
        row_index, k = output.request_id
        pending = self.pending[row_index]
        if output.finish_reason == "error":
            pending.errors.append(f"candidate {k}: {output.error}")
        else:
            assert len(output.prompt_logprobs) == pending.num_tokens[k], (output.prompt_logprobs, pending.num_tokens)
            pending.logprobs[k] = float(sum(output.prompt_logprobs))
            pending.is_greedy[k] = all(output.prompt_greedy)
        pending.num_done += 1
        if pending.num_done < len(pending.num_tokens):
            return None
        del self.pending[row_index]
        if pending.errors:
            message = f"{row_where(row_index, pending.row_id, pending.place)}: {'; '.join(sorted(pending.errors))}"
            return [error_row(pending.row_id, row_index, message, pending.num_context_tokens, generated=False)]
        return [
            OutputRow(
                id=pending.row_id,
                row_index=row_index,
                completion=None,
                completion_token_ids=None,
                num_prompt_tokens=pending.num_context_tokens,
                num_completion_tokens=None,
                finish_reason=None,
                candidate_logprobs=pending.logprobs,
                candidate_num_tokens=pending.num_tokens,
                candidate_is_greedy=pending.is_greedy,
            )
        ]
