"""The Mixtral family (``MixtralForCausalLM``) without a sliding window: Mistral's attention over a sparse MoE block
in every layer (``block_sparse_moe``, experts ``w1`` / ``w3`` / ``w2``), the chosen probabilities always
renormalised and the routing weights kept in float32; ``MixtralConfig``'s defaults."""

from __future__ import annotations

import torch

from cbrun.engine.model.layers.moe import MoEConfig, MoEWeights, moe_weights_from_module
from cbrun.engine.model.models.llama import LlamaDecoderFamily


class MixtralFamily(LlamaDecoderFamily):
    """``MixtralForCausalLM`` (transformers 5.24's ``MixtralConfig`` defaults)."""

    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    config_keys = frozenset({"sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok"})
    defaults = {"bos_token_id": 1, "eos_token_id": 2, "num_key_value_heads": None}
    #: transformers 5's defaults of the MoE fields
    moe_defaults = {"num_experts": 8, "num_experts_per_tok": 2}
    moe_block = ("block_sparse_moe", ("w1", "w3", "w2"))
    moe_module = "MixtralSparseMoeBlock"

    def unsupported_value(self, raw: dict) -> str | None:
        if raw.get("sliding_window") is not None:
            return f"sliding_window = {raw['sliding_window']} (sliding-window attention is not implemented)"
        return None

    def slides_window(self, model: torch.nn.Module) -> bool:
        return True  # every layer attends through the config's window

    def moe_config(self, raw: dict) -> MoEConfig:
        """Every layer sparse, each expert ``intermediate_size`` wide."""
        defaults = self.moe_defaults
        num_experts = raw.get("num_experts", raw.get("num_local_experts", defaults["num_experts"]))
        top_k = raw.get("num_experts_per_tok", defaults["num_experts_per_tok"])
        layers = tuple(range(raw["num_hidden_layers"]))
        return MoEConfig(num_experts, top_k, raw["intermediate_size"], True, False, layers)

    def moe_from_module(self, mlp: torch.nn.Module) -> MoEWeights:
        return moe_weights_from_module(mlp, norm_topk_prob=True, weights_in_model_dtype=False)
