"""Load a Llama-family model straight from its safetensors files, without importing transformers.

Importing transformers and building its modules costs a few seconds of a short job (``import transformers``, its
config and modeling imports, ``from_pretrained``'s checkpoint conversion), while the lean forward pass
(``cbrun.engine.model.lean_llama``) needs only the tensors. This loader reads ``config.json`` (``cbrun.engine.model.llama_config``) and the
weights with safetensors' own API (``safe_open``: the header is parsed and the file memory-mapped), checks every
tensor's name and shape against the config, casts to the engine's dtype and builds ``LlamaWeights``: the same
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

from cbrun.engine.model.int4 import from_awq, from_compressed_tensors, from_gptq
from cbrun.engine.model.llama_config import LlamaConfig, parse_llama_config, read_config_json
from cbrun.engine.model.llama_weights import LayerWeights, LlamaWeights, default_rope_inv_freq
from cbrun.engine.model.moe import MoEWeights
from cbrun.engine.model.parallel import TensorParallelWeights, read_shard
from cbrun.engine.model.quantization import FP8_DTYPE, QuantizedExperts, QuantizedLinearWeight, QuantizedWeight

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Each decoder layer's projections, by their names under ``model.layers.{i}.``.
_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
_DENSE_MLP = _PROJECTIONS[4:]
#: model_type -> the MoE block's name under ``model.layers.{i}.`` and each expert's (gate, up, down) names;
#: the router is ``{block}.gate``, expert ``e``'s projections ``{block}.experts.{e}.{name}``.
_MOE_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}


class LeanModel:
    """A Llama-family model loaded without transformers: its config and tensors. It has no forward pass of its
    own: the engine runs it through ``cbrun.engine.model.lean_llama.LeanLlama``.

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
    config, reason = parse_llama_config(raw)
    if config is None:
        return None, reason
    if dtype == "auto" and config.dtype is None:
        return None, "dtype = auto, and config.json states no dtype"
    files, reason = _tensor_files(model_dir)
    if files is None:
        return None, reason
    expected = expected_shapes(config)
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
    if scheme is None:
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
            (``cbrun.engine.model.parallel.ShardLayout.split_of``); None reads the whole model.

    Raises:
        RuntimeError: a tensor's shape is not the one config.json implies.
        safetensors.SafetensorError: a weight file is corrupt.
    """
    config, shapes = plan.config, expected_shapes(plan.config)
    part_of = {tensor: (weight, suffix) for weight, parts in plan.quantized.items() for suffix, tensor in parts.items()}
    tensors: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for path in sorted(set(plan.files.values())):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if parallel is not None and not parallel.layout.holds(name):  # another rank's expert
                    continue
                if name in part_of:  # kept as stored, checked as a whole below
                    weight, suffix = part_of[name]
                    parts.setdefault(weight, {})[suffix] = handle.get_tensor(name).to(device=device)
                    continue
                shape = tuple(handle.get_slice(name).get_shape())
                if shape != shapes[name]:
                    raise RuntimeError(
                        f"tensor {name} in {path.name} has shape {list(shape)}, but config.json "
                        f"implies {list(shapes[name])}"
                    )
                tensor = handle.get_tensor(name) if parallel is None else read_shard(handle, name, parallel.layout)
                if tensor.dtype.itemsize == 1 and tensor.dtype.is_floating_point:
                    raise RuntimeError(f"tensor {name} is {tensor.dtype} without a scale tensor")
                tensors[name] = tensor.to(device=device, dtype=plan.dtype)
    for name, stored in parts.items():
        # NOTE: a quantized weight stays quantized: it is dequantized in the GEMM, never here.
        tensors[name] = _quantized(plan, name, shapes[name], stored)
    weights = _weights(config, tensors, device, parallel.layout.local_experts if parallel is not None else None)
    weights.parallel = parallel
    return LeanModel(config, weights)


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


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a transformers checkpoint of this config holds, with its shape."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    features = {
        "self_attn.q_proj": (hidden, q_out, config.qkv_bias),
        "self_attn.k_proj": (hidden, kv_out, config.qkv_bias),
        "self_attn.v_proj": (hidden, kv_out, config.qkv_bias),
        "self_attn.o_proj": (q_out, hidden, config.o_bias),
        "mlp.gate_proj": (hidden, inter, config.mlp_bias),
        "mlp.up_proj": (hidden, inter, config.mlp_bias),
        "mlp.down_proj": (inter, hidden, config.mlp_bias),
    }
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    sparse = set(config.moe.sparse_layers) if config.moe else set()
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        if config.qk_norm:
            shapes[prefix + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[prefix + "self_attn.k_norm.weight"] = (head_dim,)
        for name in _PROJECTIONS[:4] if i in sparse else _PROJECTIONS:
            in_features, out_features, bias = features[name]
            shapes[f"{prefix}{name}.weight"] = (out_features, in_features)
            if bias:
                shapes[f"{prefix}{name}.bias"] = (out_features,)
        if i in sparse:
            shapes.update(_expert_shapes(config, prefix))
    return shapes


def _expert_shapes(config: LlamaConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """A MoE layer's router and per-expert tensors, as the family's checkpoints name them."""
    block, (gate, up, down) = _MOE_NAMES[config.model_type]
    hidden, width = config.hidden_size, config.moe.intermediate_size
    shapes = {f"{prefix}{block}.gate.weight": (config.moe.num_experts, hidden)}
    for e in range(config.moe.num_experts):
        expert = f"{prefix}{block}.experts.{e}."
        shapes[f"{expert}{gate}.weight"] = (width, hidden)
        shapes[f"{expert}{up}.weight"] = (width, hidden)
        shapes[f"{expert}{down}.weight"] = (hidden, width)
    return shapes


def _moe_weights(
    config: LlamaConfig, tensors: dict[str, torch.Tensor], prefix: str, expert_ids: range | None = None
) -> MoEWeights:
    """A MoE layer's per-expert tensors stacked as ``MoEWeights`` (each expert's gate rows, then its up rows),
    the per-expert tensors dropped from ``tensors`` as they are stacked (one layer's experts held twice at most).
    ``expert_ids``: the experts to stack (a tensor-parallel rank's), None for all; the router is always whole."""
    block, (gate, up, down) = _MOE_NAMES[config.model_type]
    moe = config.moe
    expert_ids = range(moe.num_experts) if expert_ids is None else expert_ids
    experts = [f"{prefix}{block}.experts.{e}." for e in expert_ids]
    gate_ups = [(tensors.pop(e + gate + ".weight"), tensors.pop(e + up + ".weight")) for e in experts]
    downs = [tensors.pop(e + down + ".weight") for e in experts]
    if any(isinstance(w, QuantizedLinearWeight) for pair in gate_ups for w in pair + (downs[0],)):
        # a quantized checkpoint's experts stay quantized, each as it was stored (``QuantizedExperts``)
        dtype = next(w.dtype for pair in gate_ups for w in pair if isinstance(w, QuantizedLinearWeight))
        if not all(isinstance(w, QuantizedLinearWeight) for pair in gate_ups for w in pair + tuple(downs)):
            raise RuntimeError(f"{prefix}{block}: some experts' projections are quantized and some are not")
        gate_up = QuantizedExperts([list(pair) for pair in gate_ups], dtype)
        down_proj = QuantizedExperts([[w] for w in downs], dtype)
    else:
        gate_up = torch.stack([torch.cat(pair) for pair in gate_ups])
        down_proj = torch.stack(downs)
    return MoEWeights(
        router=tensors[f"{prefix}{block}.gate.weight"],
        gate_up=gate_up,
        down=down_proj,
        top_k=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob,
        weights_in_model_dtype=moe.weights_in_model_dtype,
    )


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


def _weights(
    config: LlamaConfig, tensors: dict[str, torch.Tensor], device: str, experts: range | None = None
) -> LlamaWeights:
    """The loaded tensors as ``LlamaWeights``, with transformers' epsilons, softmax scale and RoPE frequencies;
    ``experts``: the MoE experts loaded (a tensor-parallel rank's), None for all."""
    eps, scale = config.rms_norm_eps, config.head_dim**-0.5

    def linear(name: str):
        return tensors[name + ".weight"], tensors.get(name + ".bias")

    layers = []
    sparse = set(config.moe.sparse_layers) if config.moe else set()
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k, v, o = (linear(p + name) for name in _PROJECTIONS[:4])
        gate, up, down = (None, None, None) if i in sparse else (linear(p + name) for name in _DENSE_MLP)
        layers.append(
            LayerWeights(
                input_norm=tensors[p + "input_layernorm.weight"],
                input_eps=eps,
                post_norm=tensors[p + "post_attention_layernorm.weight"],
                post_eps=eps,
                q=q,
                k=k,
                v=v,
                o=o,
                gate=gate,
                up=up,
                down=down,
                scale=scale,
                q_norm=tensors.get(p + "self_attn.q_norm.weight"),
                k_norm=tensors.get(p + "self_attn.k_norm.weight"),
                qk_norm_eps=eps,
                moe=_moe_weights(config, tensors, p, experts) if i in sparse else None,
            )
        )
    embed = tensors["model.embed_tokens.weight"]
    lm_head = (embed, None) if config.tie_word_embeddings else linear("lm_head")
    return LlamaWeights(
        embed=embed,
        layers=layers,
        final_norm=tensors["model.norm.weight"],
        final_eps=eps,
        lm_head=lm_head,
        head_dim=config.head_dim,
        inv_freq=default_rope_inv_freq(config.rope_theta, config.head_dim, device),
        attention_scaling=1.0,
        max_position_embeddings=config.max_position_embeddings,
    )
