"""How the lm-eval backend loads what it runs on: the device, the tokenizer and the engine.

This module owns the loading steps of ``cbrun.jobs.integrations.lm_eval_backend.CbrunLM`` (the model itself loads through
``cbrun.engine.llm_engine.load_model``, as ``cbrun run`` loads it): the device lm-eval asks for, or the CPU where it is
missing (``resolve_device``); the tokenizer ``AutoTokenizer`` would load, built directly where that is
transformers' generic ``TokenizersBackend`` (``load_tokenizer``); the engine over the loaded model
(``build_engine``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from cbrun.engine.config import EngineConfig
from cbrun.engine.llm_engine import LLMEngine
from cbrun.engine.model.loader import eos_token_ids

logger = logging.getLogger("cbrun.lm_eval")


def resolve_device(device: str | None) -> str:
    """The device to run on: lm-eval's CLI asks for "cuda:0" by default, so a CUDA device on a machine without one
    falls back to the CPU (as ``hf`` does)."""
    if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
        if device is not None:
            logger.info("cbrun: device %s is not available; running on the CPU", device)
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)


def load_tokenizer(path: str, add_bos_token: bool | None):
    """The tokenizer ``AutoTokenizer`` loads; for a tokenizer saved as transformers' generic ``TokenizersBackend``
    (a tokenizer.json, as ``cbrun convert-llama2c`` writes), that class directly (``generic_tokenizer_class``)."""
    from transformers import AutoTokenizer

    kwargs = {} if add_bos_token is None else {"add_bos_token": add_bos_token}
    return (generic_tokenizer_class(path) or AutoTokenizer).from_pretrained(path, local_files_only=True, **kwargs)


def generic_tokenizer_class(path: str):
    """``TokenizersBackend`` where ``AutoTokenizer`` is known to pick it, else None (``AutoTokenizer`` decides).

    ``AutoTokenizer`` first reads the model's config through transformers' configuration classes, whose imports
    (model-loading and distributed modules this backend never uses) cost about a second per run. Where
    ``tokenizer_config.json`` names ``TokenizersBackend`` and no remote code, its rules (transformers 5) end in that
    class, except for model types it overrides (``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``) and Mistral's format
    (``MistralCommonBackend``): those, and anything else, go to ``AutoTokenizer``.
    """
    try:
        from transformers.models.auto.tokenization_auto import (
            MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
            TOKENIZER_MAPPING_NAMES,
        )
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its AutoTokenizer decides
        return None
    try:
        tokenizer_config = json.loads((Path(path) / "tokenizer_config.json").read_text(encoding="utf-8"))
        model_type = json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    if tokenizer_config.get("tokenizer_class") != "TokenizersBackend" or "auto_map" in tokenizer_config:
        return None
    if model_type in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS or not (Path(path) / "tokenizer.json").is_file():
        return None
    if (TOKENIZER_MAPPING_NAMES.get(model_type) or "").removesuffix("Fast") == "MistralCommonBackend":
        return None
    return TokenizersBackend


def build_engine(path: str, model: torch.nn.Module, config: EngineConfig, tokenizer, max_length: int):
    """An engine whose length limit admits a scoring window of ``max_length + 1`` tokens plus the sampled token.

    ``hf`` runs ``max_length`` positions per window; the engine also runs the window's last token (positions up to
    ``max_length``, one past them) because it samples after every prompt. Rotary models compute any position;
    a model with learned position embeddings of exactly ``max_length`` rows needs ``max_length`` one lower.
    """
    return LLMEngine(model, config, eos_token_ids(path, model.config), max_length + 2, tokenizer)
