"""Job manifests: a TOML file, ``--set SECTION.KEY=VALUE`` overrides and CLI flags, loaded into dataclasses.

A manifest has six sections, all optional in the file (a key may come from ``--set`` or a flag instead)::

    [model]     path
    [input]     path, prompt_column, prompt_ids_column, id_column, template, limit, batch_size, order_window,
                mode ("generate" or "score"), candidates_column, corruptions, chat, messages_column, system_prompt,
                format ("auto" or "openai-batch"), shard ("I/N")
    [sampling]  SamplingParams fields (max_new_tokens, temperature, top_k, top_p, stop, stop_token_ids, ...),
                or their vLLM names (``max_tokens``, ``min_tokens``: ``engine.sampling_params.VLLM_ALIASES``),
                the job ``seed`` from which every row's own seed is derived, ``n`` (samples per row),
                ``prompt_logprobs`` (shorthand for ``prompt_logprobs_from = 1``) and ``model_defaults``
                (take unset settings from the model's generation_config.json; default true)
    [engine]    EngineConfig fields (page_size, max_batch_tokens, max_requests_per_batch, device, ...)
    [output]    path, commit_every_rows, commit_every_seconds, overwrite, format ("parts" or "openai-batch"),
                keep_columns, max_error_fraction, timeline_interval_s, row_timings, compact, target_file_mb
    [cluster]   executor ("local" or "ray"), num_replicas, num_gpus_per_replica, num_cpus_per_replica, batch_size,
                max_concurrent_batches, address (``jobs.run.ray_executor``)
    [storage]   endpoint_url (an S3-compatible endpoint, over ``AWS_ENDPOINT_URL``; ``jobs.storage``)

NOTE: relative paths (model, input, output) resolve against the current working directory of the ``cbrun``
process, not against the manifest's directory, so the same manifest behaves the same as flags given on the command
line. Run ``cbrun`` from the directory the manifest's paths are written for (the repository root for ours).

Text given on the command line (``--template``, ``--stop``, and a ``--set`` value that is not a TOML value) is read
like the inside of a manifest's double-quoted TOML string: ``\\n`` is a newline, ``\\t`` a tab, ``\\\\`` a
backslash, ``\\"`` a quote, ``\\uXXXX`` a character (``cli_text``). So ``--template 'Q: {q}\\nA:'`` and
``template = "Q: {q}\\nA:"`` give the same prompt.
"""

from __future__ import annotations

import difflib
import json
import logging
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.sampling_params import VLLM_ALIASES, SamplingParams, canonical_name

logger = logging.getLogger("cbrun.job")

SECTIONS = ("model", "input", "sampling", "engine", "output", "cluster", "storage")
#: generation_config.json keys taken as sampling defaults when the job does not set them (vLLM's
#: ``get_diff_sampling_param`` list). The last four are not taken when the file says ``do_sample = false``.
MODEL_DEFAULT_KEYS = ("max_new_tokens", "repetition_penalty", "temperature", "top_p", "top_k", "min_p")
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")
#: Boundary rules of score mode (``jobs.modes.scoring``).
BOUNDARY_RULES = ("exact",)
PROMPT_SETTINGS_MESSAGE = (
    "give the prompt as exactly one of: input.prompt_column (optionally with input.template), input.template, "
    "input.prompt_ids_column, or input.messages_column (with input.chat = true); or give OpenAI batch request "
    'lines (input.format = "openai-batch")'
)


@dataclass
class ModelSettings:
    """Where the model is: a Hugging Face model directory (config.json, weights, tokenizer files)."""

    path: str = ""


@dataclass
class InputSettings:
    """Which rows to read and how to make each row's prompt.

    Attributes:
        path: a Parquet file, a directory of Parquet files, or a ``datasets`` data set saved with ``save_to_disk``.
        prompt_column: a text column holding the prompt.
        prompt_ids_column: a list<int> column of prompt token ids, used as given (no BOS added).
        id_column: the column of row ids; None uses the row index.
        template: a ``str.format`` string with ``{column}`` fields; when set, the prompt is the template filled in
            from the row (``prompt_column`` need not be given then).
        limit: read only the first ``limit`` rows; None reads all.
        batch_size: rows per Parquet record batch read.
        order_window: prefix-aware ordering: rows are read this many ahead and each such window is submitted
            sorted by prompt token ids, so rows sharing a prompt prefix run together and hit the prefix cache
            (``jobs.modes.ordering``). It changes the order of work, never a row's output; 0 keeps input order.
        mode: "generate" (a completion per row) or "score" (the log-probability of each candidate continuation
            of the row's prompt; see ``jobs.modes.scoring``).
        candidates_column: score mode: a list<string> (or string) column of candidate continuations.
        corruptions: score mode: names from ``jobs.modes.scoring.CORRUPTIONS``; each derives one more candidate from
            the first, e.g. "last_number_plus_one" (a wrong final answer to score against the reference).
        chat: apply the tokenizer's chat template (see ``jobs.input.chat``) to the row's conversation.
        messages_column: chat: a list<struct<role, content>> column holding the conversation; without it the
            prompt text is one user turn.
        system_prompt: chat: a system turn put first (unless the conversation starts with one).
        per_row_settings: columns named like a sampling setting (or ``n``) override it per row; false reads no
            such column (a metadata column that happens to be called ``seed`` stays metadata).
        boundary: score mode: how the context / candidate boundary is tokenized; "exact" (the only rule here;
            see ``jobs.modes.scoring``): the scored tokens decode to exactly context + candidate.
        format: "openai-batch" reads OpenAI batch request lines (``jobs.input.openai_batch``): each request's body gives
            its prompt and sampling settings, so no prompt setting is given. "auto" (the default) does so when
            no prompt setting is given and the input's fields are ``custom_id``, ``method``, ``url``, ``body``.
        shard: ``"I/N"``: this process runs shard I of N of the job (``jobs.run.sharding``); ``--shard`` overrides it.

    Raises:
        ValueError: when no prompt source or two prompt sources are given, a number is out of range, or the
            mode, chat and candidate settings do not fit together.
    """

    path: str = ""
    prompt_column: str | None = None
    prompt_ids_column: str | None = None
    id_column: str | None = None
    template: str | None = None
    limit: int | None = None
    batch_size: int = 1024
    order_window: int = 4096
    mode: str = "generate"
    candidates_column: str | None = None
    corruptions: list[str] = field(default_factory=list)
    chat: bool = False
    messages_column: str | None = None
    system_prompt: str | None = None
    per_row_settings: bool = True
    boundary: str = "exact"
    format: str = "auto"
    shard: str | None = None

    def __post_init__(self) -> None:
        has_text = self.prompt_column is not None or self.template is not None
        sources = [has_text, self.prompt_ids_column is not None, self.messages_column is not None]
        if _check_input_format(self, any(sources)):
            pass  # NOTE: no prompt setting: OpenAI batch requests, recognised (format "auto") when the input opens
        elif sum(sources) != 1:
            raise ValueError(PROMPT_SETTINGS_MESSAGE)
        _check_modes(self)
        if self.limit is not None and (not _is_int(self.limit) or self.limit < 0):
            raise ValueError(f"input.limit must be an integer >= 0, got {self.limit!r}")
        if not _is_int(self.batch_size) or self.batch_size < 1:
            raise ValueError(f"input.batch_size must be a positive integer, got {self.batch_size!r}")
        if self.shard is not None:
            from jobs.output.lock import Shard

            Shard.parse(self.shard)
        if not _is_int(self.order_window) or self.order_window < 0:
            raise ValueError(
                f"input.order_window must be an integer >= 0 (0 keeps input order), got {self.order_window!r}"
            )


def _check_input_format(inp: InputSettings, has_prompt_setting: bool) -> bool:
    """Whether the prompts come from OpenAI batch request bodies (or may, for format "auto" without a prompt
    setting); raise ``ValueError`` for an unknown format or settings that do not fit OpenAI batch input."""
    if inp.format not in ("auto", "openai-batch"):
        raise ValueError(f'input.format must be "auto" or "openai-batch", got {inp.format!r}')
    if inp.format == "auto":
        if not has_prompt_setting and inp.mode != "generate":
            raise ValueError(PROMPT_SETTINGS_MESSAGE)
        return not has_prompt_setting
    if has_prompt_setting or inp.chat or inp.mode != "generate" or inp.system_prompt is not None:
        raise ValueError(
            'input.format = "openai-batch" takes each prompt from its request\'s body: leave out '
            "input.prompt_column, template, prompt_ids_column, messages_column, chat, system_prompt "
            "and mode"
        )
    return True


def _check_modes(inp: InputSettings) -> None:
    """Raise ``ValueError`` when the mode, candidate and chat settings do not fit together."""
    from jobs.modes.scoring import CORRUPTIONS

    if inp.mode not in ("generate", "score"):
        raise ValueError(f'input.mode must be "generate" or "score", got {inp.mode!r}')
    if not isinstance(inp.per_row_settings, bool):
        raise ValueError(f"input.per_row_settings must be true or false, got {inp.per_row_settings!r}")
    if inp.boundary not in BOUNDARY_RULES:
        raise ValueError(f"input.boundary must be one of {', '.join(map(repr, BOUNDARY_RULES))}, got {inp.boundary!r}")
    if not isinstance(inp.chat, bool):
        raise ValueError(f"input.chat must be true or false, got {inp.chat!r}")
    if not isinstance(inp.corruptions, list) or not all(c in CORRUPTIONS for c in inp.corruptions):
        raise ValueError(
            f"input.corruptions must be a list of names from: {', '.join(CORRUPTIONS)}; got {inp.corruptions!r}"
        )
    if inp.mode == "score":
        if inp.candidates_column is None:
            raise ValueError('input.mode = "score" needs input.candidates_column (the candidate continuations)')
        if inp.chat or inp.prompt_ids_column is not None:
            raise ValueError(
                'input.mode = "score" needs a text context (input.prompt_column or input.template); '
                "input.chat and input.prompt_ids_column are for generate mode"
            )
    elif inp.candidates_column is not None or inp.corruptions:
        raise ValueError('input.candidates_column and input.corruptions need input.mode = "score"')
    if not inp.chat and (inp.messages_column is not None or inp.system_prompt is not None):
        raise ValueError("input.messages_column and input.system_prompt need input.chat = true")
    if inp.chat and inp.prompt_ids_column is not None:
        raise ValueError(
            "input.chat = true needs a text prompt or input.messages_column, not input.prompt_ids_column "
            "(token ids are used as given)"
        )


@dataclass
class OutputSettings:
    """Where and how often results are committed.

    Attributes:
        path: the output directory (part files, _SUCCESS, and cbrun's own _cbrun/ folder).
        commit_every_rows: commit a part file once this many finished rows are buffered.
        commit_every_seconds: commit a part file once the oldest buffered row is this many seconds old (checked
            whenever a row finishes).
        overwrite: clear the directory's cbrun files when it holds a different job, instead of stopping.
        format: "openai-batch" also writes ``_results.jsonl`` (OpenAI batch output lines, in input order) beside
            the parts when the job finishes (``jobs.input.openai_batch``); "parts" writes the parts alone.
        keep_columns: input columns carried into every output row, with their Arrow types (``jobs.input.carry``).
        max_error_fraction: the job exits with code 3 when more than this fraction of its output rows are error
            rows (and always when all are). The default, 0.1, lets a few bad rows through (an over-long prompt,
            a null field: the common case in real data) but stops a pipeline on a systematic fault (a wrong
            column or template, a model that fails every request), which fails most rows.
        timeline_interval_s: seconds between the records of the run's timeline, ``_cbrun/timeline-<run>.jsonl``
            (``jobs.observe.timeline``; ``cbrun report`` draws it); 0 records none.
        row_timings: fill the output's timing columns (``queue_s``, ``ttft_s``, ``decode_s``: seconds, per
            sample) in generate mode; off, they are null, so that two runs' outputs stay equal row for row.
        compact: when the job finishes, merge its parts into files of about ``target_file_mb`` (``jobs.output.compact``).
        target_file_mb: the size of the merged files of ``compact`` and ``cbrun compact``, in MB.
    """

    path: str = ""
    commit_every_rows: int = 1000
    commit_every_seconds: float = 30.0
    overwrite: bool = False
    format: str = "parts"
    keep_columns: list[str] = field(default_factory=list)
    max_error_fraction: float = 0.1
    timeline_interval_s: float = 1.0
    row_timings: bool = False
    compact: bool = False
    target_file_mb: float = 256.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.timeline_interval_s, bool)
            or not isinstance(self.timeline_interval_s, int | float)
            or self.timeline_interval_s < 0
        ):
            raise ValueError(
                f"output.timeline_interval_s must be >= 0 (0: no timeline), got {self.timeline_interval_s!r}"
            )
        if not isinstance(self.row_timings, bool):
            raise ValueError(f"output.row_timings must be true or false, got {self.row_timings!r}")
        if self.format not in ("parts", "openai-batch"):
            raise ValueError(f'output.format must be "parts" or "openai-batch", got {self.format!r}')
        if isinstance(self.keep_columns, str):
            self.keep_columns = [self.keep_columns]
        if not isinstance(self.keep_columns, list) or not all(isinstance(c, str) and c for c in self.keep_columns):
            raise ValueError(f"output.keep_columns must be a list of column names, got {self.keep_columns!r}")
        if not _is_int(self.commit_every_rows) or self.commit_every_rows < 1:
            raise ValueError(f"output.commit_every_rows must be a positive integer, got {self.commit_every_rows!r}")
        if (
            isinstance(self.commit_every_seconds, bool)
            or not isinstance(self.commit_every_seconds, int | float)
            or self.commit_every_seconds <= 0
        ):
            raise ValueError(f"output.commit_every_seconds must be > 0, got {self.commit_every_seconds!r}")
        if not isinstance(self.overwrite, bool):
            raise ValueError(f"output.overwrite must be true or false, got {self.overwrite!r}")
        if (
            isinstance(self.max_error_fraction, bool)
            or not isinstance(self.max_error_fraction, int | float)
            or not 0 <= self.max_error_fraction <= 1
        ):
            raise ValueError(f"output.max_error_fraction must be in [0, 1], got {self.max_error_fraction!r}")
        if not isinstance(self.compact, bool):
            raise ValueError(f"output.compact must be true or false, got {self.compact!r}")
        if (
            isinstance(self.target_file_mb, bool)
            or not isinstance(self.target_file_mb, int | float)
            or self.target_file_mb <= 0
        ):
            raise ValueError(f"output.target_file_mb must be a number > 0 (MB), got {self.target_file_mb!r}")


@dataclass
class ClusterSettings:
    """How the job's rows are spread over processes (``jobs.run.ray_executor``).

    Attributes:
        executor: "local" (this process runs one engine) or "ray" (a Ray Data actor pool of engine replicas; the
            extra ``cbrun[ray]``).
        num_replicas: engine replicas (Ray actors), each holding one engine, loaded once.
        num_gpus_per_replica: GPUs each replica reserves; None: 1 when the engine's device is CUDA, else 0.
        num_cpus_per_replica: CPUs each replica reserves; also its torch thread count (at least 1).
        batch_size: input rows per batch handed to a replica.
        max_concurrent_batches: batches a replica holds at once; its engine's continuous batching runs their rows
            together, so its batch stays full while one batch ends and the next begins (``jobs.run.replica``).
        address: the Ray cluster to join ("auto": the one ``ray start`` runs on this node; "ray://host:10001");
            None starts a local Ray instance.
    """

    executor: str = "local"
    num_replicas: int = 1
    num_gpus_per_replica: float | None = None
    num_cpus_per_replica: float = 1
    batch_size: int = 256
    max_concurrent_batches: int = 2
    address: str | None = None

    def __post_init__(self) -> None:
        if self.executor not in ("local", "ray"):
            raise ValueError(f'cluster.executor must be "local" or "ray", got {self.executor!r}')
        if not _is_int(self.num_replicas) or self.num_replicas < 1:
            raise ValueError(f"cluster.num_replicas must be a positive integer, got {self.num_replicas!r}")
        for name in ("batch_size", "max_concurrent_batches"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"cluster.{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("num_gpus_per_replica", "num_cpus_per_replica"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
                raise ValueError(f"cluster.{name} must be a number >= 0, got {value!r}")
        if self.address is not None and not isinstance(self.address, str):
            raise ValueError(f'cluster.address must be a string ("auto", "ray://HOST:PORT"), got {self.address!r}')


@dataclass
class StorageSettings:
    """How object-store paths (``s3://``, ``gs://``) are reached (``jobs.storage``).

    Attributes:
        endpoint_url: the S3 endpoint (MinIO, a local server, another region's URL); None: ``AWS_ENDPOINT_URL``
            from the environment, else AWS itself.
    """

    endpoint_url: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint_url is not None and not isinstance(self.endpoint_url, str):
            raise ValueError(f"storage.endpoint_url must be a URL string, got {self.endpoint_url!r}")


@dataclass
class JobManifest:
    """Everything one job needs: model, input, sampling defaults, engine settings, output.

    Attributes:
        seed: the job seed; each row's sampling seed is derived from (seed, row id) unless a ``seed`` column
            gives it.
        n: samples per row (``[sampling] n``), each written as its own output row with a ``sample_index``; a row's
            ``n`` column overrides it. Sample i's seed derives from (seed, row id, i).
        sampling_set: the ``[sampling]`` keys the user gave (manifest, ``--set`` or flags), by their canonical
            names; the others hold defaults, which ``apply_model_defaults`` may replace. None (a manifest built in
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
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"sampling.n (samples per row) must be a positive integer, got {self.n!r}")
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_set(assignment: str) -> tuple[str, str, Any]:
    """Parse one ``SECTION.KEY=VALUE``; VALUE is read as a TOML value, else taken as text with TOML's escapes
    (``cli_text``).

    Returns:
        (section, key, value).

    Raises:
        ValueError: when the assignment is not of the form SECTION.KEY=VALUE, or has a bad escape.
    """
    name, sep, raw = assignment.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ValueError(f"--set expects SECTION.KEY=VALUE (e.g. sampling.temperature=0.7), got {assignment!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = cli_text(raw)
    return section, key, value


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "\\": "\\", '"': '"', "e": "\x1b"}


def cli_text(text: str) -> str:
    """Text from the command line read with TOML's basic-string escapes, as a manifest's "..." string is.

    ``\\n`` \\t \\r \\b \\f \\e \\\\ \\" \\uXXXX \\UXXXXXXXX are replaced; any other backslash is an error (as in TOML),
    so a mistyped escape is not silently kept.

    Raises:
        ValueError: for an unknown or incomplete escape, naming it.
    """
    out, i = [], 0
    while i < len(text):
        char = text[i]
        if char != "\\":
            out.append(char)
            i += 1
            continue
        code = text[i + 1 : i + 2]
        if code in _ESCAPES:
            out.append(_ESCAPES[code])
            i += 2
        elif code in ("u", "U"):
            width = 4 if code == "u" else 8
            digits = text[i + 2 : i + 2 + width]
            if len(digits) != width or any(c not in "0123456789abcdefABCDEF" for c in digits):
                raise ValueError(f"bad escape \\{code}{digits} in {text!r}: \\{code} takes {width} hex digits")
            out.append(chr(int(digits, 16)))
            i += 2 + width
        else:
            raise ValueError(
                f"unknown escape \\{code} in {text!r}: command-line text takes TOML's escapes "
                f'(\\n, \\t, \\\\, \\", \\uXXXX); write \\\\ for a backslash'
            )
    return "".join(out)


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
    if not _is_int(seed):
        raise ValueError(f"sampling.seed (the job seed) must be an integer, got {seed!r}")
    n = sampling.pop("n", 1)
    _expand_prompt_logprobs(sampling)
    sampling_params = _build(
        SamplingParams,
        "sampling",
        sampling,
        exclude={"seed"},
        extra={"seed", "n", "prompt_logprobs", "model_defaults", *VLLM_ALIASES},
    )
    sampling_params.validate()
    return JobManifest(
        model=_build(ModelSettings, "model", raw.get("model", {})),
        input=_build(InputSettings, "input", raw.get("input", {})),
        sampling=sampling_params,
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
    if _is_int(wanted) and wanted == 0:  # vLLM's spelling: 0 extra top log-probabilities, the token's own only
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
    known = {f.name for f in fields(cls)} - exclude
    for key in values:
        if key not in known:
            raise ValueError(unknown_setting_message(section, key, known | extra))
    try:
        return cls(**values)
    except TypeError as exc:
        raise ValueError(f"[{section}]: {exc}") from None


def unknown_setting_message(section: str, key: str, known: set[str]) -> str:
    """ "unknown setting SECTION.KEY ...; did you mean ...?" with the closest known name (``difflib``), then all."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"; did you mean {section}.{close[0]}?" if close else ""
    return f"unknown setting {section}.{key} (manifest or --set){hint} [{section}] accepts: {', '.join(sorted(known))}"


def apply_model_defaults(manifest: JobManifest) -> dict[str, Any]:
    """Take the sampling settings the job did not set from the model's generation_config.json, as transformers'
    ``generate`` and vLLM (``generation_config = "auto"``) do.

    Only keys written in the file count (``MODEL_DEFAULT_KEYS``; transformers' own defaults are not read). When
    the file says ``do_sample = false``, the sampling keys (temperature, top_p, top_k, min_p) are not taken: the
    model is meant to be decoded greedily, as ``generate`` would. Nothing is taken with ``model_defaults = false``.

    Returns:
        {setting: value} of what was taken (``manifest.sampling`` is replaced in place); logged once.

    Raises:
        ValueError: when a taken value is out of range, naming the file.
    """
    path = Path(manifest.model.path) / "generation_config.json"
    if not manifest.model_defaults or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc}") from None
    skip = set(manifest.sampling_set)
    if config.get("do_sample") is False:
        skip.update(_SAMPLING_KEYS)
    taken = {key: config[key] for key in MODEL_DEFAULT_KEYS if key not in skip and config.get(key) is not None}
    if not taken:
        return {}
    sampling = manifest.sampling.replace(**taken)
    try:
        sampling.validate()
    except ValueError as exc:
        raise ValueError(f"{str(path)!r}: {exc} (set it in [sampling], or sampling.model_defaults = false)") from None
    manifest.sampling = sampling
    logger.info(
        "sampling defaults from %s: %s (set them in [sampling] to change; sampling.model_defaults = false "
        "ignores the file)",
        path,
        ", ".join(f"{k} = {v!r}" for k, v in taken.items()),
    )
    return taken
