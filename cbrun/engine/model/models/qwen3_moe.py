"""The Qwen3-MoE family (``Qwen3MoeForCausalLM``) without sliding layers: Qwen3's attention (per-head q/k RMSNorm)
over sparse MoE blocks (``cbrun.engine.model.layers.moe``) in the layers ``decoder_sparse_step`` and
``mlp_only_layers`` choose, dense gated MLPs in the rest; ``Qwen3MoeConfig``'s defaults."""

from __future__ import annotations

import torch

from cbrun.engine.model.layers.moe import MoEConfig, MoEWeights, moe_weights_from_module
from cbrun.engine.model.models.llama import LlamaDecoderFamily
from cbrun.engine.model.models.qwen2 import unsupported_qwen_value


class Qwen3MoeFamily(LlamaDecoderFamily):
    """``Qwen3MoeForCausalLM`` (transformers 5.24's ``Qwen3MoeConfig`` defaults)."""

    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    config_keys = frozenset(
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
    )
    defaults = {"bos_token_id": None, "eos_token_id": None, "num_key_value_heads": 4}
    #: transformers 5's defaults of the MoE fields
    moe_defaults = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}
    qk_norm = True
    moe_block = ("mlp", ("gate_proj", "up_proj", "down_proj"))
    moe_module = "Qwen3MoeSparseMoeBlock"

    def unsupported_value(self, raw: dict) -> str | None:
        if raw.get("use_sliding_window"):
            return "use_sliding_window = true (sliding-window attention is not implemented)"
        step, dense = raw.get("decoder_sparse_step", 1), raw.get("mlp_only_layers") or []
        if isinstance(step, bool) or not isinstance(step, int) or step < 1 or not isinstance(dense, list):
            return f"decoder_sparse_step = {step!r} / mlp_only_layers = {dense!r} (a positive int and a list)"
        return unsupported_qwen_value(raw)

    def moe_config(self, raw: dict) -> MoEConfig:
        """The experts' settings, with transformers 5's rule for which layers are sparse (``Qwen3MoeDecoderLayer``:
        not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``)."""
        defaults = self.moe_defaults
        num_experts = raw.get("num_experts", raw.get("num_local_experts", defaults["num_experts"]))
        top_k = raw.get("num_experts_per_tok", defaults["num_experts_per_tok"])
        step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
        layers = range(raw["num_hidden_layers"])
        sparse = tuple(i for i in layers if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        width = raw.get("moe_intermediate_size", defaults["moe_intermediate_size"])
        return MoEConfig(num_experts, top_k, width, bool(raw.get("norm_topk_prob", False)), True, sparse)

    def moe_from_module(self, mlp: torch.nn.Module) -> MoEWeights:
        return moe_weights_from_module(mlp, norm_topk_prob=None, weights_in_model_dtype=True)
