"""The lean path's model families by ``model_type`` (config.json) and by architecture (the transformers class):
vLLM's model registry. Adding a family is one file in ``cbrun.engine.model.models`` and one line in ``FAMILIES``.

Everything family-specific is asked of the family (``cbrun.engine.model.family.ModelFamily``): this module only
finds it, and refuses by name a model no family implements.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cbrun.engine.model.config import LlamaConfig, read_config_json
from cbrun.engine.model.family import ModelFamily
from cbrun.engine.model.layers.quantization import schemes
from cbrun.engine.model.models.gpt_oss import GptOssFamily
from cbrun.engine.model.models.llama import LlamaFamily, MistralFamily
from cbrun.engine.model.models.mixtral import MixtralFamily
from cbrun.engine.model.models.qwen2 import Qwen2Family
from cbrun.engine.model.models.qwen2_moe import Qwen2MoeFamily
from cbrun.engine.model.models.qwen3 import Qwen3Family
from cbrun.engine.model.models.qwen3_moe import Qwen3MoeFamily
from cbrun.engine.model.weights import LlamaWeights

#: The families the lean path runs, one line each.
FAMILIES: tuple[ModelFamily, ...] = (
    LlamaFamily(),
    MistralFamily(),
    Qwen2Family(),
    Qwen3Family(),
    Qwen3MoeFamily(),
    Qwen2MoeFamily(),
    MixtralFamily(),
    GptOssFamily(),
)


def family_for_model_type(model_type: object) -> ModelFamily | None:
    """The family whose config.json ``model_type`` this is, None when no family is."""
    return next((f for f in FAMILIES if f.model_type == model_type), None)


def family_for_architecture(architecture: str) -> ModelFamily | None:
    """The family of a transformers causal-LM class name (``LlamaForCausalLM``), None when no family is."""
    return next((f for f in FAMILIES if f.architecture == architecture), None)


def parse_config(raw: dict) -> tuple[LlamaConfig | None, str | None]:
    """``(config, None)`` for a config.json (as a dict) its family reads exactly as transformers does, else
    ``(None, why not)``: no family has its ``model_type``, or the family refuses it (``ModelFamily.parse_config``)."""
    model_type = raw.get("model_type")
    family = family_for_model_type(model_type)
    if family is None:
        return None, f"model_type {model_type!r} is not one of {', '.join(f.model_type for f in FAMILIES)}"
    return family.parse_config(raw)


def family_of(config: LlamaConfig) -> ModelFamily:
    """The family of a config ``parse_config`` gave."""
    family = family_for_model_type(config.model_type)
    assert family is not None, "parse_config gives configs of registered families only"
    return family


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the lean forward pass cannot run a transformers model exactly as transformers does, or None when its
    family's can."""
    name = type(model).__name__
    family = family_for_architecture(name)
    # The exact class, not a subclass: a subclass may change the forward pass.
    if family is None or type(model).__module__.split(".")[0] != "transformers":
        return f"{name} is not one of transformers' {', '.join(f.architecture for f in FAMILIES)}"
    return family.unsupported_module_reason(model)


def weights_from_module(model: torch.nn.Module) -> LlamaWeights:
    """The tensors of a transformers model that ``unsupported_reason`` accepts (its own tensors, not copies).

    Raises:
        ValueError: naming the reason when the model is not supported.
    """
    reason = unsupported_reason(model)
    if reason:
        raise ValueError(f"the lean model path cannot run this model: {reason}")
    family = family_for_architecture(type(model).__name__)
    assert family is not None
    return family.weights_from_module(model)


def checkpoint_quantization(model_dir: str | Path) -> schemes.QuantScheme | None:
    """The model directory's quantization (``schemes.checkpoint_quantization``), None for an unquantized
    checkpoint, refusing as well a layout the model's family does not read (mxfp4 outside gpt-oss's experts).

    Raises:
        ValueError: naming the ``quantization_config`` and why, with what cbrun implements.
    """
    scheme = schemes.checkpoint_quantization(model_dir)
    if scheme is None:
        return None
    family = family_for_model_type(read_config_json(model_dir).get("model_type"))
    reason = family.unsupported_quantization(scheme) if family is not None else None
    if reason:
        raise ValueError(schemes.refusal(reason))
    return scheme
