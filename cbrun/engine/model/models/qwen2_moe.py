"""The Qwen2-MoE family (``Qwen2MoeForCausalLM``) without sliding layers: Qwen2's attention (q/k/v biases, no q/k
norm) over sparse MoE blocks (``cbrun.engine.model.layers.moe``) in the layers ``decoder_sparse_step`` and
``mlp_only_layers`` choose, each with a shared expert: a dense SiLU MLP ``shared_expert_intermediate_size`` wide
(the dense MLP's projections, ``mlp.shared_expert.*``) whose output, scaled by ``sigmoid(shared_expert_gate @ x)``,
is added to the routed experts'; dense gated MLPs in the other layers; ``Qwen2MoeConfig``'s defaults. Under tensor
parallelism the shared expert splits as a dense MLP does, by its own width (``cbrun.engine.model.layers.parallel``)."""

from __future__ import annotations

from cbrun.engine.model.layers.moe import MoEConfig
from cbrun.engine.model.models.qwen3_moe import Qwen3MoeFamily


class Qwen2MoeFamily(Qwen3MoeFamily):
    """``Qwen2MoeForCausalLM`` (transformers 5.24's ``Qwen2MoeConfig`` defaults): Qwen3-MoE's routing and sparse
    layers (softmax, top-k, ``norm_topk_prob`` default False) without q/k norms, plus the shared expert."""

    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    config_keys = frozenset(
        {
            "qkv_bias",
            "use_sliding_window",
            "sliding_window",
            "max_window_layers",
            "layer_types",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
        }
    )
    defaults = {"bos_token_id": None, "eos_token_id": None, "num_key_value_heads": 16}
    #: transformers 5's defaults of the MoE fields
    moe_defaults = {
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
    }
    qk_norm = False
    moe_module = "Qwen2MoeSparseMoeBlock"

    def biases(self, raw: dict) -> tuple[bool, bool]:
        return bool(raw.get("qkv_bias", True)), False

    def moe_config(self, raw: dict) -> MoEConfig:
        """Qwen3-MoE's experts and sparse layers, with the shared expert's width."""
        width = raw.get("shared_expert_intermediate_size", self.moe_defaults["shared_expert_intermediate_size"])
        return MoEConfig(**{**vars(super().moe_config(raw)), "shared_expert_intermediate_size": width})
