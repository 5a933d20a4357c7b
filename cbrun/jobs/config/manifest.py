"""Job manifests: a TOML file, ``--set SECTION.KEY=VALUE`` overrides and CLI flags, loaded into dataclasses.

A manifest has six sections, all optional in the file (a key may come from ``--set`` or a flag instead)::

    [model]     path (a directory, a URI or a Hub id ORG/NAME), revision (a Hub model's branch, tag or commit)
    [input]     path, prompt_column, prompt_ids_column, id_column, template, limit, batch_size, order_window,
                mode ("generate" or "score"), candidates_column, corruptions, chat, messages_column, system_prompt,
                format ("auto" or "openai-batch"), shard ("I/N")
    [sampling]  SamplingParams fields (max_new_tokens, temperature, top_k, top_p, stop, stop_token_ids, ...),
                or their vLLM names (``max_tokens``, ``min_tokens``: ``cbrun.engine.sampling_params.VLLM_ALIASES``),
                the job ``seed`` from which every row's own seed is derived, ``n`` (samples per row),
                ``prompt_logprobs`` (shorthand for ``prompt_logprobs_from = 1``) and ``model_defaults``
                (take unset settings from the model's generation_config.json; default true)
    [engine]    EngineConfig fields (page_size, max_batch_tokens, max_requests_per_batch, device, ...)
    [output]    path, commit_every_rows, commit_every_seconds, overwrite, format ("parts" or "openai-batch"),
                keep_columns, max_error_fraction, timeline_interval_s, row_timings, compact, target_file_mb
    [cluster]   executor ("local" or "ray"), num_replicas, num_gpus_per_replica, num_cpus_per_replica, batch_size,
                max_concurrent_batches, address (``cbrun.jobs.run.ray_executor``)
    [storage]   endpoint_url (an S3-compatible endpoint, over ``AWS_ENDPOINT_URL``; ``cbrun.jobs.store.files``)

NOTE: relative paths (model, input, output) resolve against the current working directory of the ``cbrun``
process, not against the manifest's directory, so the same manifest behaves the same as flags given on the command
line. Run ``cbrun`` from the directory the manifest's paths are written for (the repository root for ours).

Section settings live in ``cbrun.jobs.config.settings``; ``--set`` values and command-line text are read by ``cbrun.jobs.cli.values``;
``cbrun.jobs.model.defaults`` takes unset sampling settings from the model's generation_config.json.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import VLLM_ALIASES, SamplingParams, canonical_name
from cbrun.engine.setting_error import SettingError, must_be
from cbrun.engine.structured_output.params import coerce_structured_outputs
from cbrun.jobs.cli.values import parse_set
from cbrun.jobs.config.settings import (
    ClusterSettings,
    InputSettings,
    ModelSettings,
    OutputSettings,
    StorageSettings,
    is_int,
)

SECTIONS = ("model", "input", "sampling", "engine", "output", "cluster", "storage")


@dataclass
class JobManifest:
    """Everything one job needs: model, input, sampling defaults, engine settings, output.

    Attributes:
        seed: the job seed; each row's sampling seed is derived from (seed, row id) unless a ``seed`` column
            gives it.
        n: samples per row (``[sampling] n``), each written as its own output row with a ``sample_index``; a row's
            ``n`` column overrides it. Sample i's seed derives from (seed, row id, i).
        sampling_set: the ``[sampling]`` keys the user gave (manifest, ``--set`` or flags), by their canonical
            names; the others hold defaults, which ``model_sampling_defaults`` may replace. None (a manifest built in
            code): the settings whose values differ from ``SamplingParams()``'s.
        model_defaults: take settings the user did not give from the model's generation_config.json.
    """

    model: ModelSettings = field(default_factory=ModelSettings)
    input: InputSettings = field(default_factory=lambda: InputSettings(prompt_column="prompt"))
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    n: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)
    output: OutputSettings = field(default_factory=OutputSettings)
    sampling_set: frozenset[str] | None = None
    model_defaults: bool = True
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    storage: StorageSettings = field(default_factory=StorageSettings)

    def __post_init__(self) -> None:
        if self.sampling_set is None:
            default = SamplingParams()
            self.sampling_set = frozenset(
                f.name for f in fields(SamplingParams) if getattr(self.sampling, f.name) != getattr(default, f.name)
            )
        if not isinstance(self.model_defaults, bool):
            raise ValueError(f"sampling.model_defaults must be true or false, got {self.model_defaults!r}")
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"sampling.n (samples per row) must be a positive integer, got {self.n!r}")
        if self.sampling.structured_outputs is not None:  # the job's own constraint: refused at load (exit 2)
            from cbrun.engine.structured_output.schema_support import constraint_backend

            try:
                constraint_backend(self.sampling.structured_outputs, self.engine)
            except ValueError as exc:
                raise ValueError(f"sampling.structured_outputs: {exc}") from None
        if self.n > 1 and self.input.mode == "score":
            raise ValueError(
                'sampling.n > 1 needs input.mode = "generate": score mode computes one score per '
                "candidate, and ignores the n column"
            )

    def check_required(self) -> None:
        """Raise ``ValueError`` when a path the job needs is missing."""
        for section, flag in (("model", "--model"), ("input", "--input"), ("output", "--output")):
            if not getattr(self, section).path:
                raise ValueError(f"{section}.path is required: set it in the manifest's [{section}] or give {flag}")


def load_manifest(
    path: str | Path | None = None, sets: list[str] = (), overrides: dict[str, dict[str, Any]] | None = None
) -> JobManifest:
    """Read a manifest, apply ``--set`` assignments, then ``overrides`` (the CLI flags), in that order.

    Args:
        path: the TOML file; None starts from an empty manifest.
        sets: ``SECTION.KEY=VALUE`` strings.
        overrides: {section: {key: value}} applied last; None values are ignored.

    Returns:
        The validated ``JobManifest``.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: for a TOML syntax error, an unknown section or key (named), or an invalid value.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"manifest {str(path)!r} not found")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"manifest {str(path)!r} is not valid TOML: {exc}") from None
    if isinstance(raw.get("sampling"), dict):  # NOTE: vLLM names first, so --set and flags override either
        raw["sampling"] = _canonical_sampling(raw["sampling"])
    for assignment in sets:
        section, key, value = parse_set(assignment)
        section_values = raw.setdefault(section, {})
        if not isinstance(section_values, dict):
            raise ValueError(f"[{section}] must be a table")
        section_values[canonical_name(key) if section == "sampling" else key] = value
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    return manifest_from_dict(raw)


def manifest_from_dict(raw: dict[str, Any]) -> JobManifest:
    """Build a ``JobManifest`` from {section: {key: value}}, rejecting unknown sections and keys by name.

    Raises:
        ValueError: for an unknown section or key, a missing model/input/output path, or an invalid value.
    """
    for section, values in raw.items():
        if section not in SECTIONS:
            close = difflib.get_close_matches(section, SECTIONS, n=1, cutoff=0.6)
            hint = f"; did you mean [{close[0]}]?" if close else ""
            raise ValueError(f"unknown manifest section [{section}]{hint} known sections: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ValueError(f"[{section}] must be a table of settings, got {values!r}")
    for section, flag in (("model", "--model"), ("input", "--input"), ("output", "--output")):
        if not raw.get(section, {}).get("path"):
            raise ValueError(f"{section}.path is required: set it in the manifest's [{section}] or give {flag}")
    sampling = _canonical_sampling(raw.get("sampling", {}))
    sampling_set = frozenset(sampling) - {"model_defaults"}
    model_defaults = sampling.pop("model_defaults", True)
    seed = sampling.pop("seed", 0)
    if not is_int(seed):
        raise ValueError(f"sampling.seed (the job seed) must be an integer, got {seed!r}")
    n = sampling.pop("n", 1)
    return JobManifest(
        model=_build(ModelSettings, "model", raw.get("model", {})),
        input=_build(InputSettings, "input", raw.get("input", {})),
        sampling=_sampling_params(sampling),
        seed=seed,
        n=n,
        # NOTE: the device defaults to "auto" (CUDA when present); jobs.run.resources.resolve_device checks it first.
        engine=_build(EngineConfig, "engine", {"device": "auto", **raw.get("engine", {})}),
        output=_build(OutputSettings, "output", raw.get("output", {})),
        sampling_set=sampling_set,
        model_defaults=model_defaults,
        cluster=_build(ClusterSettings, "cluster", raw.get("cluster", {})),
        storage=_build(StorageSettings, "storage", raw.get("storage", {})),
    )


def _sampling_params(sampling: dict[str, Any]) -> SamplingParams:
    """The ``SamplingParams`` of ``[sampling]``'s keys (canonical names, the job's own keys taken out), validated.

    Raises:
        ValueError: naming the setting as ``sampling.KEY``.
    """
    _expand_prompt_logprobs(sampling)
    if sampling.get("structured_outputs") is not None:
        sampling["structured_outputs"] = coerce_structured_outputs(
            "sampling.structured_outputs", sampling["structured_outputs"]
        )
    params = _build(
        SamplingParams,
        "sampling",
        sampling,
        exclude={"seed"},
        extra={"seed", "n", "prompt_logprobs", "model_defaults", *VLLM_ALIASES},
    )
    with named_in("sampling"):
        params.validate()
    return params


def _canonical_sampling(values: dict[str, Any]) -> dict[str, Any]:
    """``[sampling]`` with vLLM names turned into ours; the same setting given by both names is an error."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = canonical_name(key)
        if name in out:
            raise ValueError(
                f"sampling.{name} is given twice (as {name} and as its vLLM name "
                f"{next(k for k, v in VLLM_ALIASES.items() if v == name)}); keep one"
            )
        out[name] = value
    return out


def _expand_prompt_logprobs(sampling: dict[str, Any]) -> None:
    """Turn ``sampling.prompt_logprobs = true`` into ``prompt_logprobs_from = 1`` (every prompt token but the first,
    which nothing predicts), in place."""
    if "prompt_logprobs" not in sampling:
        return
    wanted = sampling.pop("prompt_logprobs")
    if is_int(wanted) and wanted == 0:  # vLLM's spelling: 0 extra top log-probabilities, the token's own only
        wanted = True
    if not isinstance(wanted, bool):
        raise ValueError(
            f"sampling.prompt_logprobs must be true or false (or vLLM's 0), got {wanted!r}: only each "
            f"prompt token's own log-probability is returned, not the top ones"
        )
    if wanted:
        if sampling.get("prompt_logprobs_from") is not None:
            raise ValueError("give sampling.prompt_logprobs = true or sampling.prompt_logprobs_from, not both")
        sampling["prompt_logprobs_from"] = 1


def _build(cls, section: str, values: dict[str, Any], exclude: set[str] = frozenset(), extra: set[str] = frozenset()):
    """``cls(**values)``, the settings of ``[section]``: an unknown key, a value of the wrong type or out of range is
    a ``ValueError`` naming the setting as ``section.key``."""
    known = {f.name for f in fields(cls)} - exclude
    for key in values:
        if key not in known:
            raise ValueError(unknown_setting_message(section, key, known | extra))
    with named_in(section):
        _check_types(cls, values)
        try:
            return cls(**values)
        except TypeError as exc:
            raise ValueError(f"[{section}]: {exc}") from None


@contextmanager
def named_in(section: str) -> Iterator[None]:
    """Turn a ``SettingError`` (the engine's settings name themselves bare: ``top_p``) into a ``ValueError`` naming
    each setting with its section (``sampling.top_p``), as the manifest, ``--set`` and the flags spell it."""
    try:
        yield
    except SettingError as exc:
        raise ValueError(exc.in_section(section)) from None


#: A field annotation's plain kinds: how to tell a value of each, and how a message says it.
_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (is_int, "an integer"),
    "float": (lambda v: is_int(v) or isinstance(v, float), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
}


def _check_types(cls, values: dict[str, Any]) -> None:
    """Refuse a value whose type its field cannot hold, for the fields annotated with one plain kind (``int``,
    ``float``, ``bool``, ``str``, optionally ``| None``); the dataclass checks the rest (lists, unions of kinds) and
    every range.

    Raises:
        SettingError: naming the field.
    """
    for f in fields(cls):
        if f.name not in values:
            continue
        kinds = [k for k in str(f.type).split(" | ") if k != "None"]
        if len(kinds) == 1 and kinds[0] in _KINDS:
            fits, said = _KINDS[kinds[0]]
            if not fits(values[f.name]) and not (values[f.name] is None and "None" in str(f.type)):
                raise must_be(f.name, said, values[f.name])


def unknown_setting_message(section: str, key: str, known: set[str]) -> str:
    """ "unknown setting SECTION.KEY ...; did you mean ...?" with the closest known name (``difflib``), then all."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"; did you mean {section}.{close[0]}?" if close else ""
    return f"unknown setting {section}.{key} (manifest or --set){hint} [{section}] accepts: {', '.join(sorted(known))}"
