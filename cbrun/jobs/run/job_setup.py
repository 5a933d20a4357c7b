"""What a job builds from its manifest before any row runs, shared by the job loop (``cbrun.jobs.run.job``) and each Ray
replica (``cbrun.jobs.run.replica``): the reader, the job mode, the output's carried columns, the model's vocabulary size."""

from __future__ import annotations

import json
from pathlib import Path

from cbrun.jobs.config.manifest import JobManifest
from cbrun.jobs.config.settings import PROMPT_SETTINGS_MESSAGE
from cbrun.jobs.input.carry import carried_fields, check_kept_columns, keep_roles
from cbrun.jobs.input.chat import check_messages_column
from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.openai_batch import (
    OPENAI_FIELDS,
    REQUEST_FIELDS,
    OpenAIBatchReader,
    input_fields,
)
from cbrun.jobs.input.reader import PromptReader
from cbrun.jobs.model.source import ModelSource
from cbrun.jobs.modes.generate import GenerateMode
from cbrun.jobs.modes.scoring import Scorer, check_candidates_column


def _score_mode(manifest: JobManifest, tokenizer, max_model_len: int, vocab_size: int | None) -> Scorer:
    return Scorer(tokenizer, max_model_len, vocab_size, manifest.input.corruptions)


#: ``input.mode`` -> the factory of its ``JobMode``: ``(manifest, tokenizer, max_model_len, vocab_size) -> mode``.
#: A new mode registers here (and its name in ``InputSettings.mode``'s check).
MODES = {"generate": GenerateMode, "score": _score_mode}


def open_reader(manifest: JobManifest, model: ModelSource | None = None) -> PromptReader | OpenAIBatchReader:
    """The job's reader: OpenAI batch requests (``cbrun.jobs.input.openai_batch``) or rows, reading the kept columns too.

    Args:
        model: the job's resolved model (an OpenAI batch line's default ``model`` is its name); None: the folder's.

    Raises:
        InputError: for a missing input, column or prompt setting, a kept column that clashes, repeated custom_ids.
    """
    inp, endpoint = manifest.input, manifest.storage.endpoint_url
    keep = manifest.output.keep_columns
    if inp.is_openai_batch:
        if inp.format == "auto" and not set(REQUEST_FIELDS) <= set(input_fields(inp.path, endpoint)):
            raise InputError(PROMPT_SETTINGS_MESSAGE)
        return OpenAIBatchReader(
            inp.path,
            limit=inp.limit,
            batch_size=inp.batch_size,
            keep_columns=keep,
            default_model=model.display_name if model is not None else Path(manifest.model.path).name,
            endpoint_url=endpoint,
        )
    extra_columns = {
        role: getattr(inp, role) for role in ("candidates_column", "messages_column") if getattr(inp, role) is not None
    }
    reader = PromptReader(
        inp.path,
        prompt_column=inp.prompt_column,
        prompt_ids_column=inp.prompt_ids_column,
        id_column=inp.id_column,
        template=inp.template,
        limit=inp.limit,
        batch_size=inp.batch_size,
        extra_columns=extra_columns,
        per_row_settings=inp.per_row_settings and inp.mode == "generate",
        endpoint_url=endpoint,
    )
    if inp.candidates_column is not None and not reader.no_columns_known:
        check_candidates_column(reader.schema, inp.candidates_column, inp.path)
    if inp.messages_column is not None and not reader.no_columns_known:
        check_messages_column(reader.schema, inp.messages_column, inp.path)
    check_kept_columns(keep, None if reader.no_columns_known else reader.column_names)
    reader.add_extra_columns(keep_roles(keep))
    return reader


def output_carried_fields(manifest: JobManifest, reader: PromptReader | OpenAIBatchReader) -> list:
    """The Arrow fields the job's output rows carry beyond ``OUTPUT_SCHEMA`` (``cbrun.jobs.input.carry``)."""
    derived = OPENAI_FIELDS if isinstance(reader, OpenAIBatchReader) else []
    return carried_fields(manifest.output.keep_columns, reader.schema, derived)


def model_vocab_size(model_path: str) -> int | None:
    """``vocab_size`` of the model directory's config.json (None when it has none)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return config.get("vocab_size")
