"""The Llama family (and Mistral, which shares its decoder), and the Llama-style decoder that the other lean-path
families (``qwen2``, ``qwen3``, ``qwen3_moe``, ``qwen2_moe``, ``mixtral`` beside this file) build on: its config
keys, its checkpoint's tensor names, how it reads a transformers module's tensors, and its forward pass, composed
from ``cbrun.engine.model.layers``.

The forward pass (``LeanLlama``): the same math as transformers, as plain tensor calls.

transformers runs every step through about 14 ``nn.Module`` calls per decoder layer plus decorators, output
capturing and keyword plumbing. On the CPU, with the small models and batches of an offline job, that costs a
visible share of each step. ``LeanLlama`` runs the model's weight tensors
(``cbrun.engine.model.weights.LlamaWeights``: a transformers model's own, nothing copied, or the same tensors read
by ``cbrun.engine.model.safetensors_loader`` without transformers) through the same operations in the same order,
and the same paged attention (``cbrun.engine.model.layers.attention.paged_attention``), so its logits equal
transformers' bit for bit, as long as each linear layer runs on torch's GEMM. On the CPU, large float32 weights run
on oneDNN's instead (``cbrun.engine.model.layers.linear``, ``linear_backend``): faster, and equal up to float32
rounding. Where the step runs on the C attention kernels (float32 on the CPU), RoPE runs in C too
(``cbrun.kernels.cpu_attention.rope_cpu``, called through the step's ``StepKernels``): the same floats as the
PyTorch ops, one call instead of four.

Per decoder layer, on the residual stream ``h`` of shape (T, hidden)::

    x = rms_norm(h);  h = h + o_proj(paged_attention(rope(q_proj(x)), rope(k_proj(x)), v_proj(x)))
    x = rms_norm(h);  h = h + down_proj(silu(gate_proj(x)) * up_proj(x))

The decoder runs, per family file, a plain Llama (this file's ``LlamaForCausalLM`` and ``MistralForCausalLM`` without
a sliding window), per-head q/k RMSNorm (``qk_norm``), sparse MoE blocks
(``cbrun.engine.model.layers.moe.SparseMoE``), each with a sigmoid-gated shared expert where the family has one
(Qwen2-MoE: ``LayerWeights.shared_expert_gate``), per-layer attention sinks and sliding windows
(``LayerWeights.sinks`` / ``sliding_window``: gpt-oss) and RMSNorms scaled in float32
(``LlamaWeights.norm_scale_in_float32``); the RoPE types of ``rotary_embedding.ROPE_INIT`` (default, YaRN); linear
biases as the checkpoint has them; tied or untied embeddings. ``LlamaDecoderFamily.unsupported_module_reason`` says
why anything else is refused (``parse_config`` keeps the same limits for the transformers-free loader). Fusing q/k/v
or gate/up into one matmul was measured and left out: the fused GEMM is not bit-identical for every shape (e.g. hidden
896 with 128 KV features), and on the CPU it saved nothing measurable (hidden 512, intermediate 1408, 128 and 2048
rows, one thread: within 4%, either way). The matmuls are most of a CPU step once attention reads pages in place
(``cbrun.kernels.cpu_attention``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from cbrun.engine.model.config import (
    DTYPE_NAMES,
    INERT_KEYS,
    READ_KEYS,
    REQUIRED,
    LlamaConfig,
    unsupported_shape,
)
from cbrun.engine.model.family import ModelFamily
from cbrun.engine.model.layers.activation import invariant_sigmoid
from cbrun.engine.model.layers.activation import silu_mul as activation_silu_mul
from cbrun.engine.model.layers.attention import AttentionMetadata, paged_attention
from cbrun.engine.model.layers.embed_head import embed_tokens, lm_head
from cbrun.engine.model.layers.layernorm import rms_norm, rms_norm_float32_scale
from cbrun.engine.model.layers.linear import (
    Backend,
    LinearFn,
    Projection,
    apply_linear,
    batch_invariant_linear,
    onednn_linear,
    onednn_two_rows_or_more,
    projection,
)
from cbrun.engine.model.layers.moe import (
    MoEConfig,
    MoEWeights,
    SparseMoE,
    unsupported_moe_reason,
)
from cbrun.engine.model.layers.parallel import TensorParallelWeights
from cbrun.engine.model.layers.quantization.base import QuantizedExperts, QuantizedLinearWeight
from cbrun.engine.model.layers.quantization.fp8 import w8a8_linear
from cbrun.engine.model.layers.quantization.schemes import QuantScheme, read_quantization
from cbrun.engine.model.layers.rotary_embedding import (
    DEFAULT_ROPE_THETA,
    RopeParameters,
    apply_rope,
    read_rope_parameters,
    rope_inv_freq,
    rope_tables,
    unsupported_rotary_reason,
)
from cbrun.engine.model.weights import DecoderLayer, LayerWeights, Linear, LlamaWeights
from cbrun.engine.setting_error import SettingError
from cbrun.kernels.batch_invariant import InvariantKernels
from cbrun.kernels.fp8_scaled_mm import W8A8_TEMPLATE

logger = logging.getLogger("cbrun.engine")

#: Each decoder layer's attention projections, then its dense MLP's, by their names under ``model.layers.{i}.``.
ATTENTION_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP_PROJECTIONS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
#: A MoE layer's shared expert (a dense gated MLP under this name) and its sigmoid gate (Qwen2-MoE's names).
SHARED_EXPERT, SHARED_EXPERT_GATE = "mlp.shared_expert", "mlp.shared_expert_gate"
#: Each tensor's tensor-parallel split by its module's name (``cbrun.engine.model.layers.parallel.SPLIT_STYLES``);
#: a row-parallel module's bias is held whole.
SHARD_STYLES = {
    "embed_tokens": "vocab",
    "lm_head": "vocab",
    "q_proj": "column_heads",
    "k_proj": "column_kv_heads",
    "v_proj": "column_kv_heads",
    "gate_proj": "column",
    "up_proj": "column",
    "o_proj": "row_heads",
    "down_proj": "row",
}


class LlamaDecoderFamily(ModelFamily):
    """The Llama-style decoder shared by the lean-path families: pre-norm layers of RMSNorm, q/k/v/o attention with
    RoPE (optionally per-head q/k RMSNorm) and a SiLU-gated MLP or a sparse MoE block, under transformers'
    tensor names (``model.layers.{i}.self_attn.q_proj``, ...). A family file subclasses it with its tables and, where
    it differs, its rules (the hooks below).

    Attributes:
        config_keys: config.json keys this family reads besides ``cbrun.engine.model.config.READ_KEYS`` (every other
            key is refused).
        defaults: transformers 5's defaults of the optional fields the engine reads (``bos_token_id``,
            ``eos_token_id``, ``num_key_value_heads``; ``head_dim`` where it is not hidden_size // heads).
        qk_norm: an RMSNorm over each query and key head before RoPE (``self_attn.q_norm`` / ``k_norm``).
        moe_block: a MoE family's block name under ``model.layers.{i}.`` and each expert's (gate, up, down) names:
            the router is ``{block}.gate``, expert ``e``'s projections ``{block}.experts.{e}.{name}``; None for a
            dense family.
        moe_module: a MoE family's transformers sparse-block class name.
        default_rope_theta, default_rope_parameters: transformers' ``default_theta`` of the family's config and
            the RoPE parameters it takes when config.json states none (``read_rope_parameters``).
    """

    config_keys: ClassVar[frozenset[str]] = frozenset()
    defaults: ClassVar[dict[str, object]] = {}
    qk_norm: ClassVar[bool] = False
    moe_block: ClassVar[tuple[str, tuple[str, str, str]] | None] = None
    moe_module: ClassVar[str | None] = None
    default_rope_theta: ClassVar[float] = DEFAULT_ROPE_THETA
    default_rope_parameters: ClassVar[dict | None] = None

    # -- the transformers-free config reader ------------------------------------------------------------------

    def parse_config(self, raw: dict) -> tuple[LlamaConfig | None, str | None]:
        model_type = raw.get("model_type")
        if model_type != self.model_type:
            return None, f"model_type {model_type!r} is not {self.model_type!r}"
        unknown = sorted(set(raw) - INERT_KEYS - READ_KEYS - self.config_keys)
        if unknown:
            return None, f"config.json sets {', '.join(unknown)}, which the safetensors loader does not read"
        missing = [key for key in REQUIRED if raw.get(key) is None]
        if missing:
            return None, f"config.json does not state {', '.join(missing)}"
        reason = self._unsupported_value(raw)
        if reason:
            return None, reason
        quantization = None
        if raw.get("quantization_config") is not None:
            quantization, reason = read_quantization(raw["quantization_config"])
            reason = reason or self.unsupported_quantization(quantization)
            if reason:
                return None, f"quantization_config: {reason}"
        rope, reason = read_rope_parameters(raw, self.default_rope_theta, self.default_rope_parameters)
        if rope is None:
            return None, reason
        config = self._config(raw, rope, quantization)
        reason = unsupported_shape(config) or self.unsupported_shape(config)
        return (None, reason) if reason else (config, None)

    def _config(self, raw: dict, rope: RopeParameters, quantization: QuantScheme | None) -> LlamaConfig:
        """The config's fields, with the family's defaults for those config.json leaves out."""
        defaults = self.defaults
        heads = raw["num_attention_heads"]
        num_kv_heads = raw.get("num_key_value_heads", defaults["num_key_value_heads"]) or heads
        head_dim = raw.get("head_dim") or defaults.get("head_dim") or raw["hidden_size"] // heads
        qkv_bias, o_bias = self.biases(raw)
        return LlamaConfig(
            model_type=self.model_type,
            architecture=self.architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=raw["max_position_embeddings"],
            rms_norm_eps=raw["rms_norm_eps"],
            rope_theta=rope.theta,
            rope_type=rope.rope_type,
            rope_parameters=rope.params,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            bos_token_id=raw.get("bos_token_id", defaults["bos_token_id"]),
            eos_token_id=raw.get("eos_token_id", defaults["eos_token_id"]),
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
            qk_norm=self.qk_norm,
            moe=self.moe_config(raw),
            quantization=quantization,
        )

    def _unsupported_value(self, raw: dict) -> str | None:
        if raw.get("hidden_act", "silu") != "silu":
            return f"activation {raw['hidden_act']!r} (only SiLU is implemented)"
        reason = self.unsupported_value(raw)
        if reason:
            return reason
        dtype = raw.get("dtype") or raw.get("torch_dtype")
        if dtype is not None and dtype not in DTYPE_NAMES:
            return f"dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}"
        return None

    def unsupported_value(self, raw: dict) -> str | None:
        """Why a value config.json states is outside what this family's forward pass runs (the same limits as
        ``unsupported_module_reason``), or None."""
        return None

    def unsupported_quantization(self, scheme: QuantScheme | None) -> str | None:
        """Why this family cannot read a checkpoint quantized in ``scheme`` (every per-linear layout it can; MXFP4
        is stacked experts only gpt-oss stores), or None."""
        if scheme is not None and scheme.layout == "mxfp4":
            return f"mxfp4 is implemented for gpt-oss's MoE experts only, not {self.architecture}"
        return None

    def biases(self, raw: dict) -> tuple[bool, bool]:
        """(q/k/v projections have biases, o projection has one): Llama's ``attention_bias`` for all four."""
        bias = bool(raw.get("attention_bias", False))
        return bias, bias

    def moe_config(self, raw: dict) -> MoEConfig | None:
        """The experts' settings of a MoE family (transformers 5's defaults), None for a dense one."""
        return None

    def unsupported_shape(self, config: LlamaConfig) -> str | None:
        """Why this family's transformers modules would refuse or read these shapes another way, or None."""
        return None

    # -- the checkpoint -----------------------------------------------------------------------------------------

    def checkpoint_shapes(self, config: LlamaConfig) -> dict[str, tuple[int, ...]]:
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
            for name in ATTENTION_PROJECTIONS if i in sparse else ATTENTION_PROJECTIONS + MLP_PROJECTIONS:
                in_features, out_features, bias = features[name]
                shapes[f"{prefix}{name}.weight"] = (out_features, in_features)
                if bias:
                    shapes[f"{prefix}{name}.bias"] = (out_features,)
            if i in sparse:
                shapes.update(self._expert_shapes(config, prefix))
        return shapes

    def _shared_expert_shapes(self, config: LlamaConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        """A MoE layer's shared expert (``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``), where it has one."""
        width = config.moe.shared_expert_intermediate_size if config.moe else 0
        if not width:
            return {}
        hidden, mlp = config.hidden_size, f"{prefix}{SHARED_EXPERT}."
        return {
            f"{mlp}gate_proj.weight": (width, hidden),
            f"{mlp}up_proj.weight": (width, hidden),
            f"{mlp}down_proj.weight": (hidden, width),
            f"{prefix}{SHARED_EXPERT_GATE}.weight": (1, hidden),
        }

    def _expert_shapes(self, config: LlamaConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        """A MoE layer's router and per-expert tensors, as the family's checkpoints name them."""
        assert self.moe_block is not None and config.moe is not None
        block, (gate, up, down) = self.moe_block
        hidden, width = config.hidden_size, config.moe.intermediate_size
        shapes = {f"{prefix}{block}.gate.weight": (config.moe.num_experts, hidden)}
        shapes.update(self._shared_expert_shapes(config, prefix))
        for e in range(config.moe.num_experts):
            expert = f"{prefix}{block}.experts.{e}."
            shapes[f"{expert}{gate}.weight"] = (width, hidden)
            shapes[f"{expert}{up}.weight"] = (width, hidden)
            shapes[f"{expert}{down}.weight"] = (hidden, width)
        return shapes

    def checkpoint_weights(
        self, config: LlamaConfig, tensors: dict[str, torch.Tensor], device: str, experts: range | None
    ) -> LlamaWeights:
        """The loaded tensors as ``LlamaWeights``, with transformers' epsilons, softmax scale and RoPE frequencies."""
        sparse = set(config.moe.sparse_layers) if config.moe else set()
        layers = [
            self._checkpoint_layer(config, tensors, f"model.layers.{i}.", i in sparse, experts)
            for i in range(config.num_hidden_layers)
        ]
        embed = tensors["model.embed_tokens.weight"]
        lm_head = (embed, None) if config.tie_word_embeddings else _checkpoint_linear(tensors, "lm_head")
        rope = RopeParameters(config.rope_type, config.rope_theta, config.rope_parameters)
        inv_freq, attention_scaling = rope_inv_freq(rope, config.head_dim, device)
        return LlamaWeights(
            embed=embed,
            layers=layers,
            final_norm=tensors["model.norm.weight"],
            final_eps=config.rms_norm_eps,
            lm_head=lm_head,
            head_dim=config.head_dim,
            inv_freq=inv_freq,
            attention_scaling=attention_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )

    def _checkpoint_layer(
        self, config: LlamaConfig, tensors: dict[str, torch.Tensor], prefix: str, sparse: bool, experts: range | None
    ) -> LayerWeights:
        """Decoder layer ``prefix`` ("model.layers.{i}.") of the checkpoint: a dense MLP's projections, or (``sparse``)
        its MoE block's experts; every RMSNorm with the config's one epsilon."""
        eps = config.rms_norm_eps
        q, k, v, o = (_checkpoint_linear(tensors, prefix + name) for name in ATTENTION_PROJECTIONS)
        shared = sparse and config.moe is not None and config.moe.shared_expert_intermediate_size > 0
        if sparse and not shared:
            gate = up = down = None
        else:  # the dense MLP, or a MoE layer's shared expert (the same projections under ``mlp.shared_expert``)
            mlp = f"{prefix}{SHARED_EXPERT}." if shared else f"{prefix}mlp."
            gate, up, down = (_checkpoint_linear(tensors, mlp + name.partition(".")[2]) for name in MLP_PROJECTIONS)
        return LayerWeights(
            input_norm=tensors[prefix + "input_layernorm.weight"],
            input_eps=eps,
            post_norm=tensors[prefix + "post_attention_layernorm.weight"],
            post_eps=eps,
            q=q,
            k=k,
            v=v,
            o=o,
            gate=gate,
            up=up,
            down=down,
            scale=config.head_dim**-0.5,
            q_norm=tensors.get(prefix + "self_attn.q_norm.weight"),
            k_norm=tensors.get(prefix + "self_attn.k_norm.weight"),
            qk_norm_eps=eps,
            moe=self._moe_weights(config, tensors, prefix, experts) if sparse else None,
            shared_expert_gate=_checkpoint_linear(tensors, prefix + SHARED_EXPERT_GATE) if shared else None,
        )

    def _moe_weights(
        self, config: LlamaConfig, tensors: dict[str, torch.Tensor], prefix: str, expert_ids: range | None
    ) -> MoEWeights:
        """A MoE layer's per-expert tensors stacked as ``MoEWeights`` (each expert's gate rows, then its up rows),
        the per-expert tensors dropped from ``tensors`` as they are stacked (one layer's experts held twice at
        most). ``expert_ids``: the experts to stack (a tensor-parallel rank's), None for all; the router is always
        whole."""
        assert self.moe_block is not None and config.moe is not None
        block, (gate, up, down) = self.moe_block
        moe = config.moe
        expert_ids = range(moe.num_experts) if expert_ids is None else expert_ids
        experts = [f"{prefix}{block}.experts.{e}." for e in expert_ids]
        gate_ups = [(tensors.pop(e + gate + ".weight"), tensors.pop(e + up + ".weight")) for e in experts]
        downs = [tensors.pop(e + down + ".weight") for e in experts]
        gate_up: torch.Tensor | QuantizedExperts
        down_proj: torch.Tensor | QuantizedExperts
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

    def shard_style(self, name: str) -> str | None:
        if ".experts." in name:  # an expert is held whole, by one rank (``ShardLayout.holds``)
            return None
        module, _, field = name.rpartition(".")
        style = SHARD_STYLES.get(module.rpartition(".")[2])
        return None if style is None or (style.startswith("row") and field != "weight") else style

    # -- a transformers model's own modules -----------------------------------------------------------------------

    def unsupported_module_reason(self, model: torch.nn.Module) -> str | None:
        config, decoder = model.config, model.model
        reason = unsupported_rotary_reason(decoder.rotary_emb)
        if reason:
            return reason
        if getattr(config, "sliding_window", None) and self.slides_window(model):
            return f"sliding_window = {config.sliding_window} (sliding-window attention is not implemented)"
        if len(decoder.layers) != config.num_hidden_layers:
            return f"{len(decoder.layers)} decoder layers but num_hidden_layers = {config.num_hidden_layers}"
        if type(model.lm_head) is not torch.nn.Linear:
            return f"lm_head is a {type(model.lm_head).__name__}, not a plain Linear"
        for i, layer in enumerate(decoder.layers):
            reason = self._unsupported_layer(layer)
            if reason:
                return f"layer {i}: {reason}"
        return None

    def slides_window(self, model: torch.nn.Module) -> bool:
        """Whether a model whose config sets ``sliding_window`` uses it: where some layer's attention says so."""
        return any(getattr(layer.self_attn, "sliding_window", None) for layer in model.model.layers)

    def _unsupported_layer(self, layer: torch.nn.Module) -> str | None:
        from transformers.activations import SiLUActivation

        attn, mlp = layer.self_attn, layer.mlp
        dense_mlp = _dense_mlp(mlp)
        linears = {"q_proj": attn.q_proj, "k_proj": attn.k_proj, "v_proj": attn.v_proj, "o_proj": attn.o_proj}
        if dense_mlp is not None:
            linears.update(gate_proj=dense_mlp.gate_proj, up_proj=dense_mlp.up_proj, down_proj=dense_mlp.down_proj)
        if hasattr(mlp, "shared_expert_gate"):
            linears.update(shared_expert_gate=mlp.shared_expert_gate)
        if not hasattr(mlp, "gate_proj"):
            reason = self.unsupported_moe_module(mlp)
            if reason:
                return reason
        for name, linear in linears.items():
            if type(linear) is not torch.nn.Linear:  # quantised or otherwise replaced projections
                return f"{name} is a {type(linear).__name__}, not a plain Linear"
        if dense_mlp is not None and type(dense_mlp.act_fn) not in (SiLUActivation, torch.nn.SiLU):
            return f"activation {type(dense_mlp.act_fn).__name__} (only SiLU is implemented)"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [getattr(attn, name) for name in ("q_norm", "k_norm") if hasattr(attn, name)]
        for norm in norms:
            if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
                return f"norm {type(norm).__name__} is not the family's RMSNorm"
        return None

    def unsupported_moe_module(self, mlp: torch.nn.Module) -> str | None:
        """Why a layer's MLP without a dense ``gate_proj`` cannot run: a dense family has no MoE block."""
        if self.moe_module is None:
            return f"MLP {type(mlp).__name__} is not a dense gated MLP"
        return unsupported_moe_reason(mlp, self.moe_module)

    def moe_from_module(self, mlp: torch.nn.Module) -> MoEWeights:
        """A MoE block's own tensors (``moe_weights_from_module`` with the family's routing rule)."""
        raise NotImplementedError(f"{self.architecture} has no MoE block")

    def weights_from_module(self, model: torch.nn.Module) -> LlamaWeights:
        decoder = model.model
        rotary = decoder.rotary_emb

        def linear(module: torch.nn.Linear) -> Linear:
            return module.weight, module.bias

        layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            dense, dense_mlp = hasattr(mlp, "gate_proj"), _dense_mlp(mlp)
            shared_gate = getattr(mlp, "shared_expert_gate", None)
            has_qk_norm = hasattr(attn, "q_norm")
            layers.append(
                LayerWeights(
                    input_norm=layer.input_layernorm.weight,
                    input_eps=layer.input_layernorm.variance_epsilon,
                    post_norm=layer.post_attention_layernorm.weight,
                    post_eps=layer.post_attention_layernorm.variance_epsilon,
                    q=linear(attn.q_proj),
                    k=linear(attn.k_proj),
                    v=linear(attn.v_proj),
                    o=linear(attn.o_proj),
                    gate=None if dense_mlp is None else linear(dense_mlp.gate_proj),
                    up=None if dense_mlp is None else linear(dense_mlp.up_proj),
                    down=None if dense_mlp is None else linear(dense_mlp.down_proj),
                    scale=attn.scaling,
                    q_norm=attn.q_norm.weight if has_qk_norm else None,
                    k_norm=attn.k_norm.weight if has_qk_norm else None,
                    qk_norm_eps=attn.q_norm.variance_epsilon if has_qk_norm else 0.0,
                    moe=None if dense else self.moe_from_module(mlp),
                    shared_expert_gate=None if shared_gate is None else linear(shared_gate),
                )
            )
        return LlamaWeights(
            embed=decoder.embed_tokens.weight,
            layers=layers,
            final_norm=decoder.norm.weight,
            final_eps=decoder.norm.variance_epsilon,
            lm_head=linear(model.lm_head),
            head_dim=decoder.layers[0].self_attn.head_dim,
            inv_freq=rotary.inv_freq,
            attention_scaling=rotary.attention_scaling,
            max_position_embeddings=model.config.max_position_embeddings,
        )

    # -- the forward pass ---------------------------------------------------------------------------------------

    def forward(
        self,
        weights: LlamaWeights,
        max_positions: int | None,
        linear_backend: Backend,
        batch_invariant: bool,
        invariant_kernels: InvariantKernels | None = None,
        fp8_activation_scheme: str = "none",
    ) -> LeanLlama:
        return LeanLlama(
            weights, max_positions, linear_backend, batch_invariant, invariant_kernels, fp8_activation_scheme
        )


class LlamaFamily(LlamaDecoderFamily):
    """``LlamaForCausalLM`` (transformers 5.24's ``LlamaConfig`` defaults)."""

    model_type = "llama"
    architecture = "LlamaForCausalLM"
    config_keys = frozenset({"attention_bias", "mlp_bias"})
    defaults = {"bos_token_id": 1, "eos_token_id": 2, "num_key_value_heads": None}

    def unsupported_shape(self, config: LlamaConfig) -> str | None:
        if config.hidden_size % config.num_attention_heads:
            return "hidden_size is not a multiple of num_attention_heads"
        return None


class MistralFamily(LlamaDecoderFamily):
    """``MistralForCausalLM`` without a sliding window: Llama's decoder without biases (``MistralConfig``'s
    defaults, whose ``sliding_window`` 4096 is refused unless config.json sets it to null)."""

    model_type = "mistral"
    architecture = "MistralForCausalLM"
    config_keys = frozenset({"sliding_window"})
    defaults = {"bos_token_id": 1, "eos_token_id": 2, "num_key_value_heads": 8, "sliding_window": 4096}

    def unsupported_value(self, raw: dict) -> str | None:
        window = raw.get("sliding_window", self.defaults["sliding_window"])
        if window is not None:
            return f"sliding_window = {window} (sliding-window attention is not implemented)"
        return None

    def slides_window(self, model: torch.nn.Module) -> bool:
        return True  # every layer attends through the config's window


def _dense_mlp(mlp: torch.nn.Module) -> torch.nn.Module | None:
    """A layer's dense gated MLP: the MLP itself, a MoE block's shared expert (Qwen2-MoE), or None."""
    if hasattr(mlp, "gate_proj"):
        return mlp
    return getattr(mlp, "shared_expert", None)


def _checkpoint_linear(tensors: dict[str, torch.Tensor], name: str) -> Linear:
    """Checkpoint linear ``name``'s (weight, bias or None)."""
    return tensors[name + ".weight"], tensors.get(name + ".bias")


@dataclass
class _Layer(DecoderLayer[Projection, SparseMoE]):
    """One decoder layer as the forward pass runs it: each projection (weight, bias or None, the function that
    runs it), a MoE block its ``SparseMoE``."""


class LeanLlama:
    """The forward pass of a supported Llama-family model over the engine's paged cache.

    Owns references to the model's weights and a RoPE table; holds no state between steps.

    Args:
        weights: the model's tensors (``LlamaWeights``: from ``cbrun.engine.model.safetensors_loader``, or
            ``cbrun.engine.model.registry.weights_from_module``: a transformers model's own, nothing copied).
        max_positions: positions the RoPE table covers; defaults to the config's ``max_position_embeddings``.
        linear_backend: which GEMM runs each projection (``cbrun.engine.model.layers.linear.select_linear``).
        batch_invariant: every row's logits the same bits whatever else is in the step (``engine.batch_invariant``).
            On the CPU (``invariant_kernels`` None): the projections run ``linear.batch_invariant_linear``, the
            MLP's ``silu(gate) * up`` the C kernel's row-wise ``silu_mul`` (steps must then run the C attention
            kernel, with ``AttentionMetadata.batch_invariant``); RMSNorm (torch's on the CPU) and the residual adds
            are row-wise already. A MoE block runs each expert over its own rows through the same linear
            (``SparseMoE`` with ``invariant_linear``).
        invariant_kernels: under ``batch_invariant`` with Triton attention (CUDA, or the CPU's interpreter): the
            Triton invariant matmul runs every projection and the LM head, its RMSNorm every norm; the MLP's SiLU
            is torch's on CUDA (elementwise) and the C one on the CPU. See ``cbrun.kernels.batch_invariant``.
        fp8_activation_scheme: ``engine.fp8_activation_scheme``: "dynamic" runs every float8 projection (the LM
            head too, where the checkpoint quantized it) as W8A8 (``cbrun.engine.model.layers.quantization.fp8.
            w8a8_linear``); a MoE block's experts stay weight-only. "none": weight-only.

    Raises:
        ValueError: ``batch_invariant`` with quantized weights; ``fp8_activation_scheme = "dynamic"`` with no
            float8 projection outside the MoE experts, or one W8A8 cannot run (``fp8.check_w8a8``); or from
            ``select_linear``.
    """

    def __init__(
        self,
        weights: LlamaWeights,
        max_positions: int | None = None,
        linear_backend: Backend = "auto",
        batch_invariant: bool = False,
        invariant_kernels: InvariantKernels | None = None,
        fp8_activation_scheme: str = "none",
    ) -> None:
        self.batch_invariant = batch_invariant
        self.invariant_kernels = invariant_kernels if batch_invariant else None
        quantized = [
            p[0] for layer in weights.layers for p in layer.linears() if isinstance(p[0], QuantizedLinearWeight)
        ]
        invariant_linear = None
        if batch_invariant:  # one rule for every projection: the invariant linear
            _check_batch_invariant(quantized)
            invariant_linear = _invariant_linear(self.invariant_kernels)
            linear_backend = invariant_linear
        #: RMSNorm: torch's (row-wise on the CPU), or the Triton one (one program per row) on the Triton path.
        self.rms_norm = rms_norm if self.invariant_kernels is None else self.invariant_kernels.rms_norm
        self.head_dim = weights.head_dim
        self.embed = weights.embed
        self.final_norm, self.final_eps = weights.final_norm, weights.final_eps
        #: the decoder's norms: scaled in float32 where the family's are (gpt-oss), else ``rms_norm``
        self.norm = rms_norm_float32_scale if weights.norm_scale_in_float32 else self.rms_norm
        self._bind_projections(weights, linear_backend, invariant_linear, fp8_activation_scheme)
        _log_layers(
            self.layers,
            self.num_projections,
            self.num_onednn_linears,
            quantized,
            linear_backend,
            batch_invariant,
            self.num_w8a8_linears,
        )
        if self.invariant_kernels is not None:
            logger.info("batch-invariant linear layers and norms: the %s kernels", self.invariant_kernels.name)
        self.cos, self.sin_signed = rope_tables(
            weights.inv_freq,
            weights.attention_scaling,
            max_positions or weights.max_position_embeddings,
            self.embed.dtype,
        )

    def _bind_projections(
        self, weights: LlamaWeights, linear_backend: Backend, invariant_linear: Callable | None, fp8: str
    ) -> None:
        """Binds each projection (the LM head's and every layer's) to the function that runs it, counts them by
        kind, and wraps the split ones in their collectives under tensor parallelism.

        Raises:
            ValueError: ``fp8 = "dynamic"`` with no float8 projection outside the MoE experts.
        """
        self.lm_head = projection(*weights.lm_head, linear_backend, fp8, "lm_head")
        self.layers = [
            _layer_tensors(layer, linear_backend, invariant_linear, fp8, f"layers[{i}]")
            for i, layer in enumerate(weights.layers)
        ]
        projections = [self.lm_head] + [
            p
            for layer in self.layers
            for p in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down, layer.shared_expert_gate)
            if p is not None
        ]
        self.num_projections = len(projections)
        self.num_onednn_linears = sum(p[2] in (onednn_linear, onednn_two_rows_or_more) for p in projections)
        #: projections run W8A8 (``fp8_activation_scheme = "dynamic"``)
        self.num_w8a8_linears = sum(p[2] is w8a8_linear for p in projections)
        if fp8 == "dynamic" and not self.num_w8a8_linears:
            raise SettingError(
                W8A8_TEMPLATE + " quantizes the activations of float8 linear layers, and this model has none outside "
                'its MoE experts (which stay weight-only); set {fp8_activation_scheme} = "none"'
            )
        self.parallel = weights.parallel  # tensor parallelism: the collectives wrap the split projections
        self.lm_head = lm_head(self.lm_head, self.parallel)
        if self.parallel is not None:
            _split_over_ranks(self.layers, self.parallel)

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """One step of the flattened batch.

        Args:
            input_ids: (T,) int64 token ids; positions: (T,) int64 their positions (< ``max_positions``).
            md: this step's attention metadata (the layers write their K/V through it).
            logits_indices: (N,) int64 rows of the batch whose logits are wanted.

        Returns:
            (N, vocab_size) logits in the model's dtype.
        """
        h = embed_tokens(input_ids, self.embed, self.parallel)
        if md.use_cpu_kernel:  # the C kernels' RoPE: one call per tensor, reading the tables by position
            kernels = md.step_kernels()

            def rope(x: torch.Tensor) -> torch.Tensor:
                return kernels.rope(x, self.cos, self.sin_signed, positions)
        else:
            cos, sin = self.cos[positions][:, None], self.sin_signed[positions][:, None]  # (T, 1, head_dim)

            def rope(x: torch.Tensor) -> torch.Tensor:
                return apply_rope(x, cos, sin)

        # NOTE: under batch invariance on the CPU (either kernel set) the C silu_mul: F.silu's scalar tail there
        # follows the tensor's length. On CUDA torch's elementwise kernels compute each element alike.
        cpu_invariant = self.batch_invariant and h.device.type == "cpu"
        silu_mul = md.step_kernels().silu_mul if cpu_invariant else activation_silu_mul
        sigmoid = invariant_sigmoid if cpu_invariant else torch.sigmoid  # a shared expert's gate (Qwen2-MoE)
        norm = self.norm
        for index, layer in enumerate(self.layers):
            # In place: the same sums as ``h = h + ...``, without a new (T, hidden) tensor per add.
            h += self._attention(index, layer, norm(h, layer.input_norm, layer.input_eps), rope, md)
            h += _mlp(layer, norm(h, layer.post_norm, layer.post_eps), silu_mul, sigmoid)
        # NOTE: norm all rows, then keep some, as transformers does: norming only the kept rows is the same math,
        # but a GPU reduction may order its sums by the number of rows.
        return apply_linear(norm(h, self.final_norm, self.final_eps)[logits_indices], self.lm_head)

    def _attention(
        self,
        index: int,
        layer: _Layer,
        x: torch.Tensor,
        rope: Callable[[torch.Tensor], torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = apply_linear(x, layer.q).view(num_tokens, -1, self.head_dim)
        k = apply_linear(x, layer.k).view(num_tokens, -1, self.head_dim)
        if layer.q_norm is not None:  # Qwen3's per-head norms, before RoPE
            q, k = self.rms_norm(q, layer.q_norm, layer.qk_norm_eps), self.rms_norm(k, layer.k_norm, layer.qk_norm_eps)
        q, k = rope(q), rope(k)
        v = apply_linear(x, layer.v).view(num_tokens, -1, self.head_dim)
        out = paged_attention(q, k, v, md, index, layer.scale, layer.sliding_window, sinks=layer.sinks)
        return apply_linear(out.reshape(num_tokens, -1), layer.o)


def _split_over_ranks(layers: list[_Layer], parallel: TensorParallelWeights) -> None:
    """Wrap each layer's row-parallel projections (o, down) in their all-reduce and its MoE block in the
    expert-parallel one (each rank its own experts)."""
    for layer in layers:
        layer.o = parallel.row_parallel(layer.o)
        if layer.down is not None:
            layer.down = parallel.row_parallel(layer.down)
        if layer.moe is not None:  # split by expert
            layer.moe = parallel.expert_parallel(layer.moe)


def _layer_tensors(
    layer: LayerWeights,
    backend: Backend,
    invariant_linear: Callable[[torch.Tensor], LinearFn] | None = None,
    fp8_activation_scheme: str = "none",
    name: str = "",
) -> _Layer:
    """One layer (``name``, for a refusal) with its projections' functions (``projection``); ``invariant_linear``
    (batch invariance) also runs a MoE block's router and experts."""

    def linear(weights: Linear | None, part: str) -> Projection | None:
        return None if weights is None else projection(*weights, backend, fp8_activation_scheme, f"{name}.{part}")

    return _Layer(
        input_norm=layer.input_norm,
        input_eps=layer.input_eps,
        post_norm=layer.post_norm,
        post_eps=layer.post_eps,
        q=linear(layer.q, "q"),
        k=linear(layer.k, "k"),
        v=linear(layer.v, "v"),
        o=linear(layer.o, "o"),
        gate=linear(layer.gate, "gate"),
        up=linear(layer.up, "up"),
        down=linear(layer.down, "down"),
        scale=layer.scale,
        q_norm=layer.q_norm,
        k_norm=layer.k_norm,
        qk_norm_eps=layer.qk_norm_eps,
        moe=None if layer.moe is None else SparseMoE(layer.moe, invariant_linear),
        sinks=layer.sinks,
        sliding_window=layer.sliding_window,
        shared_expert_gate=linear(layer.shared_expert_gate, "shared_expert_gate"),
    )


def _mlp(
    layer: _Layer,
    x: torch.Tensor,
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    sigmoid: Callable[[torch.Tensor], torch.Tensor] = torch.sigmoid,
) -> torch.Tensor:
    """The layer's MLP on the normed ``x`` (T, hidden): its dense gated MLP, its MoE block, or both (a shared
    expert, scaled by ``sigmoid(shared_expert_gate @ x)`` and added after the experts, as transformers'
    ``Qwen2MoeSparseMoeBlock``)."""
    dense = None
    if layer.gate is not None:
        dense = apply_linear(silu_mul(apply_linear(x, layer.gate), apply_linear(x, layer.up)), layer.down)
    if layer.moe is None:
        assert dense is not None
        return dense
    out = layer.moe(x, silu_mul)
    if dense is not None:
        assert layer.shared_expert_gate is not None
        out = out + sigmoid(apply_linear(x, layer.shared_expert_gate)) * dense
    return out


def _invariant_linear(kernels: InvariantKernels | None) -> Callable[[torch.Tensor], LinearFn]:
    """The batch-invariant linear as a function of the weight: the CPU's (``batch_invariant_linear``) or the
    Triton matmul of ``kernels``."""
    if kernels is None:
        return batch_invariant_linear
    triton_linear = kernels.linear
    return lambda weight: triton_linear


def _check_batch_invariant(quantized: list[QuantizedLinearWeight]) -> None:
    """Refuse what ``batch_invariant = on`` does not run, naming the setting.

    Raises:
        ValueError: quantized weights.
    """
    if quantized:
        raise ValueError(
            "batch_invariant = on does not run quantized weights (each GEMM dequantizes its weight in chunks "
            "of its own shape); set engine.batch_invariant = off or use unquantized weights"
        )


def _log_layers(
    layers: list[_Layer],
    num_projections: int,
    num_onednn: int,
    quantized: list[QuantizedLinearWeight],
    linear_backend: Backend,
    batch_invariant: bool,
    num_w8a8: int = 0,
) -> None:
    """Log once which GEMM runs the projections, the quantized layers (``num_w8a8`` of them W8A8) and where the
    MoE experts run."""
    logger.info(
        "linear layers: %d of %d on oneDNN, the rest on torch's GEMM (%s)",
        num_onednn,
        num_projections,
        "batch-invariant" if batch_invariant else f"linear_backend = {linear_backend}",
    )
    if quantized and not num_w8a8:
        logger.info(
            "quantized linear layers: %d, kept %s with their scales, dequantized in the GEMM (weight-only: "
            "activations in %s)",
            len(quantized),
            quantized[0].storage_dtype,
            quantized[0].dtype,
        )
    moe = [layer.moe for layer in layers if layer.moe is not None]
    if num_w8a8:
        logger.info(
            "quantized linear layers: %d W8A8 (fp8_activation_scheme = dynamic: inputs rounded to float8 per row, "
            "torch._scaled_mm)%s",
            num_w8a8,
            "; MoE experts weight-only" if moe else "",
        )
    if moe:
        reason = moe[0].fallback_reason
        where = f"the reference ({reason})" if reason else "grouped GEMM"
        if batch_invariant:
            where = "the batch-invariant linear, one expert at a time"
        logger.info("MoE layers: %d, experts on %s", len(moe), where)
