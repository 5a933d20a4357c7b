"""The Qwen3 family (``Qwen3ForCausalLM``) without sliding layers: the Llama-style decoder with a per-head RMSNorm on
queries and keys before RoPE, and ``Qwen3Config``'s defaults (``head_dim`` 128, not hidden_size // heads)."""

from __future__ import annotations

from cbrun.engine.model.models.llama import LlamaDecoderFamily
from cbrun.engine.model.models.qwen2 import unsupported_qwen_value


class Qwen3Family(LlamaDecoderFamily):
    """``Qwen3ForCausalLM`` (transformers 5.24's ``Qwen3Config`` defaults)."""

    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    config_keys = frozenset(
        {"attention_bias", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
    )
    defaults = {"bos_token_id": None, "eos_token_id": None, "num_key_value_heads": 32, "head_dim": 128}
    qk_norm = True

    def unsupported_value(self, raw: dict) -> str | None:
        return unsupported_qwen_value(raw)
