"""The Qwen2 family (``Qwen2ForCausalLM``) without sliding layers: the Llama-style decoder whose q/k/v projections
always have biases (and o_proj none), with ``Qwen2Config``'s defaults."""

from __future__ import annotations

from cbrun.engine.model.models.llama import LlamaDecoderFamily


def unsupported_qwen_value(raw: dict) -> str | None:
    """The Qwen families' refusals of stated values: ``head_dim = null`` (Qwen2's attention would take the None as
    its width), and any sliding window (``use_sliding_window``, ``layer_types`` other than full attention)."""
    if "head_dim" in raw and raw["head_dim"] is None:
        return "head_dim = null"
    if raw.get("use_sliding_window"):
        return "use_sliding_window = true (sliding-window attention is not implemented)"
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return "layer_types other than full_attention"
    return None


class Qwen2Family(LlamaDecoderFamily):
    """``Qwen2ForCausalLM`` (transformers 5.24's ``Qwen2Config`` defaults)."""

    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    config_keys = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
    defaults = {"bos_token_id": None, "eos_token_id": None, "num_key_value_heads": 32}

    def unsupported_value(self, raw: dict) -> str | None:
        return unsupported_qwen_value(raw)

    def biases(self, raw: dict) -> tuple[bool, bool]:
        return True, False
