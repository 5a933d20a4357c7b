"""Per-request sampling settings, and the vLLM names they may also be given by."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from cbrun.engine.setting_error import must_be
from cbrun.engine.structured_output.params import StructuredOutputsParams, coerce_structured_outputs

#: Names a job may override per row through an input column of the same name.
#: Temperatures below this sample greedily (vLLM's ``_SAMPLING_EPS``).
GREEDY_TEMPERATURE = 1e-5

SAMPLING_FIELDS = (
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "ignore_eos",
    "stop_token_ids",
    "stop",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "prompt_logprobs_from",
    "include_stop_str_in_output",
    "logprobs_mode",
    "structured_outputs",
)

#: vLLM ``SamplingParams`` names that differ from ours -> our (canonical) name. Every other vLLM name we support
#: (temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, the penalties, logprobs, n,
#: include_stop_str_in_output) is already spelled the same. A manifest, ``--set`` or a per-row column may use
#: either spelling; the job records the canonical one, so both spellings are one job.
VLLM_ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}

#: What ``logprobs`` returns (vLLM's ``logprobs_mode`` names): the model's log-softmax before any processing, or
#: after penalties, temperature, top-k and top-p (filtered tokens are -inf).
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def canonical_name(name: str) -> str:
    """Our name for a sampling setting given by its vLLM name (``max_tokens`` -> ``max_new_tokens``); other names
    unchanged."""
    return VLLM_ALIASES.get(name, name)


@dataclass
class SamplingParams:
    """How one request samples its tokens and when it stops.

    Logits are processed in this order (as in transformers' logits processors and vLLM's sampler): min_new_tokens
    (stop tokens masked), repetition penalty (prompt and output tokens), presence and frequency penalties (output
    tokens); ``logprobs`` are read here; then temperature, top-k, top-p, min-p and a draw from the request's own
    counter-based random stream (``cbrun.engine.sample``). A row's result depends only on its own logits, settings,
    seed and output position, so its output never depends on its batch.

    Attributes:
        max_new_tokens: most tokens to generate (>= 0; 0 returns an empty completion without running the model).
        min_new_tokens: EOS and stop tokens are masked until this many tokens exist.
        temperature: softmax temperature; 0 (or anything below ``GREEDY_TEMPERATURE``, 1e-5) means greedy (argmax).
        top_k: keep the k most likely tokens; 0 disables it (1 is greedy).
        top_p: nucleus sampling (Holtzman et al. 2019), keep the smallest set reaching this mass; (0, 1].
        min_p: drop tokens whose probability is under ``min_p`` times the top token's; [0, 1].
        seed: key of the request's own random stream (``cbrun.engine.sample.sampler.uniform``); None draws one from the
            engine's seed generator.
        stop_token_ids: extra token ids that end the request (the emitted stop token is kept in the output ids;
            its text is not in the output text unless ``include_stop_str_in_output``).
        stop: strings that end the request; the output is cut before the first one (needs a tokenizer).
        include_stop_str_in_output: keep the stop string (or the stop token's text) in the output text (vLLM).
        ignore_eos: do not stop on the model's EOS token ids.
        repetition_penalty: > 0; 1 disables it. Divides positive, multiplies negative logits of seen tokens
            (Keskar et al. 2019, CTRL).
        presence_penalty, frequency_penalty: subtracted once per generated token id / per occurrence (OpenAI).
        logprobs: return this many top log-probabilities per generated token (and the chosen token's); None: off.
        logprobs_mode: "raw_logprobs" (default, vLLM's): the model's log-softmax before penalties and
            temperature; "processed_logprobs": of the distribution actually sampled from (after penalties,
            temperature, top-k and top-p). Prompt log-probabilities are always raw.
        prompt_logprobs_from: return log-probabilities of prompt tokens at positions >= this (>= 1); None: off.
        structured_outputs: a constraint the output must match (JSON schema, regex, choice, grammar; vLLM's
            ``StructuredOutputsParams``; a dict holding one of them is converted); None: free text. Disallowed
            tokens are masked before everything else.

    Raises:
        SettingError: (a ``ValueError``) from ``validate`` when a value is of the wrong type or out of range; the
            message names the setting (a job names it with its section: ``sampling.top_p``).
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs_from: int | None = None
    logprobs_mode: str = "raw_logprobs"
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict | str):
            self.structured_outputs = coerce_structured_outputs("structured_outputs", self.structured_outputs)
        try:  # NOTE: operator.index takes ints (numpy's too), never a float it would round or a string
            self.stop_token_ids = tuple(
                operator.index(t) for t in (self.stop_token_ids if self.stop_token_ids is not None else ())
            )
        except TypeError:
            raise must_be("stop_token_ids", "a list of token ids (integers >= 0)", self.stop_token_ids) from None
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        elif self.stop is None or isinstance(self.stop, list | tuple):  # anything else: validate names it
            self.stop = tuple(self.stop or ())
        if self.top_k == -1:  # vLLM's spelling of "off"; stored as ours so both spellings are one job
            self.top_k = 0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first setting that is out of range."""
        self._check_lengths()
        self._check_draw()
        self._check_penalties()
        self._check_outputs()

    def _check_lengths(self) -> None:
        """How many tokens the output holds: ``max_new_tokens`` and ``min_new_tokens``."""
        self._check_int("max_new_tokens", 0)
        self._check_int("min_new_tokens", 0)

    def _check_draw(self) -> None:
        """How a token is drawn: temperature, the top-k / top-p / min-p filters and the seed."""
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            "a finite number >= 0",
            self.temperature,
        )
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0 (0 or -1 disables it)", self.top_k)
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        _check(self.seed is None or _is_int(self.seed), "seed", "an integer or None", self.seed)

    def _check_penalties(self) -> None:
        """The repetition, presence and frequency penalties."""
        _check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "a number > 0",
            self.repetition_penalty,
        )
        _check(_is_number(self.presence_penalty), "presence_penalty", "a finite number", self.presence_penalty)
        _check(_is_number(self.frequency_penalty), "frequency_penalty", "a finite number", self.frequency_penalty)

    def _check_outputs(self) -> None:
        """What comes back besides the tokens, and what ends or shapes them: logprobs, stop strings, structured
        outputs."""
        self._check_int("logprobs", 0, or_none=True)
        self._check_int("prompt_logprobs_from", 1, or_none=True)
        _check(
            isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "a list of non-empty strings",
            self.stop,
        )
        _check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of token ids (integers >= 0)",
            list(self.stop_token_ids),
        )
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "true or false", self.ignore_eos)
        _check(
            isinstance(self.include_stop_str_in_output, bool),
            "include_stop_str_in_output",
            "true or false",
            self.include_stop_str_in_output,
        )
        if self.structured_outputs is not None:
            coerce_structured_outputs("structured_outputs", self.structured_outputs)
        _check(
            self.logprobs_mode in LOGPROBS_MODES,
            "logprobs_mode",
            " or ".join(map(repr, LOGPROBS_MODES)),
            self.logprobs_mode,
        )

    def _check_int(self, name: str, low: int, or_none: bool = False) -> None:
        """Setting ``name`` is an integer >= ``low`` (or None, where ``or_none``)."""
        value = getattr(self, name)
        ok = (or_none and value is None) or (_is_int(value) and value >= low)
        _check(ok, name, f"an integer >= {low}" + (" or None" if or_none else ""), value)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: top_k 1, or a temperature below ``GREEDY_TEMPERATURE`` (dividing
        logits by it would overflow; vLLM draws the same line)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    # NOTE: the row predicates below are their one definition; each is evaluated once per request, when the
    # scheduler accepts it (``needs_processing``) and when the sampler first sees it (``SamplingSlots`` keeps the
    # values, and each step's ``SamplingBatch`` its batch-wide ones), never per step.
    @property
    def penalised(self) -> bool:
        """True when a repetition, presence or frequency penalty applies (the row needs its token counts)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def filtered(self) -> bool:
        """True for a sampled row with a top-k, top-p or min-p filter."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def needs_processing(self) -> bool:
        """True when the logits row needs more than a batched argmax."""
        return (
            not self.greedy
            or self.min_new_tokens > 0
            or self.penalised
            or self.logprobs is not None
            or self.structured_outputs is not None
        )

    @property
    def masked_greedy(self) -> bool:
        """True when the row's only processing is its constraint's mask: greedy, no penalties, no
        ``min_new_tokens``, no log-probabilities (its token is the argmax of its masked logits)."""
        return (
            self.structured_outputs is not None
            and self.greedy
            and self.min_new_tokens == 0
            and not self.penalised
            and self.logprobs is None
        )

    def replace(self, **changes) -> "SamplingParams":
        """A copy with ``changes`` applied; unknown names raise ``ValueError``."""
        known = {f.name for f in fields(self)}
        changes = {canonical_name(k): v for k, v in changes.items()}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown sampling setting(s): {sorted(unknown)}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, name: str, expected: str, value) -> None:
    if not ok:
        raise must_be(name, expected, value)


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _as_text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be text, got {value!r}")
    return value


def _as_token_ids(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or any(not _is_int(t) or t < 0 for t in value):
        raise ValueError(f"{name} must be a list of token ids >= 0, got {value!r}")
    return tuple(value)


def _as_strings(name: str, value: Any) -> tuple[str, ...]:
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a string or a list of strings, got {value!r}")
    return tuple(value)


#: A field's annotation (without ``| None``) -> the coercion of a per-row value into it.
_COERCIONS: dict[str, Callable[[str, Any], Any]] = {
    "int": _as_int,
    "float": _as_float,
    "bool": _as_bool,
    "str": _as_text,
    "tuple[int, ...]": _as_token_ids,
    "tuple[str, ...]": _as_strings,
    "StructuredOutputsParams": coerce_structured_outputs,
}
#: SamplingParams field name -> its annotation, e.g. "int", "float | None", "tuple[int, ...]".
SAMPLING_FIELD_TYPES = {f.name: str(f.type) for f in fields(SamplingParams)}
# NOTE: every field has a coercion: a new field of a new type fails here, at import, not by passing values through.
assert all(kind.removesuffix(" | None") in _COERCIONS for kind in SAMPLING_FIELD_TYPES.values()), SAMPLING_FIELD_TYPES


def coerce_sampling_value(name: str, value: Any, column: str | None = None) -> Any:
    """Turn one per-row value (as read from a column) into the type the ``SamplingParams`` field declares.

    Whole floats become ints (Parquet writers often store integer columns with nulls as doubles), lists become
    tuples, one string becomes a one-string tuple for ``stop``; anything else of the wrong type is refused.

    Args:
        name: the setting (our name).
        value: the column's value.
        column: the column it came from, when its name differs (a vLLM name); errors then name both.

    Raises:
        ValueError: naming the setting, for an unknown name or a value of the wrong type (range checks are
            ``SamplingParams.validate``'s).
    """
    if column is not None and column != name:
        try:
            return coerce_sampling_value(name, value)
        except ValueError as exc:
            raise ValueError(f"column {column!r}: {exc}") from None
    if name not in SAMPLING_FIELD_TYPES:
        raise ValueError(f"unknown sampling setting {name!r}")
    kind = SAMPLING_FIELD_TYPES[name]
    if value is None and kind.endswith(" | None"):
        return None
    return _COERCIONS[kind.removesuffix(" | None")](name, value)


def coerce_num_samples(value: Any, name: str = "n") -> int:
    """One row's ``n`` (samples to generate) as an int >= 1.

    Raises:
        ValueError: naming the column, for a value that is not a whole number >= 1.
    """
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} (samples per row) must be an integer >= 1, got {value!r}")
    return value
