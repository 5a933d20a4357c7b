"""Load a lean-path family's model straight from its safetensors files, without importing transformers.

Importing transformers and building its modules costs a few seconds of a short job (``import transformers``, its
config and modeling imports, ``from_pretrained``'s checkpoint conversion), while the lean forward pass
(``cbrun.engine.model.models.llama``) needs only the tensors. This loader reads ``config.json`` (``cbrun.engine.model.config``) and the
weights with safetensors' own API (``safe_open``: the header is parsed and the file memory-mapped), checks every
tensor's name and shape against the ones the model's family names (``cbrun.engine.model.registry``), casts to the
engine's dtype and has the family build its ``LlamaWeights``: the same
tensors transformers would hold, so the lean pass computes the same logits (``tests/engine/
test_safetensors_loader.py`` checks them ``torch.equal``).

``load_plan`` says whether a directory can be loaded this way; anything else (another architecture, ``.bin``
weights, tensor names transformers would rename or ignore, a config key not read here) is left to transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from cbrun.engine.model import registry
from cbrun.engine.model.config import LlamaConfig, read_config_json
from cbrun.engine.model.family import ModelFamily
from cbrun.engine.model.layers.parallel import TensorParallelWeights, read_quantized_shard, read_shard
from cbrun.engine.model.layers.quantization.base import QuantizedLinearWeight
from cbrun.engine.model.layers.quantization.fp8 import FP8_DTYPE, QuantizedWeight
from cbrun.engine.model.layers.quantization.int4 import from_awq, from_compressed_tensors, from_gptq
from cbrun.engine.model.weights import LlamaWeights

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LeanModel:
    """A Llama-family model loaded without transformers: its config and tensors. It has no forward pass of its
    own: the engine runs it through ``cbrun.engine.model.models.llama.LeanLlama``.

    It answers what the engine reads from a model: ``config`` (a ``LlamaConfig``) and ``parameters()``.
    """

    def __init__(self, config: LlamaConfig, weights: LlamaWeights) -> None:
        self.config = config
        self.weights = weights

    def parameters(self) -> Iterator[torch.Tensor]:
        """Every distinct tensor once, the embedding first (its dtype and device are the model's)."""
        return self.weights.tensors()


@dataclass(frozen=True)
class LoadPlan:
    """What ``load`` reads: the parsed config, the dtype to load in, which file holds each tensor, and, in a
    quantized checkpoint, the tensors each quantized linear is stored in (its weight name -> {suffix: tensor
    name}, the suffixes ``QuantScheme.suffixes``)."""

    model_dir: Path
    config: LlamaConfig
    dtype: torch.dtype
    files: dict[str, Path]  # tensor name -> safetensors file
    quantized: dict[str, dict[str, str]] = field(default_factory=dict)


def load_plan(model_dir: str | Path, dtype: str) -> tuple[LoadPlan | None, str | None]:
    """``(plan, None)`` when this loader reads the directory exactly as transformers would, else ``(None, why)``.

    Args:
        model_dir: the model directory.
        dtype: the engine's dtype setting ("float32", "bfloat16", "float16" or "auto": the config's).

    Raises:
        safetensors.SafetensorError: a weight file's header is corrupt or the file is truncated.
    """
    model_dir = Path(model_dir)
    try:
        raw = read_config_json(model_dir)
    except (OSError, ValueError) as exc:
        return None, f"config.json is unreadable ({exc})"
    config, reason = registry.parse_config(raw)
    if config is None:
        return None, reason
    if dtype == "auto" and config.dtype is None:
        return None, "dtype = auto, and config.json states no dtype"
    files, reason = _tensor_files(model_dir)
    if files is None:
        return None, reason
    expected = registry.family_of(config).checkpoint_shapes(config)
    quantized, reason = _quantized_names(config, files)
    if reason:
        return None, reason
    names = (set(files) - {t for parts in quantized.values() for t in parts.values()}) | set(quantized)
    if names != set(expected):
        missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
        return None, (
            f"the checkpoint's tensor names are not the {config.architecture} names this loader reads "
            f"(missing {missing[:3]}, unexpected {extra[:3]})"
        )
    return LoadPlan(model_dir, config, _DTYPES[config.dtype if dtype == "auto" else dtype], files, quantized), None


def _quantized_names(config: LlamaConfig, files: dict[str, Path]) -> tuple[dict[str, dict[str, str]], str | None]:
    """{weight name: {suffix: tensor name}} for each quantized linear of a quantized checkpoint (those with the
    scheme's first suffix; MoE experts' included), or a reason: one lacks a tensor of its layout, or the
    checkpoint holds none at all."""
    scheme = config.quantization
    if scheme is None or not scheme.suffixes:  # none, or stacked experts the family names itself (mxfp4)
        return {}, None
    marker, *rest = scheme.suffixes
    quantized: dict[str, dict[str, str]] = {}
    for name in sorted(files):
        if not name.endswith("." + marker):
            continue
        base = name[: -len(marker)]
        parts = {suffix: base + suffix for suffix in (marker, *rest) if base + suffix in files}
        missing = [base + s for s in rest if s not in parts and s not in scheme.optional_suffixes]
        if missing:
            return {}, f"{scheme.method} quantized tensor {name} without {missing[0]}"
        quantized[base + "weight"] = parts
    if not quantized:
        return {}, f"config.json states {scheme.method} quantization, but no tensor is named *.{marker}"
    return quantized, None


def load(plan: LoadPlan, device: str, parallel: TensorParallelWeights | None = None) -> LeanModel:
    """Read the plan's tensors onto ``device`` in its dtype.

    Args:
        plan: what to read (``load_plan``).
        device: where the tensors go.
        parallel: a tensor-parallel rank's share: only its slice of each split tensor is read
            (``cbrun.engine.model.layers.parallel.ShardLayout.split``, by the family's ``shard_style``; of a
            quantized linear, the parts of its stored tensors that hold that slice: ``read_quantized_shard``); None
            reads the whole model.

    Raises:
        RuntimeError: a tensor's shape is not the one config.json implies.
        safetensors.SafetensorError: a weight file is corrupt.
    """
    config = plan.config
    family = registry.family_of(config)
    shapes = family.checkpoint_shapes(config)
    tensors, parts = _read_files(plan, family, shapes, device, parallel)
    for name, stored in parts.items():
        # NOTE: a quantized weight stays quantized: it is dequantized in the GEMM, never here.
        shape = (
            shapes[name] if parallel is None else parallel.layout.local_shape(shapes[name], family.shard_style(name))
        )
        tensors[name] = _quantized(plan, name, shape, stored)
    weights = family.checkpoint_weights(
        config, tensors, device, parallel.layout.local_experts if parallel is not None else None
    )
    weights.parallel = parallel
    return LeanModel(config, weights)


def _read_files(
    plan: LoadPlan,
    family: ModelFamily,
    shapes: dict[str, tuple[int, ...]],
    device: str,
    parallel: TensorParallelWeights | None,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Every tensor of the plan this rank holds (another rank's experts skipped), on ``device``: the plain ones in
    the plan's dtype (name -> tensor), each quantized linear's stored tensors as stored (weight name -> suffix ->
    tensor), both this rank's slices under ``parallel``."""
    part_of = {tensor: (weight, suffix) for weight, parts in plan.quantized.items() for suffix, tensor in parts.items()}
    tensors: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for path in sorted(set(plan.files.values())):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if parallel is not None and not parallel.layout.holds(name):  # another rank's expert
                    continue
                if name not in part_of:
                    tensor = _read_plain(handle, name, path, shapes[name], family, parallel)
                    tensors[name] = tensor.to(device=device, dtype=_load_dtype(name, tensor.dtype, plan.dtype, family))
                    continue
                weight, suffix = part_of[name]  # kept as stored, checked as a whole by ``_quantized``
                if parallel is None:
                    part = handle.get_tensor(name)
                else:
                    scheme, style = plan.config.quantization, family.shard_style(weight)
                    part = read_quantized_shard(handle, name, suffix, shapes[weight], scheme, parallel.layout, style)
                parts.setdefault(weight, {})[suffix] = part.to(device=device)
    return tensors, parts


def _read_plain(
    handle, name: str, path: Path, shape: tuple[int, ...], family: ModelFamily, parallel: TensorParallelWeights | None
) -> torch.Tensor:
    """An unquantized tensor (this rank's slice of it under ``parallel``), in the file's dtype.

    Raises:
        RuntimeError: its shape is not ``shape`` (config.json's), or it is 8-bit float without a scale tensor.
    """
    stored = tuple(handle.get_slice(name).get_shape())
    if stored != shape:
        raise RuntimeError(
            f"tensor {name} in {path.name} has shape {list(stored)}, but config.json implies {list(shape)}"
        )
    if parallel is None:
        tensor = handle.get_tensor(name)
    else:
        tensor = read_shard(handle, name, parallel.layout, family.shard_style(name))
    if tensor.dtype.itemsize == 1 and tensor.dtype.is_floating_point:
        raise RuntimeError(f"tensor {name} is {tensor.dtype} without a scale tensor")
    return tensor


def _load_dtype(name: str, stored: torch.dtype, dtype: torch.dtype, family: ModelFamily) -> torch.dtype:
    """The dtype a plain tensor is loaded in: the engine's ``dtype``; integers (packed codes or scales, mxfp4's
    ``*_blocks`` / ``*_scales``) as stored, the family checks them; float32 under float16 for the names the family
    keeps so (``ModelFamily.keep_in_float32``, as transformers' ``_keep_in_fp32_modules``)."""
    if not stored.is_floating_point:
        return stored
    if dtype == torch.float16 and any(part in name for part in family.keep_in_float32):
        return torch.float32
    return dtype


def _quantized(
    plan: LoadPlan, name: str, shape: tuple[int, ...], stored: dict[str, torch.Tensor]
) -> QuantizedLinearWeight:
    """A quantized linear's weight from its stored tensors (by suffix), checked against the scheme and the
    (out_features, in_features) ``shape`` config.json implies.

    Raises:
        RuntimeError: a tensor's dtype or shape is not the layout's.
    """
    scheme = plan.config.quantization
    if scheme.layout == "pack-quantized":
        return from_compressed_tensors(name, shape, stored, scheme.group_size, scheme.symmetric, plan.dtype)
    if scheme.layout == "gptq":
        return from_gptq(name, shape, stored, scheme.group_size, plan.dtype)
    if scheme.layout == "awq":
        return from_awq(name, shape, stored, scheme.group_size, plan.dtype)
    weight, scale = stored["weight"], stored[scheme.scale_suffix].to(torch.float32)
    if tuple(weight.shape) != shape:
        raise RuntimeError(f"tensor {name} has shape {list(weight.shape)}, but config.json implies {list(shape)}")
    if weight.dtype != FP8_DTYPE:
        raise RuntimeError(f"tensor {name} is {weight.dtype}, but a {scheme.method} quantized weight is {FP8_DTYPE}")
    block = scheme.block_of(tuple(weight.shape), tuple(scale.shape))
    if block is None:
        raise RuntimeError(
            f"tensor {plan.quantized[name][scheme.scale_suffix]} has shape {list(scale.shape)}, which is not a "
            f"{scheme.method} scale of the {list(weight.shape)} weight {name}"
        )
    return QuantizedWeight(weight, scale.reshape(-(-weight.shape[0] // block[0]), -1), block, plan.dtype)


def _tensor_files(model_dir: Path) -> tuple[dict[str, Path] | None, str | None]:
    """Tensor name -> file, from ``model.safetensors`` or else the index's shards (transformers' order)."""
    single, index = model_dir / WEIGHTS_NAME, model_dir / WEIGHTS_INDEX_NAME
    if single.is_file():
        paths = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            paths = sorted({model_dir / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return None, f"{WEIGHTS_INDEX_NAME} is unreadable ({exc})"
        if not all(p.is_file() for p in paths):
            return None, f"a shard named in {WEIGHTS_INDEX_NAME} is missing"
    else:
        return None, f"no {WEIGHTS_NAME} (or {WEIGHTS_INDEX_NAME}): the weights are in another format"
    files: dict[str, Path] = {}
    for path in paths:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if name in files:
                    return None, f"tensor {name} is in two files"
                files[name] = path
    return files, None
