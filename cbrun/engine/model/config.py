"""A decoder's ``config.json`` read without transformers, for the safetensors loader: the fields every lean-path
family shares (``LlamaConfig``), the keys every family reads, and the checks of a parsed config.

Each family file (``cbrun.engine.model.models``) adds its own keys and transformers 5's defaults for them; its
``parse_config`` (``cbrun.engine.model.models.llama.LlamaDecoderFamily``) refuses, with a reason, anything whose
meaning it does not reproduce exactly as transformers 5 does: another ``model_type``, a key it does not know
(``partial_rotary_factor``, ...), a ``quantization_config`` whose layout ``cbrun.engine.model.layers.quantization``
does not implement, a RoPE type ``cbrun.engine.model.layers.rotary_embedding`` does not implement, a sliding window,
an activation other than SiLU, a missing shape field. Refused configs load through transformers, as before.
``tests/engine/model/test_safetensors_loader.py`` checks every parsed field against ``AutoConfig``.

The result answers the attribute names the engine reads from a transformers config (``num_hidden_layers``,
``num_key_value_heads``, ``get_text_config()``, ...), so the engine reads either kind the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cbrun.engine.model.layers.moe import MoEConfig
from cbrun.engine.model.layers.quantization.schemes import QuantScheme

#: Keys with no effect on a loaded model's outputs in eval mode (bookkeeping, training-only, cache flags), in every
#: family.
INERT_KEYS = frozenset(
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
#: The model's sizes: each a positive integer (``unsupported_shape``).
SIZE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
#: Keys every family's config is read for (a family file adds its own; the rest are refused).
READ_KEYS = frozenset(
    {
        *SIZE_KEYS,
        "hidden_act",
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
#: Fields a config must state (transformers' defaults for them describe some 7B model, never this one).
REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "rms_norm_eps",
)
DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a lean-path family's config that the engine and the family's forward pass read.

    Attributes:
        model_type: the family's ``model_type`` (``cbrun.engine.model.registry``).
        architecture: the transformers class ``AutoModelForCausalLM`` builds for it.
        vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
            head_dim: the shapes (``head_dim`` defaults to hidden_size // num_attention_heads).
        max_position_embeddings: the model's maximum length in tokens.
        rms_norm_eps: every RMSNorm's epsilon.
        rope_theta: the RoPE's base; rope_type: its type (``cbrun.engine.model.layers.rotary_embedding.ROPE_INIT``);
            rope_parameters: the type's other parameters (``RopeParameters.params``: YaRN's factor, ...).
        tie_word_embeddings: the LM head is the embedding matrix.
        attention_bias: the config's ``attention_bias`` (False when it states none).
        mlp_bias: gate/up/down projections have biases (Llama's ``mlp_bias``).
        qkv_bias, o_bias: the q/k/v and the o projections have biases (by the family's rule: Qwen2's q/k/v always).
        bos_token_id, eos_token_id: as in the file (an int, a list or None), else the family's default.
        dtype: the checkpoint's dtype name ("float32", "bfloat16", "float16"), or None when the file states none.
        qk_norm: an RMSNorm over each query and key head before RoPE (Qwen3, Qwen3-MoE).
        moe: the experts' settings of a MoE family, None for a dense one.
        quantization: the checkpoint's quantized layout (``cbrun.engine.model.layers.quantization``), None when unquantized.
        sliding_window: the window in tokens of the layers ``layer_types`` names "sliding_attention" (gpt-oss);
            None where no layer slides one (the other families refuse configs with one).
        layer_types: per layer, "full_attention" or "sliding_attention" (transformers' names, which
            ``cbrun.engine.core.kv_layout.KVLayout`` reads); None: every layer attends fully.
    """

    model_type: str
    architecture: str
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
    qkv_bias: bool
    o_bias: bool
    bos_token_id: int | list[int] | None
    eos_token_id: int | list[int] | None
    dtype: str | None
    qk_norm: bool = False
    moe: MoEConfig | None = None
    quantization: QuantScheme | None = None
    rope_type: str = "default"
    rope_parameters: tuple[tuple[str, object], ...] = ()
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    is_encoder_decoder = False

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


def unsupported_shape(config: LlamaConfig) -> str | None:
    """Why a parsed config's shapes are ones transformers would refuse or read another way (it raises; the fallback
    shows its error), or None."""
    for name in SIZE_KEYS:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name} = {value!r} is not a positive integer"
    if config.num_attention_heads % config.num_key_value_heads or config.head_dim % 2:
        return "num_attention_heads is not a multiple of num_key_value_heads, or head_dim is odd"
    moe = config.moe
    if moe is not None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(moe, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                return f"the MoE's {name} = {value!r} is not a positive integer"
        if moe.top_k > moe.num_experts:
            return f"num_experts_per_tok = {moe.top_k} exceeds the {moe.num_experts} experts"
    if isinstance(config.rms_norm_eps, bool) or not isinstance(config.rms_norm_eps, (int, float)):
        return f"rms_norm_eps = {config.rms_norm_eps!r} is not a number"
    if isinstance(config.rope_theta, bool) or not isinstance(config.rope_theta, (int, float)):
        return f"rope_theta = {config.rope_theta!r} is not a number"
    return None
