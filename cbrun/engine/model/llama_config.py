"""A Llama-family ``config.json`` read without transformers, for the safetensors loader.

``read_llama_config`` reads the fields the engine and the lean forward pass use and refuses (returns a reason)
anything whose meaning it does not reproduce exactly as transformers 5 does: another ``model_type``, a key it does
not know (``partial_rotary_factor``, ...), a ``quantization_config`` whose layout
``cbrun.engine.model.quantization`` does not implement, a RoPE type other than the default, a sliding
window, an activation other than SiLU, a missing shape field. Refused configs load through transformers, as
before. Defaults for keys a config may leave out are transformers 5.24's (``LlamaConfig``, ``MistralConfig``,
``Qwen2Config``, ``Qwen3Config``, ...); ``tests/engine/test_safetensors_loader.py`` checks every parsed field against ``AutoConfig``.

The result answers the attribute names the engine reads from a transformers config (``num_hidden_layers``,
``num_key_value_heads``, ``get_text_config()``, ...), so the engine reads either kind the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cbrun.engine.model.moe import MoEConfig
from cbrun.engine.model.quantization import QuantScheme, read_quantization

#: model_type -> the transformers class ``AutoModelForCausalLM`` builds for it (the lean path's families).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

#: Keys with no effect on a loaded model's outputs in eval mode (bookkeeping, training-only, cache flags).
_INERT_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "_name_or_path",
        "initializer_range",
        "use_cache",
        "attention_dropout",
        "pad_token_id",
        "pretraining_tp",
        "output_router_logits",  # training outputs: the router's logits for the auxiliary loss
        "router_aux_loss_coef",
        "router_jitter_noise",  # Mixtral's training-only noise on the MoE input
    }
)
#: Keys read here, per family (the rest of a family's keys are refused).
_READ_KEYS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
        "rope_parameters",
        "rope_theta",
        "rope_scaling",
        "dtype",
        "torch_dtype",
        "quantization_config",
    }
)
_FAMILY_KEYS = {
    "llama": frozenset({"attention_bias", "mlp_bias"}),
    "mistral": frozenset({"sliding_window"}),
    "qwen2": frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}),
    "qwen3": frozenset({"attention_bias", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}),
    "qwen3_moe": frozenset(
        {
            "attention_bias",
            "use_sliding_window",
            "sliding_window",
            "max_window_layers",
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
        }
    ),
    "mixtral": frozenset({"sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok"}),
}
#: Fields a config must state (transformers' defaults for them describe some 7B model, never this one).
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "rms_norm_eps",
)
#: transformers 5's defaults of the optional fields the engine reads, per family.
_DEFAULTS = {
    "llama": {"bos_token_id": 1, "eos_token_id": 2, "num_key_value_heads": None},
    "mistral": {"bos_token_id": 1, "eos_token_id": 2, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {"bos_token_id": None, "eos_token_id": None, "num_key_value_heads": 32},
    # Qwen3Config's head_dim defaults to 128 (not hidden_size // num_attention_heads)
    "qwen3": {"bos_token_id": None, "eos_token_id": None, "num_key_value_heads": 32, "head_dim": 128},
    "qwen3_moe": {"bos_token_id": None, "eos_token_id": None, "num_key_value_heads": 4},
    "mixtral": {"bos_token_id": 1, "eos_token_id": 2, "num_key_value_heads": None},
}
#: transformers 5's defaults of the MoE fields (``Qwen3MoeConfig``, ``MixtralConfig``).
_MOE_DEFAULTS = {
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "mixtral": {"num_experts": 8, "num_experts_per_tok": 2},
}
DEFAULT_ROPE_THETA = 10_000.0  # transformers' ``RotaryEmbeddingConfigMixin.default_theta``
DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Llama-family config that the engine and ``cbrun.engine.model.lean_llama`` read.

    Attributes:
        model_type: one of ``ARCHITECTURES``' keys.
        vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
            head_dim: the shapes (``head_dim`` defaults to hidden_size // num_attention_heads).
        max_position_embeddings: the model's maximum length in tokens.
        rms_norm_eps: every RMSNorm's epsilon.
        rope_theta: the default RoPE's base.
        tie_word_embeddings: the LM head is the embedding matrix.
        attention_bias: q/k/v/o projections have biases (Llama's ``attention_bias``); Qwen2's q/k/v always do.
        mlp_bias: gate/up/down projections have biases (Llama's ``mlp_bias``).
        bos_token_id, eos_token_id: as in the file (an int, a list or None), else the family's default.
        dtype: the checkpoint's dtype name ("float32", "bfloat16", "float16"), or None when the file states none.
        qk_norm: an RMSNorm over each query and key head before RoPE (Qwen3, Qwen3-MoE).
        moe: the experts' settings of a MoE family, None for a dense one.
        quantization: the checkpoint's quantized layout (``cbrun.engine.model.quantization``), None when unquantized.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    bos_token_id: int | list[int] | None
    eos_token_id: int | list[int] | None
    dtype: str | None
    qk_norm: bool = False
    moe: MoEConfig | None = None
    quantization: QuantScheme | None = None
    #: No layer slides a window (configs with one are refused), so the cache is all full attention.
    sliding_window = None
    layer_types = None
    is_encoder_decoder = False

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.model_type in ("llama", "qwen3", "qwen3_moe") and self.attention_bias

    def get_text_config(self) -> "LlamaConfig":
        """Itself (a transformers config's text part, for code that reads either kind)."""
        return self


def read_config_json(model_dir: str | Path) -> dict:
    """The model directory's config.json as a dict.

    Raises:
        OSError: when it is missing or unreadable.
        ValueError: when it is not a JSON object.
    """
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError("config.json is not a JSON object")
    return raw


def parse_llama_config(raw: dict) -> tuple[LlamaConfig | None, str | None]:
    """``(config, None)`` for a config this module reads exactly as transformers does, else ``(None, why not)``."""
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        return None, f"model_type {model_type!r} is not one of {', '.join(ARCHITECTURES)}"
    unknown = sorted(set(raw) - _INERT_KEYS - _READ_KEYS - _FAMILY_KEYS[model_type])
    if unknown:
        return None, f"config.json sets {', '.join(unknown)}, which the safetensors loader does not read"
    missing = [key for key in _REQUIRED if raw.get(key) is None]
    if missing:
        return None, f"config.json does not state {', '.join(missing)}"
    reason = _unsupported_value(raw, model_type)
    if reason:
        return None, reason
    quantization = None
    if raw.get("quantization_config") is not None:
        quantization, reason = read_quantization(raw["quantization_config"])
        if quantization is None:
            return None, f"quantization_config: {reason}"
    theta, reason = _rope_theta(raw)
    if reason:
        return None, reason
    defaults = _DEFAULTS[model_type]
    heads = raw["num_attention_heads"]
    num_kv_heads = raw.get("num_key_value_heads", defaults["num_key_value_heads"]) or heads
    head_dim = raw.get("head_dim") or defaults.get("head_dim") or raw["hidden_size"] // heads
    config = LlamaConfig(
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=raw["max_position_embeddings"],
        rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=theta,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        bos_token_id=raw.get("bos_token_id", defaults["bos_token_id"]),
        eos_token_id=raw.get("eos_token_id", defaults["eos_token_id"]),
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        moe=_moe_config(raw, model_type),
        quantization=quantization,
    )
    return _checked(config)


def _moe_config(raw: dict, model_type: str) -> MoEConfig | None:
    """The experts' settings, with transformers 5's defaults and its rule for which layers are sparse
    (``Qwen3MoeDecoderLayer``: not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``)."""
    if model_type not in _MOE_DEFAULTS:
        return None
    defaults = _MOE_DEFAULTS[model_type]
    num_experts = raw.get("num_experts", raw.get("num_local_experts", defaults["num_experts"]))
    top_k = raw.get("num_experts_per_tok", defaults["num_experts_per_tok"])
    layers = range(raw["num_hidden_layers"])
    if model_type == "mixtral":
        return MoEConfig(num_experts, top_k, raw["intermediate_size"], True, False, tuple(layers))
    step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
    sparse = tuple(i for i in layers if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    width = raw.get("moe_intermediate_size", defaults["moe_intermediate_size"])
    return MoEConfig(num_experts, top_k, width, bool(raw.get("norm_topk_prob", False)), True, sparse)


def _unsupported_value(raw: dict, model_type: str) -> str | None:
    """Why a stated value is outside what the lean path runs (the same limits as ``lean_llama.unsupported_reason``)."""
    if raw.get("hidden_act", "silu") != "silu":
        return f"activation {raw['hidden_act']!r} (only SiLU is implemented)"
    if model_type == "mistral" and raw.get("sliding_window", _DEFAULTS["mistral"]["sliding_window"]) is not None:
        return f"sliding_window = {raw.get('sliding_window', 4096)} (sliding-window attention is not implemented)"
    if model_type == "mixtral" and raw.get("sliding_window") is not None:
        return f"sliding_window = {raw['sliding_window']} (sliding-window attention is not implemented)"
    if model_type == "qwen3_moe":
        if raw.get("use_sliding_window"):
            return "use_sliding_window = true (sliding-window attention is not implemented)"
        step, dense = raw.get("decoder_sparse_step", 1), raw.get("mlp_only_layers") or []
        if isinstance(step, bool) or not isinstance(step, int) or step < 1 or not isinstance(dense, list):
            return f"decoder_sparse_step = {step!r} / mlp_only_layers = {dense!r} (a positive int and a list)"
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        if "head_dim" in raw and raw["head_dim"] is None:  # Qwen2's attention would take the None as its width
            return "head_dim = null"
        if raw.get("use_sliding_window"):
            return "use_sliding_window = true (sliding-window attention is not implemented)"
        layer_types = raw.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            return "layer_types other than full_attention"
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    if dtype is not None and dtype not in DTYPE_NAMES:
        return f"dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}"
    return None


def _rope_theta(raw: dict) -> tuple[float | None, str | None]:
    """The default RoPE's base, resolved as transformers' ``convert_rope_params_to_dict`` does: ``rope_scaling``
    (legacy) or ``rope_parameters``, whose ``rope_theta`` wins over a top-level ``rope_theta``, else 10000."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - {"rope_type", "type", "rope_theta"}:
        return None, f"RoPE parameters {params!r} (only the default RoPE is implemented)"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        return None, f"rope_type {rope_type!r} (only the default RoPE is implemented)"
    return params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA)), None


def _checked(config: LlamaConfig) -> tuple[LlamaConfig | None, str | None]:
    """Refuse shapes transformers would refuse or read another way (it raises; the fallback shows its error)."""
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return None, f"{name} = {value!r} is not a positive integer"
    if config.model_type == "llama" and config.hidden_size % config.num_attention_heads:
        return None, "hidden_size is not a multiple of num_attention_heads"
    if config.num_attention_heads % config.num_key_value_heads or config.head_dim % 2:
        return None, "num_attention_heads is not a multiple of num_key_value_heads, or head_dim is odd"
    moe = config.moe
    if moe is not None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(moe, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                return None, f"the MoE's {name} = {value!r} is not a positive integer"
        if moe.top_k > moe.num_experts:
            return None, f"num_experts_per_tok = {moe.top_k} exceeds the {moe.num_experts} experts"
    if isinstance(config.rms_norm_eps, bool) or not isinstance(config.rms_norm_eps, (int, float)):
        return None, f"rms_norm_eps = {config.rms_norm_eps!r} is not a number"
    if isinstance(config.rope_theta, bool) or not isinstance(config.rope_theta, (int, float)):
        return None, f"rope_theta = {config.rope_theta!r} is not a number"
    return config, None
