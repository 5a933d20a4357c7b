"""A job's resources, opened from its settings and checked before any work: the model directory (config and
weights), the device, the tokenizer, the reader of its rows, its mode, its output's carried columns and the engine's
load. The driver's ``cbrun.jobs.run.resolve`` and each Ray replica (``cbrun.jobs.run.replica``) open them here; a
missing or unusable one is a ``JobError`` (the CLI's exit code 2) whose message says what to fix.

The input and its columns are checked by ``cbrun.jobs.input.reader`` (``InputError``), the output directory by
``cbrun.jobs.output.output_dir``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

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
from cbrun.jobs.output.fingerprint import WEIGHT_SUFFIXES


class JobError(Exception):
    """The job cannot start as configured; the message says what to fix. Raised before any row is generated."""


class JobAborted(Exception):
    """Generation stopped on a fault that is not one row's; the rows finished before it are committed. The cause
    is ``__cause__``."""


def check_model_dir(model_path: str) -> None:
    """Raise ``JobError`` unless ``model_path`` is a Hugging Face model directory with a readable config and weights.

    Reads the config alone (no weights), so a finished job is recognised without loading the model. A
    Llama-family config that ``cbrun.engine.model.config`` reads is checked there, without importing transformers; any
    other goes through transformers' ``AutoConfig``.
    """
    from cbrun.engine.model.config import read_config_json
    from cbrun.engine.model.registry import parse_config

    path = Path(model_path)
    if not (path / "config.json").is_file():
        what = "not found" if not path.exists() else "has no config.json"
        raise JobError(
            f"model directory {model_path!r} {what}: give a Hugging Face model directory, e.g. one "
            f"made by `cbrun convert-llama2c CHECKPOINT TOKENIZER OUT_DIR`"
        )
    try:
        config, _ = parse_config(read_config_json(path))
        if config is None:
            from transformers import AutoConfig

            AutoConfig.from_pretrained(model_path)
    except (ValueError, OSError) as exc:
        raise JobError(f"cannot load the model from {model_path!r}: {exc}") from None
    if not any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir()):
        raise JobError(f"model directory {model_path!r} holds no weights (*.safetensors, *.bin, *.pt, *.pth)")


def resolve_device(device: str) -> str:
    """The torch device a job runs on: "auto" is CUDA when available, else the CPU.

    Raises:
        JobError: for a device this machine does not have (e.g. "cuda" without a GPU) or a malformed name.
    """
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise JobError(f'engine.device {device!r} is not a device name ({exc}); use "auto", "cpu" or "cuda"') from None
    if parsed.type == "cpu":
        return device
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise JobError(
                f"engine.device = {device!r}, but this machine has no usable CUDA device "
                f'(torch.cuda.is_available() is False); set engine.device = "auto" or "cpu"'
            )
        if parsed.index is not None and parsed.index >= count:
            raise JobError(f"engine.device = {device!r}, but this machine has {count} CUDA device(s)")
        return device
    if parsed.type == "mps" and torch.backends.mps.is_available():
        return device
    raise JobError(f'engine.device = {device!r} is not available here; use "auto", "cpu" or "cuda"')


def load_engine(model_path: str, config, expected_requests: int | None = None):
    """``LLMEngine.from_pretrained`` with load failures turned into ``JobError``; ``expected_requests`` (the
    requests the run will add, when known) lets the engine size its default cache to the job.

    Failures include unreadable or corrupt weight files (a truncated ``model.safetensors`` raises safetensors'
    ``SafetensorError``, a broken ``.bin`` pickle's ``UnpicklingError``; weights that do not fit the config
    torch's ``RuntimeError``): the model directory is the job's input, so they get a setup error, not a traceback.
    """
    import pickle

    from safetensors import SafetensorError

    from cbrun.engine import LLMEngine
    from cbrun.engine.setting_error import SettingError

    try:
        return LLMEngine.from_pretrained(model_path, config=config, expected_requests=expected_requests)
    except SettingError as exc:  # a setting this model or machine cannot run: named as the manifest names it
        raise JobError(f"cannot load the model from {model_path!r}: {exc.in_section('engine')}") from None
    except (ValueError, OSError) as exc:
        raise JobError(f"cannot load the model from {model_path!r}: {exc}") from None
    except (SafetensorError, pickle.UnpicklingError, RuntimeError) as exc:
        raise JobError(
            f"cannot load the model's weights from {model_path!r} (a corrupt or truncated weight file, "
            f"or weights that do not match config.json?): {type(exc).__name__}: {exc}"
        ) from None


def load_tokenizer(model_path: str, *, loader: str = "auto"):
    """The model's tokenizer (``cbrun.engine.core.tokenizer.load_tokenizer``: without transformers where that is exact).

    Args:
        loader: ``cbrun.engine.model.loader``.

    Raises:
        JobError: the directory has no usable tokenizer.
    """
    from cbrun.engine.core.tokenizer import load_tokenizer as load

    try:
        return load(model_path, loader=loader)
    except (ValueError, OSError) as exc:
        raise JobError(f"cannot load the tokenizer from {model_path!r}: {exc}") from None


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


def output_carried_fields(keep_columns: list[str], reader: PromptReader | OpenAIBatchReader) -> list[pa.Field]:
    """The Arrow fields the job's output rows carry beyond ``OUTPUT_SCHEMA`` (``cbrun.jobs.input.carry``).

    Args:
        keep_columns: ``output.keep_columns``, the input columns (or OpenAI request fields) the rows keep.
        reader: the job's reader (``open_reader``), whose schema gives the kept columns' types.
    """
    derived = OPENAI_FIELDS if isinstance(reader, OpenAIBatchReader) else []
    return carried_fields(keep_columns, reader.schema, derived)


def model_vocab_size(model_path: str) -> int | None:
    """``vocab_size`` of the model directory's config.json (None when it has none)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return config.get("vocab_size")
