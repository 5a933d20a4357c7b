"""The gpt-oss family (``GptOssForCausalLM``): the Llama-style decoder with

- attention sinks: a learned logit per head in each softmax's denominator (``self_attn.sinks``), passed to the
  paged attention, whose reference, C and Triton kernels add them;
- sliding-window and full-attention layers alternating (``layer_types``, ``sliding_window``);
- q/k/v/o projections with biases (``attention_bias`` defaults to true);
- YaRN RoPE (``cbrun.engine.model.layers.rotary_embedding``; the default when config.json states none, with
  theta 150000);
- in every layer a MoE block (``GptOssMLP``) routed top-k-then-softmax with a router bias, whose experts are stored
  stacked and transposed (``mlp.experts.gate_up_proj`` (E, hidden, 2 I) with gate and up columns interleaved,
  ``down_proj`` (E, I, hidden), each with a bias) and apply the clamped SwiGLU
  (``cbrun.engine.model.layers.activation.ClampedSwiGLU``: alpha ``swiglu_alpha``, clamp ``swiglu_limit``);
- RMSNorms that scale in float32, then cast (``GptOssRMSNorm``).

An MXFP4 checkpoint (``quant_method: "mxfp4"``, as openai/gpt-oss-20b and -120b ship) stores each expert
projection as ``{name}_blocks`` / ``{name}_scales`` instead, kept quantized
(``cbrun.engine.model.layers.quantization.mxfp4.Mxfp4Experts``); everything else is unquantized.
``GptOssConfig``'s defaults (transformers 5.25).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from cbrun.engine.model.config import LlamaConfig
from cbrun.engine.model.layers.activation import ClampedSwiGLU
from cbrun.engine.model.layers.moe import MoEConfig, MoEWeights
from cbrun.engine.model.layers.quantization.base import ExpertStack
from cbrun.engine.model.layers.quantization.mxfp4 import mxfp4_experts
from cbrun.engine.model.layers.quantization.schemes import QuantScheme
from cbrun.engine.model.layers.rotary_embedding import RopeParameters
from cbrun.engine.model.models.llama import LlamaDecoderFamily
from cbrun.engine.model.weights import LlamaWeights

#: ``GptOssConfig``'s RoPE when config.json states none.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
SLIDING, FULL = "sliding_attention", "full_attention"
#: Where each layer's stacked expert tensors are, under ``model.layers.{i}.``.
EXPERTS = "mlp.experts."


class GptOssFamily(LlamaDecoderFamily):
    """``GptOssForCausalLM`` (transformers 5.25's ``GptOssConfig`` defaults)."""

    model_type = "gpt_oss"
    architecture = "GptOssForCausalLM"
    keep_in_float32 = ("norm",)  # GptOssPreTrainedModel._keep_in_fp32_modules, matched as transformers does
    config_keys = frozenset(
        {
            "attention_bias",
            "sliding_window",
            "layer_types",
            "num_local_experts",
            "num_experts",
            "num_experts_per_tok",
            "swiglu_alpha",
            "swiglu_limit",
            # in openai's config.json, read by no transformers code (the model reads num_experts_per_tok and
            # rope_scaling's original_max_position_embeddings): inert
            "experts_per_token",
            "initial_context_length",
        }
    )
    defaults = {"bos_token_id": None, "eos_token_id": None, "num_key_value_heads": 8, "head_dim": 64}
    #: transformers 5's defaults of the fields only this family reads
    gpt_oss_defaults = {
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
    }
    default_rope_theta = 150000.0
    default_rope_parameters = DEFAULT_ROPE
    moe_module = "GptOssMLP"

    # -- the transformers-free config reader ------------------------------------------------------------------

    def unsupported_value(self, raw: dict) -> str | None:
        layers = raw["num_hidden_layers"]
        layer_types = raw.get("layer_types")
        if layer_types is not None and (
            not isinstance(layer_types, list) or len(layer_types) != layers or set(layer_types) - {SLIDING, FULL}
        ):
            return f"layer_types = {layer_types!r} (one of {SLIDING!r} or {FULL!r} per layer)"
        window = raw.get("sliding_window", self.gpt_oss_defaults["sliding_window"])
        sliding = SLIDING in (layer_types or self._layer_types(layers))
        if sliding and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            return f"sliding_window = {window!r} with sliding_attention layers (a positive integer)"
        for key in ("swiglu_alpha", "swiglu_limit"):
            value = raw.get(key, self.gpt_oss_defaults[key])
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return f"{key} = {value!r} is not a number"
        return None

    def unsupported_quantization(self, scheme: QuantScheme | None) -> str | None:
        if scheme is not None and scheme.layout != "mxfp4":
            return f"{scheme.method} ({scheme.layout}) on gpt-oss (its stacked experts are implemented as mxfp4 only)"
        return None

    @staticmethod
    def _layer_types(layers: int) -> tuple[str, ...]:
        """``GptOssConfig``'s default: sliding, full, sliding, ..."""
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(layers))

    def biases(self, raw: dict) -> tuple[bool, bool]:
        bias = bool(raw.get("attention_bias", True))
        return bias, bias

    def moe_config(self, raw: dict) -> MoEConfig:
        """Every layer sparse, each expert ``intermediate_size`` wide, the clamped SwiGLU."""
        defaults = self.gpt_oss_defaults
        num_experts = raw.get("num_local_experts", raw.get("num_experts", defaults["num_local_experts"]))
        top_k = raw.get("num_experts_per_tok", defaults["num_experts_per_tok"])
        activation = ClampedSwiGLU(
            float(raw.get("swiglu_alpha", defaults["swiglu_alpha"])),
            float(raw.get("swiglu_limit", defaults["swiglu_limit"])),
        )
        layers = tuple(range(raw["num_hidden_layers"]))
        return MoEConfig(num_experts, top_k, raw["intermediate_size"], False, True, layers, activation)

    def _config(self, raw: dict, rope: RopeParameters, quantization: QuantScheme | None) -> LlamaConfig:
        config = super()._config(raw, rope, quantization)
        layer_types = tuple(raw.get("layer_types") or self._layer_types(raw["num_hidden_layers"]))
        window = raw.get("sliding_window", self.gpt_oss_defaults["sliding_window"])
        return replace(config, layer_types=layer_types, sliding_window=window if SLIDING in layer_types else None)

    # -- the checkpoint -----------------------------------------------------------------------------------------

    def checkpoint_shapes(self, config: LlamaConfig) -> dict[str, tuple[int, ...]]:
        shapes = super().checkpoint_shapes(config)
        for i in range(config.num_hidden_layers):
            shapes[f"model.layers.{i}.self_attn.sinks"] = (config.num_attention_heads,)
        return shapes

    def _expert_shapes(self, config: LlamaConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        assert config.moe is not None
        experts, hidden, width = config.moe.num_experts, config.hidden_size, config.moe.intermediate_size
        p = prefix + EXPERTS
        shapes: dict[str, tuple[int, ...]] = {
            f"{prefix}mlp.router.weight": (experts, hidden),
            f"{prefix}mlp.router.bias": (experts,),
            f"{p}gate_up_proj_bias": (experts, 2 * width),
            f"{p}down_proj_bias": (experts, hidden),
        }
        if config.quantization is None:
            shapes[f"{p}gate_up_proj"] = (experts, hidden, 2 * width)
            shapes[f"{p}down_proj"] = (experts, width, hidden)
            return shapes
        for name, out_features, in_features in (("gate_up_proj", 2 * width, hidden), ("down_proj", hidden, width)):
            # MXFP4 stores (out, in): 32 values a block, 16 bytes (the loader reads the whole tensor, and
            # ``mxfp4_experts`` names a width that is not a multiple of 32)
            groups = -(-in_features // 32)
            shapes[f"{p}{name}_blocks"] = (experts, out_features, groups, 16)
            shapes[f"{p}{name}_scales"] = (experts, out_features, groups)
        return shapes

    def checkpoint_weights(
        self, config: LlamaConfig, tensors: dict[str, torch.Tensor], device: str, experts: range | None
    ) -> LlamaWeights:
        weights = super().checkpoint_weights(config, tensors, device, experts)
        assert config.layer_types is not None
        for i, layer in enumerate(weights.layers):
            layer.sinks = tensors[f"model.layers.{i}.self_attn.sinks"]
            layer.sliding_window = config.sliding_window if config.layer_types[i] == SLIDING else None
        weights.norm_scale_in_float32 = True
        return weights

    def _moe_weights(
        self, config: LlamaConfig, tensors: dict[str, torch.Tensor], prefix: str, expert_ids: range | None
    ) -> MoEWeights:
        """The layer's router and stacked experts as ``MoEWeights``: unquantized experts as (E, out, in) views of
        the stored (E, in, out) tensors (the grouped GEMM reads them as stored, as transformers does), MXFP4 ones
        kept quantized."""
        assert config.moe is not None
        moe, p = config.moe, prefix + EXPERTS
        hidden, width = config.hidden_size, moe.intermediate_size
        gate_up: torch.Tensor | ExpertStack
        down: torch.Tensor | ExpertStack
        if config.quantization is None:
            gate_up = tensors.pop(p + "gate_up_proj").transpose(1, 2)
            down = tensors.pop(p + "down_proj").transpose(1, 2)
        else:
            dtype = tensors[p + "gate_up_proj_bias"].dtype
            gate_up, down = (
                mxfp4_experts(
                    p + name,
                    tensors.pop(p + name + "_blocks"),
                    tensors.pop(p + name + "_scales"),
                    (moe.num_experts, out_features, in_features),
                    dtype,
                )
                for name, out_features, in_features in (
                    ("gate_up_proj", 2 * width, hidden),
                    ("down_proj", hidden, width),
                )
            )
        return MoEWeights(
            router=tensors[prefix + "mlp.router.weight"],
            gate_up=gate_up,
            down=down,
            top_k=moe.top_k,
            norm_topk_prob=False,
            weights_in_model_dtype=True,
            router_bias=tensors[prefix + "mlp.router.bias"],
            softmax_after_topk=True,
            gate_up_bias=tensors[p + "gate_up_proj_bias"],
            down_bias=tensors[p + "down_proj_bias"],
            activation=moe.activation,
        )

    def shard_style(self, name: str) -> str | None:
        return None  # tensor parallelism is refused (``unsupported_parallel_reason``)

    def batch_invariant_reason(self, config: LlamaConfig) -> str | None:
        return "gpt-oss's MoE block (router bias, expert biases, clamped SwiGLU) has no batch-invariant form yet"

    def unsupported_parallel_reason(self, config: LlamaConfig) -> str | None:
        return "gpt-oss's stacked experts and attention sinks are not split over ranks yet"

    # -- a transformers model's own modules -----------------------------------------------------------------------

    def slides_window(self, model: torch.nn.Module) -> bool:
        return False  # the window is implemented, per layer

    def unsupported_moe_module(self, mlp: torch.nn.Module) -> str | None:
        if type(mlp).__name__ != "GptOssMLP":
            return f"MoE block {type(mlp).__name__} is not GptOssMLP"
        experts: Any = mlp.experts
        router: Any = mlp.router
        if type(experts).__name__ != "GptOssExperts":  # Mxfp4GptOssExperts: quantized on transformers' side
            return f"experts {type(experts).__name__} are not GptOssExperts"
        if type(experts)._apply_gate.__qualname__ != "GptOssExperts._apply_gate":
            return "the experts' activation is not gpt-oss's clamped SwiGLU"
        if type(router).__name__ != "GptOssTopKRouter" or router.bias is None:
            return f"router {type(router).__name__} is not GptOssTopKRouter with a bias"
        return None

    def weights_from_module(self, model: torch.nn.Module) -> LlamaWeights:
        weights = super().weights_from_module(model)
        decoder: Any = model.model
        for layer, module in zip(weights.layers, decoder.layers):
            layer.sinks = module.self_attn.sinks
            layer.sliding_window = module.self_attn.sliding_window
        weights.norm_scale_in_float32 = True
        return weights

    def moe_from_module(self, mlp: torch.nn.Module) -> MoEWeights:
        experts: Any = mlp.experts  # transformers' GptOssExperts / GptOssTopKRouter (not imported here)
        router: Any = mlp.router
        return MoEWeights(
            router=router.weight,
            gate_up=experts.gate_up_proj.transpose(1, 2),
            down=experts.down_proj.transpose(1, 2),
            top_k=router.top_k,
            norm_topk_prob=False,
            weights_in_model_dtype=True,
            router_bias=router.bias,
            softmax_after_topk=True,
            gate_up_bias=experts.gate_up_proj_bias,
            down_bias=experts.down_proj_bias,
            activation=ClampedSwiGLU(float(experts.alpha), float(experts.limit)),
        )
