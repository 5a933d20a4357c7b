"""Setup checks: every resource a manifest names is checked before any work, and a missing or unusable one is a
``JobError`` (the CLI's exit code 2) whose message says what to fix.

The input and its columns are checked by ``cbrun.jobs.input.reader`` (``InputError``), the output directory by
``cbrun.jobs.output.output_dir``; here: the model directory (config and weights), the tokenizer, the device
and the engine's load.
"""

from __future__ import annotations

from pathlib import Path

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

    try:
        return LLMEngine.from_pretrained(model_path, config=config, expected_requests=expected_requests)
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
