"""A lean forward pass for Llama-family causal LMs: the same math as transformers, as plain tensor calls.

transformers runs every step through about 14 ``nn.Module`` calls per decoder layer plus decorators, output
capturing and keyword plumbing. On the CPU, with the small models and batches of an offline job, that costs a
visible share of each step. ``LeanLlama`` runs the model's weight tensors (``cbrun.engine.model.llama_weights.LlamaWeights``:
a transformers model's own, nothing copied, or the same tensors read by ``cbrun.engine.model.safetensors_loader`` without
transformers) through the same operations in the same order, and the same paged attention
(``cbrun.engine.model.attention.paged_attention``), so its logits equal transformers' bit for bit, as long as each linear
layer runs on torch's GEMM. On the CPU, large
float32 weights run on oneDNN's instead (``cbrun.engine.model.cpu_linear``, ``linear_backend``): faster, and equal up to float32
rounding. Where the step runs on the C attention kernels (float32 on the CPU), RoPE runs in C too
(``cbrun.kernels.cpu_attention.rope_cpu``, called through the step's ``StepKernels``): the same floats as the PyTorch
ops, one call instead of four.

Per decoder layer, on the residual stream ``h`` of shape (T, hidden)::

    x = rms_norm(h);  h = h + o_proj(paged_attention(rope(q_proj(x)), rope(k_proj(x)), v_proj(x)))
    x = rms_norm(h);  h = h + down_proj(silu(gate_proj(x)) * up_proj(x))

Supported: ``LlamaForCausalLM``, ``MistralForCausalLM`` without a sliding window, ``Qwen2ForCausalLM`` without
sliding layers, ``Qwen3ForCausalLM`` (per-head q/k RMSNorm) without sliding layers, and the mixtures of experts ``Qwen3MoeForCausalLM`` (per-head q/k RMSNorm) and
``MixtralForCausalLM``, whose MLP is ``cbrun.engine.model.moe.SparseMoE``; default RoPE only; linear biases as the checkpoint has them; tied or untied embeddings.
``unsupported_reason`` says why anything else is refused (``cbrun.engine.model.llama_config`` keeps the same limits for the
transformers-free loader). Fusing q/k/v or gate/up into one matmul was measured
and left out: the fused GEMM is not bit-identical for every shape (e.g. hidden 896 with 128 KV features), and on
the CPU it saved nothing measurable (hidden 512, intermediate 1408, 128 and 2048 rows, one thread: within 4%,
either way). The matmuls are most of a CPU step once attention reads pages in place (``cbrun.kernels.cpu_attention``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from cbrun.engine.model.attention import AttentionMetadata, paged_attention
from cbrun.engine.model.cpu_linear import (
    LinearFn,
    batch_invariant_linear,
    onednn_linear,
    onednn_two_rows_or_more,
    select_linear,
)
from cbrun.engine.model.llama_weights import LayerWeights, Linear, LlamaWeights
from cbrun.engine.model.moe import SparseMoE, moe_weights_from_module, unsupported_moe_reason
from cbrun.engine.model.quantization import QuantizedLinearWeight, quantized_linear
from cbrun.engine.model.safetensors_loader import LeanModel
from cbrun.engine.switches import resolve_switch

logger = logging.getLogger("cbrun.engine")

_SUPPORTED_CLASSES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``LeanLlama`` cannot run ``model`` exactly as transformers does, or None when it can."""
    name = type(model).__name__
    # The exact class, not a subclass: a subclass may change the forward pass.
    if name not in _SUPPORTED_CLASSES or type(model).__module__.split(".")[0] != "transformers":
        return f"{name} is not one of transformers' {', '.join(_SUPPORTED_CLASSES)}"
    config, decoder = model.config, model.model
    rope_type = getattr(decoder.rotary_emb, "rope_type", None)
    if rope_type != "default":
        return f"rope_type {rope_type!r} (only the default RoPE is implemented)"
    if getattr(config, "sliding_window", None) and (
        name in ("MistralForCausalLM", "MixtralForCausalLM")
        or any(getattr(layer.self_attn, "sliding_window", None) for layer in decoder.layers)
    ):
        return f"sliding_window = {config.sliding_window} (sliding-window attention is not implemented)"
    if len(decoder.layers) != config.num_hidden_layers:
        return f"{len(decoder.layers)} decoder layers but num_hidden_layers = {config.num_hidden_layers}"
    if type(model.lm_head) is not torch.nn.Linear:
        return f"lm_head is a {type(model.lm_head).__name__}, not a plain Linear"
    for i, layer in enumerate(decoder.layers):
        reason = _unsupported_layer(layer)
        if reason:
            return f"layer {i}: {reason}"
    return None


def _unsupported_layer(layer: torch.nn.Module) -> str | None:
    from transformers.activations import SiLUActivation

    attn, mlp = layer.self_attn, layer.mlp
    dense = hasattr(mlp, "gate_proj")
    linears = {"q_proj": attn.q_proj, "k_proj": attn.k_proj, "v_proj": attn.v_proj, "o_proj": attn.o_proj}
    if dense:
        linears.update(gate_proj=mlp.gate_proj, up_proj=mlp.up_proj, down_proj=mlp.down_proj)
    else:
        reason = unsupported_moe_reason(mlp)
        if reason:
            return reason
    for name, linear in linears.items():
        if type(linear) is not torch.nn.Linear:  # quantised or otherwise replaced projections
            return f"{name} is a {type(linear).__name__}, not a plain Linear"
    if dense and type(mlp.act_fn) not in (SiLUActivation, torch.nn.SiLU):
        return f"activation {type(mlp.act_fn).__name__} (only SiLU is implemented)"
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    norms += [getattr(attn, name) for name in ("q_norm", "k_norm") if hasattr(attn, name)]
    for norm in norms:
        if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
            return f"norm {type(norm).__name__} is not the family's RMSNorm"
    return None


@dataclass
class _Layer:
    """One decoder layer's tensors: (weight, bias or None, the function that runs it) per projection (gate, up
    and down None in a MoE layer, whose MLP is ``moe``), RMSNorm weights and epsilons."""

    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    q: tuple
    k: tuple
    v: tuple
    o: tuple
    gate: tuple | None
    up: tuple | None
    down: tuple | None
    scale: float
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_norm_eps: float = 0.0
    moe: SparseMoE | None = None


class LeanLlama:
    """The forward pass of a supported Llama-family model over the engine's paged cache.

    Owns references to the model's weights and a RoPE table; holds no state between steps.

    Args:
        weights: the model's tensors (``LlamaWeights``: from ``cbrun.engine.model.safetensors_loader``, or
            ``weights_from_module``), or a transformers model for which ``unsupported_reason`` is None, in eval
            mode (its own tensors are used, nothing is copied).
        max_positions: positions the RoPE table covers; defaults to the config's ``max_position_embeddings``.
        linear_backend: which GEMM runs each projection (``cbrun.engine.model.cpu_linear.select_linear``).
        batch_invariant: every row's logits the same bits whatever else is in the step (``engine.batch_invariant``):
            the projections run ``cpu_linear.batch_invariant_linear`` and the MLP's ``silu(gate) * up`` the C
            kernel's row-wise ``silu_mul`` (steps must then run the C attention kernel, with
            ``AttentionMetadata.batch_invariant``); RMSNorm and the residual adds are row-wise already.

    Raises:
        ValueError: naming the reason when the model is not supported, or from ``select_linear``.
    """

    def __init__(
        self,
        weights: LlamaWeights | torch.nn.Module,
        max_positions: int | None = None,
        linear_backend: str = "auto",
        batch_invariant: bool = False,
    ) -> None:
        if isinstance(weights, torch.nn.Module):
            weights = weights_from_module(weights)
        self.batch_invariant = batch_invariant
        if batch_invariant and any(layer.moe is not None for layer in weights.layers):
            raise ValueError(
                "batch_invariant = on does not run MoE layers yet (the experts' grouped GEMM sums by each "
                "expert's share of the step); set engine.batch_invariant = off"
            )
        quantized = [
            p[0] for layer in weights.layers for p in layer.linears() if isinstance(p[0], QuantizedLinearWeight)
        ]
        if batch_invariant and quantized:
            raise ValueError(
                "batch_invariant = on does not run quantized weights (each GEMM dequantizes its weight in chunks "
                "of its own shape); set engine.batch_invariant = off or use unquantized weights"
            )
        if batch_invariant:  # one rule for every projection: the invariant linear
            linear_backend = batch_invariant_linear
        self.head_dim = weights.head_dim
        self.embed = weights.embed
        self.final_norm, self.final_eps = weights.final_norm, weights.final_eps
        self.lm_head = _projection(weights.lm_head, linear_backend)
        self.layers = [_layer_tensors(layer, linear_backend) for layer in weights.layers]
        projections = [self.lm_head] + [
            p
            for layer in self.layers
            for p in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down)
            if p is not None
        ]
        self.num_onednn_linears = sum(p[2] in (onednn_linear, onednn_two_rows_or_more) for p in projections)
        self.parallel = weights.parallel  # tensor parallelism: the collectives wrap the split projections
        if self.parallel is not None:
            self.lm_head = self.parallel.gathered_head(self.lm_head)
            for layer in self.layers:
                layer.o = self.parallel.row_parallel(layer.o)
                if layer.down is not None:
                    layer.down = self.parallel.row_parallel(layer.down)
                if layer.moe is not None:  # split by expert
                    layer.moe = self.parallel.expert_parallel(layer.moe)
        logger.info(
            "linear layers: %d of %d on oneDNN, the rest on torch's GEMM (%s)",
            self.num_onednn_linears,
            len(projections),
            "batch-invariant" if batch_invariant else f"linear_backend = {linear_backend}",
        )
        if quantized:
            logger.info(
                "quantized linear layers: %d, kept %s with their scales, dequantized in the GEMM (weight-only: "
                "activations in %s)",
                len(quantized),
                quantized[0].storage_dtype,
                quantized[0].dtype,
            )
        moe = [layer.moe for layer in self.layers if layer.moe is not None]
        if moe:
            reason = moe[0].fallback_reason
            logger.info(
                "MoE layers: %d, experts on %s", len(moe), f"the reference ({reason})" if reason else "grouped GEMM"
            )
        self.cos, self.sin_signed = _rope_tables(
            weights.inv_freq,
            weights.attention_scaling,
            max_positions or weights.max_position_embeddings,
            self.embed.dtype,
        )

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
        h = F.embedding(input_ids, self.embed) if self.parallel is None else self.parallel.embed(input_ids, self.embed)
        if md.use_cpu_kernel:  # the C kernels' RoPE: one call per tensor, reading the tables by position
            kernels = md.step_kernels()

            def rope(x: torch.Tensor) -> torch.Tensor:
                return kernels.rope(x, self.cos, self.sin_signed, positions)
        else:
            cos, sin = self.cos[positions][:, None], self.sin_signed[positions][:, None]  # (T, 1, head_dim)

            def rope(x: torch.Tensor) -> torch.Tensor:
                return _rope(x, cos, sin)

        silu_mul = md.step_kernels().silu_mul if self.batch_invariant else _silu_mul
        for index, layer in enumerate(self.layers):
            # In place: the same sums as ``h = h + ...``, without a new (T, hidden) tensor per add.
            h += self._attention(index, layer, _rms_norm(h, layer.input_norm, layer.input_eps), rope, md)
            h += _mlp(layer, _rms_norm(h, layer.post_norm, layer.post_eps), silu_mul)
        # NOTE: norm all rows, then keep some, as transformers does: norming only the kept rows is the same math,
        # but a GPU reduction may order its sums by the number of rows.
        return _linear(_rms_norm(h, self.final_norm, self.final_eps)[logits_indices], self.lm_head)

    def _attention(
        self,
        index: int,
        layer: _Layer,
        x: torch.Tensor,
        rope: Callable[[torch.Tensor], torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = _linear(x, layer.q).view(num_tokens, -1, self.head_dim)
        k = _linear(x, layer.k).view(num_tokens, -1, self.head_dim)
        if layer.q_norm is not None:  # Qwen3's per-head norms, before RoPE
            q, k = _rms_norm(q, layer.q_norm, layer.qk_norm_eps), _rms_norm(k, layer.k_norm, layer.qk_norm_eps)
        q, k = rope(q), rope(k)
        v = _linear(x, layer.v).view(num_tokens, -1, self.head_dim)
        out = paged_attention(q, k, v, md, index, layer.scale)
        return _linear(out.reshape(num_tokens, -1), layer.o)


def weights_from_module(model: torch.nn.Module) -> LlamaWeights:
    """The tensors of a transformers model that ``unsupported_reason`` accepts (its own tensors, not copies).

    Raises:
        ValueError: naming the reason when the model is not supported.
    """
    reason = unsupported_reason(model)
    if reason:
        raise ValueError(f"the lean model path cannot run this model: {reason}")
    decoder = model.model
    rotary = decoder.rotary_emb

    def linear(module: torch.nn.Linear) -> Linear:
        return module.weight, module.bias

    layers = []
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        dense = hasattr(mlp, "gate_proj")
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
                gate=linear(mlp.gate_proj) if dense else None,
                up=linear(mlp.up_proj) if dense else None,
                down=linear(mlp.down_proj) if dense else None,
                scale=attn.scaling,
                q_norm=attn.q_norm.weight if has_qk_norm else None,
                k_norm=attn.k_norm.weight if has_qk_norm else None,
                qk_norm_eps=attn.q_norm.variance_epsilon if has_qk_norm else 0.0,
                moe=None if dense else moe_weights_from_module(mlp),
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


def _projection(linear: Linear, backend) -> tuple[torch.Tensor, torch.Tensor | None, LinearFn]:
    """(weight, bias, its function); ``backend`` a ``linear_backend`` name or a function of the weight. A
    quantized weight always runs ``quantized_linear`` (dequantized in the GEMM, chunk by chunk)."""
    weight, bias = linear
    if isinstance(weight, QuantizedLinearWeight):
        return weight, bias, quantized_linear
    return weight, bias, backend(weight) if callable(backend) else select_linear(weight, backend)


def _linear(x: torch.Tensor, projection: tuple[torch.Tensor, torch.Tensor | None, LinearFn]) -> torch.Tensor:
    weight, bias, run = projection
    return run(x, weight, bias)


def _layer_tensors(layer: LayerWeights, backend) -> _Layer:
    def linear(weights: Linear | None):
        return None if weights is None else _projection(weights, backend)

    return _Layer(
        input_norm=layer.input_norm,
        input_eps=layer.input_eps,
        post_norm=layer.post_norm,
        post_eps=layer.post_eps,
        q=linear(layer.q),
        k=linear(layer.k),
        v=linear(layer.v),
        o=linear(layer.o),
        gate=linear(layer.gate),
        up=linear(layer.up),
        down=linear(layer.down),
        scale=layer.scale,
        q_norm=layer.q_norm,
        k_norm=layer.k_norm,
        qk_norm_eps=layer.qk_norm_eps,
        moe=None if layer.moe is None else SparseMoE(layer.moe),
    )


def _rope_tables(
    inv_freq: torch.Tensor, attention_scaling: float, max_positions: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_positions, head_dim) cos and sign-folded sin tables, from the model's own ``inv_freq``.

    Computed with transformers' default-RoPE operations (float32 angles ``position * inv_freq``, duplicated over
    both halves, cos/sin, times ``attention_scaling``, cast to the model dtype), so a row equals what transformers
    computes for that position. The sin table's first half is negated: ``rotate_half(x) * sin`` then becomes
    ``roll(x, head_dim / 2) * sin_signed``, the same products up to an exact sign flip.
    """
    inv_freq = inv_freq.float()
    positions = torch.arange(max_positions, device=inv_freq.device, dtype=torch.int64)
    freqs = positions[:, None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    cos = (angles.cos() * attention_scaling).to(dtype)
    sin = (angles.sin() * attention_scaling).to(dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE on (T, heads, head_dim), rotating the two halves of each head (transformers' ``rotate_half``)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back, then scaled: the family's order of operations."""
    if x.dtype == torch.float32:  # the casts would be no-ops; skipping them saves two calls per norm
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _mlp(
    layer: _Layer, x: torch.Tensor, silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    if layer.moe is not None:
        return layer.moe(x)
    return _linear(silu_mul(_linear(x, layer.gate), _linear(x, layer.up)), layer.down)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, in place in ``gate``: the same values, one (T, I) tensor fewer."""
    return F.silu(gate, inplace=True).mul_(up)


def select_lean_model(
    model_impl: str,
    model,
    use_cuda_graphs: bool,
    max_model_len: int,
    linear_backend: str = "auto",
    batch_invariant: bool = False,
) -> LeanLlama | None:
    """The lean forward pass when ``model_impl`` asks for it and it applies; None runs transformers' modules.
    A ``LeanModel`` (loaded without transformers) always gets it.

    Logs once (logger "cbrun.engine", INFO) which implementation runs and, under "auto", why not the lean one.

    Raises:
        ValueError: ``model_impl == "lean"`` with an unsupported model or with CUDA graphs on (graphs capture
            transformers' forward pass); ``linear_backend == "onednn"`` where the lean path does not run (the
            transformers modules always use torch's GEMM) or cannot use oneDNN; ``batch_invariant`` where the lean
            path does not run.
    """
    lean = _select_lean_model(model_impl, model, use_cuda_graphs, max_model_len, linear_backend, batch_invariant)
    if lean is None and linear_backend == "onednn":
        raise ValueError(
            "linear_backend = onednn runs only on the lean forward pass, which this model does not "
            "use (see the log); use linear_backend = auto or torch"
        )
    if lean is None and batch_invariant:
        raise ValueError(
            "batch_invariant = on runs only on the lean forward pass, which this model does not use (see the "
            "log); set engine.batch_invariant = off"
        )
    return lean


def _select_lean_model(
    model_impl: str,
    model: torch.nn.Module,
    use_cuda_graphs: bool,
    max_model_len: int,
    linear_backend: str,
    batch_invariant: bool,
) -> LeanLlama | None:
    if isinstance(model, LeanModel):  # loaded without transformers: the lean pass is its only forward pass
        if model_impl == "transformers" or use_cuda_graphs:
            setting = "model_impl = transformers" if model_impl == "transformers" else "CUDA graphs"
            raise ValueError(
                f"{setting} needs transformers' modules, but the model was loaded without "
                "transformers (engine.safetensors_loader); load it with engine.loader = transformers"
            )
        logger.info("model implementation: lean (engine.lean_llama)")
        return LeanLlama(model.weights, max_model_len, linear_backend, batch_invariant)
    if model_impl == "transformers":
        logger.info("model implementation: transformers (model_impl = transformers)")
        return None
    reason = unsupported_reason(model)
    if reason is None and use_cuda_graphs:
        reason = "CUDA graphs capture transformers' forward pass (set cuda_graphs = off to use the lean path)"
    if not resolve_switch(
        "model_impl",
        model_impl,
        reason,
        on="lean",
        off="transformers",
        off_log="model implementation: transformers (lean path not used: %s)",
        hint="; use model_impl = auto or transformers",
    ):
        return None
    logger.info("model implementation: lean (engine.lean_llama)")
    return LeanLlama(model, max_model_len, linear_backend, batch_invariant)
