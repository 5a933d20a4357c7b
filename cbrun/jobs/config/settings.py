"""The settings of a manifest's sections: ``[model]``, ``[input]``, ``[output]``, ``[cluster]`` and ``[storage]``.

One dataclass each, validated in ``__post_init__`` (a bad value is a ``ValueError`` naming the setting).
``[sampling]`` and ``[engine]`` are the engine's own ``SamplingParams`` and ``EngineConfig``; ``cbrun.jobs.config.manifest``
loads a manifest into all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Boundary rules of score mode (``cbrun.jobs.modes.scoring``).
BOUNDARY_RULES = ("exact",)
PROMPT_SETTINGS_MESSAGE = (
    "give the prompt as exactly one of: input.prompt_column (optionally with input.template), input.template, "
    "input.prompt_ids_column, or input.messages_column (with input.chat = true); or give OpenAI batch request "
    'lines (input.format = "openai-batch")'
)


@dataclass
class ModelSettings:
    """Where the model is.

    Attributes:
        path: a Hugging Face model directory (config.json, weights, tokenizer files), an object-store URI of one,
            or a Hugging Face Hub repo id (``ORG/NAME``) read from the Hugging Face cache or downloaded into it
            (``cbrun.jobs.model.source``).
        revision: a Hub model's branch, tag or commit sha (vLLM's ``revision``); None is ``main``. The commit it
            resolves to when the job starts is recorded, and the job runs that commit to its end.
    """

    path: str = ""
    revision: str | None = None

    def __post_init__(self):
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision.strip()):
            raise ValueError(f"model.revision must be a branch, tag or commit name, got {self.revision!r}")


@dataclass
class InputSettings:
    """Which rows to read and how to make each row's prompt.

    Attributes:
        path: a Parquet or JSON Lines file (docs/inputs.md names every format), a directory of them, or a
            ``datasets`` data set saved with ``save_to_disk``.
        prompt_column: a text column holding the prompt.
        prompt_ids_column: a list<int> column of prompt token ids, used as given (no BOS added).
        id_column: the column of row ids; None uses the row index.
        template: a ``str.format`` string with ``{column}`` fields; when set, the prompt is the template filled in
            from the row (``prompt_column`` need not be given then).
        limit: read only the first ``limit`` rows; None reads all.
        batch_size: rows per Parquet record batch read.
        order_window: prefix-aware ordering: rows are read this many ahead and each such window is submitted
            sorted by prompt token ids, so rows sharing a prompt prefix run together and hit the prefix cache
            (``cbrun.jobs.modes.ordering``). It changes the order of work, never a row's output; 0 keeps input order.
        mode: "generate" (a completion per row) or "score" (the log-probability of each candidate continuation
            of the row's prompt; see ``cbrun.jobs.modes.scoring``).
        candidates_column: score mode: a list<string> (or string) column of candidate continuations.
        corruptions: score mode: names from ``cbrun.jobs.modes.scoring.CORRUPTIONS``; each derives one more candidate from
            the first, e.g. "last_number_plus_one" (a wrong final answer to score against the reference).
        chat: apply the tokenizer's chat template (see ``cbrun.jobs.input.chat``) to the row's conversation.
        messages_column: chat: a list<struct<role, content>> column holding the conversation; without it the
            prompt text is one user turn.
        system_prompt: chat: a system turn put first (unless the conversation starts with one).
        per_row_settings: columns named like a sampling setting (or ``n``) override it per row; false reads no
            such column (a metadata column that happens to be called ``seed`` stays metadata).
        boundary: score mode: how the context / candidate boundary is tokenized; "exact" (the only rule here;
            see ``cbrun.jobs.modes.scoring``): the scored tokens decode to exactly context + candidate.
        format: "openai-batch" reads OpenAI batch request lines (``cbrun.jobs.input.openai_batch``): each request's body gives
            its prompt and sampling settings, so no prompt setting is given. "auto" (the default) does so when
            no prompt setting is given and the input's fields are ``custom_id``, ``method``, ``url``, ``body``.
        shard: ``"I/N"``: this process runs shard I of N of the job (``cbrun.jobs.run.sharding``); ``--shard`` overrides it.

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

    @property
    def is_openai_batch(self) -> bool:
        """Whether the prompts come from OpenAI batch requests: ``format = "openai-batch"``, or "auto" with no prompt
        setting (the input must then have the request shape; ``cbrun.jobs.input.openai_batch.OpenAIBatchReader``
        checks)."""
        prompt_settings = (self.prompt_column, self.template, self.prompt_ids_column, self.messages_column)
        return self.format == "openai-batch" or (self.format == "auto" and all(s is None for s in prompt_settings))

    def __post_init__(self) -> None:
        has_text = self.prompt_column is not None or self.template is not None
        sources = [has_text, self.prompt_ids_column is not None, self.messages_column is not None]
        if _check_input_format(self, any(sources)):
            pass  # NOTE: no prompt setting: OpenAI batch requests, recognised (format "auto") when the input opens
        elif sum(sources) != 1:
            raise ValueError(PROMPT_SETTINGS_MESSAGE)
        _check_modes(self)
        if self.limit is not None and (not is_int(self.limit) or self.limit < 0):
            raise ValueError(f"input.limit must be an integer >= 0, got {self.limit!r}")
        if not is_int(self.batch_size) or self.batch_size < 1:
            raise ValueError(f"input.batch_size must be a positive integer, got {self.batch_size!r}")
        if self.shard is not None:
            from cbrun.jobs.output.lock import Shard

            Shard.parse(self.shard)
        if not is_int(self.order_window) or self.order_window < 0:
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
    from cbrun.jobs.modes.scoring import CORRUPTIONS

    if inp.mode not in ("generate", "score"):
        raise ValueError(f'input.mode must be "generate" or "score", got {inp.mode!r}')
    if not isinstance(inp.per_row_settings, bool):
        raise ValueError(f"input.per_row_settings must be true or false, got {inp.per_row_settings!r}")
    if inp.boundary not in BOUNDARY_RULES:
        raise ValueError(f"input.boundary must be one of {', '.join(map(repr, BOUNDARY_RULES))}, got {inp.boundary!r}")
    if not isinstance(inp.chat, bool):
        raise ValueError(f"input.chat must be true or false, got {inp.chat!r}")
    if not isinstance(inp.corruptions, list) or not all(
        isinstance(c, str) and c in CORRUPTIONS for c in inp.corruptions
    ):
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
            the parts when the job finishes (``cbrun.jobs.input.openai_batch``); "parts" writes the parts alone.
        keep_columns: input columns carried into every output row, with their Arrow types (``cbrun.jobs.input.carry``).
        max_error_fraction: the job exits with code 3 when more than this fraction of its output rows are error
            rows (and always when all are). The default, 0.1, lets a few bad rows through (an over-long prompt,
            a null field: the common case in real data) but stops a pipeline on a systematic fault (a wrong
            column or template, a model that fails every request), which fails most rows.
        timeline_interval_s: seconds between the records of the run's timeline, ``_cbrun/timeline-<run>.jsonl``
            (``cbrun.jobs.observe.timeline``; ``cbrun report`` draws it); 0 records none.
        row_timings: fill the output's timing columns (``queue_s``, ``ttft_s``, ``decode_s``: seconds, per
            sample) in generate mode; off, they are null, so that two runs' outputs stay equal row for row.
        compact: when the job finishes, merge its parts into files of about ``target_file_mb`` (``cbrun.jobs.output.compact``).
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
        if not is_int(self.commit_every_rows) or self.commit_every_rows < 1:
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
    """How the job's rows are spread over processes (``cbrun.jobs.run.ray_executor``).

    Attributes:
        executor: "local" (this process runs one engine) or "ray" (a Ray Data actor pool of engine replicas; the
            extra ``cbrun[ray]``).
        num_replicas: engine replicas (Ray actors), each holding one engine, loaded once.
        num_gpus_per_replica: GPUs each replica reserves; None: 1 when the engine's device is CUDA, else 0. A
            replica of ``engine.tensor_parallel_size = N`` ranks reserves N times this (one share per rank, at
            least one GPU each on CUDA), all on one node.
        num_cpus_per_replica: CPUs each replica reserves (N times this for N tensor-parallel ranks); also each
            rank's torch thread count (at least 1).
        batch_size: input rows per batch handed to a replica.
        max_concurrent_batches: batches a replica holds at once; its engine's continuous batching runs their rows
            together, so its batch stays full while one batch ends and the next begins (``cbrun.jobs.run.replica``).
        address: the Ray cluster to join ("auto": the one ``ray start`` runs on this node; "ray://host:10001");
            None starts a local Ray instance.
        data_parallel_size: engine replicas on this node without Ray (vLLM's name; ``--data-parallel-size``):
            above 1, the command runs that many ``cbrun run`` processes, replica i as shard i/D on its own devices
            (CUDA: ``tensor_parallel_size`` of them each; the CPU: its share of the cores), all writing the one
            output directory (``cbrun.jobs.run.data_parallel``). Not with ``--shard`` or the Ray executor.
    """

    executor: str = "local"
    num_replicas: int = 1
    num_gpus_per_replica: float | None = None
    num_cpus_per_replica: float = 1
    batch_size: int = 256
    max_concurrent_batches: int = 2
    address: str | None = None
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not is_int(self.data_parallel_size) or self.data_parallel_size < 1:
            raise ValueError(f"cluster.data_parallel_size must be a positive integer, got {self.data_parallel_size!r}")
        if self.executor not in ("local", "ray"):
            raise ValueError(f'cluster.executor must be "local" or "ray", got {self.executor!r}')
        if not is_int(self.num_replicas) or self.num_replicas < 1:
            raise ValueError(f"cluster.num_replicas must be a positive integer, got {self.num_replicas!r}")
        for name in ("batch_size", "max_concurrent_batches"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"cluster.{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("num_gpus_per_replica", "num_cpus_per_replica"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
                raise ValueError(f"cluster.{name} must be a number >= 0, got {value!r}")
        if self.address is not None and not isinstance(self.address, str):
            raise ValueError(f'cluster.address must be a string ("auto", "ray://HOST:PORT"), got {self.address!r}')


@dataclass
class StorageSettings:
    """How object-store paths (``s3://``, ``gs://``) are reached (``cbrun.jobs.store.files``).

    Attributes:
        endpoint_url: the S3 endpoint (MinIO, a local server, another region's URL); None: ``AWS_ENDPOINT_URL``
            from the environment, else AWS itself.
    """

    endpoint_url: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint_url is not None and not isinstance(self.endpoint_url, str):
            raise ValueError(f"storage.endpoint_url must be a URL string, got {self.endpoint_url!r}")


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (``True`` and ``False`` are not)."""
    return isinstance(value, int) and not isinstance(value, bool)
