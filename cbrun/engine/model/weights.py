"""The tensors of a Llama-style decoder, as the lean forward pass reads them: one structure for both loaders.

A family's ``weights_from_module`` fills it from a transformers model (its own tensors, nothing copied), its
``checkpoint_weights`` from the checkpoint's files read by ``cbrun.engine.model.safetensors_loader`` without
transformers (``cbrun.engine.model.models.llama.LlamaDecoderFamily``). Its forward pass takes either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from cbrun.engine.model.layers.moe import MoEWeights
from cbrun.engine.model.layers.parallel import TensorParallelWeights
from cbrun.engine.model.layers.quantization.base import QuantizedLinearWeight

#: (weight (out_features, in_features), bias (out_features,) or None) of one linear layer; the weight of a
#: quantized checkpoint's linear is a ``QuantizedLinearWeight`` (``cbrun.engine.model.layers.quantization``).
Linear = tuple["torch.Tensor | QuantizedLinearWeight", "torch.Tensor | None"]


#: A projection: ``Linear`` as loaded, or the forward pass's ``cbrun.engine.model.layers.linear.Projection``.
P = TypeVar("P")
#: A MoE block: ``MoEWeights`` as loaded, or the forward pass's ``cbrun.engine.model.layers.moe.SparseMoE``.
M = TypeVar("M")


@dataclass
class DecoderLayer(Generic[P, M]):
    """One decoder layer's parts: RMSNorm weights (hidden,) and epsilons, the projections, the softmax scale.

    A MoE layer (``moe`` set) has no dense gate/up/down (None), unless it has a shared expert (Qwen2-MoE): then
    gate/up/down are that dense MLP's, its output scaled by ``sigmoid(shared_expert_gate @ x)``, a (1, hidden)
    projection, and added to the experts'. ``q_norm`` / ``k_norm``: (head_dim,) the
    per-head RMSNorm weights on queries and keys before RoPE (Qwen3-MoE), with epsilon ``qk_norm_eps``.
    ``sinks``: (num_heads,) per-head attention sink logits (gpt-oss), or None. ``sliding_window``: the layer's
    attention window in tokens, None for full attention.
    """

    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    q: P
    k: P
    v: P
    o: P
    gate: P | None
    up: P | None
    down: P | None
    scale: float
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_norm_eps: float = 0.0
    moe: M | None = None
    sinks: torch.Tensor | None = None
    sliding_window: int | None = None
    shared_expert_gate: P | None = None


@dataclass
class LayerWeights(DecoderLayer[Linear, MoEWeights]):
    """One decoder layer as loaded: each projection a ``Linear``, a MoE block its ``MoEWeights``."""

    def linears(self) -> list[Linear]:
        """The dense projections this layer has, in q, k, v, o, gate, up, down, shared_expert_gate order."""
        projections = (self.q, self.k, self.v, self.o, self.gate, self.up, self.down, self.shared_expert_gate)
        return [p for p in projections if p is not None]

    def replace_dense_weights(self, replace: Callable[[torch.Tensor], torch.Tensor], keep: torch.Tensor) -> int:
        """Each unquantized projection weight ``w`` other than ``keep`` becomes ``replace(w)``; returns how many
        changed (``LlamaWeights.replace_dense_weights``)."""
        changed = 0
        for name in ("q", "k", "v", "o", "gate", "up", "down", "shared_expert_gate"):
            linear = getattr(self, name)
            if linear is None or isinstance(linear[0], QuantizedLinearWeight) or linear[0] is keep:
                continue
            weight = replace(linear[0])
            if weight is not linear[0]:
                setattr(self, name, (weight, linear[1]))
                changed += 1
        return changed

    def extra_tensors(self) -> list[torch.Tensor]:
        """The q/k norms, the sinks and the experts' tensors, where the layer has them."""
        norms = [n for n in (self.q_norm, self.k_norm, self.sinks) if n is not None]
        return norms + (self.moe.tensors() if self.moe is not None else [])


@dataclass
class LlamaWeights:
    """A whole model's tensors and the few numbers its forward pass needs.

    Attributes:
        embed: (vocab, hidden) token embeddings.
        layers: the decoder layers, in order.
        final_norm: (hidden,) the last RMSNorm's weight; final_eps its epsilon.
        lm_head: the output projection; its weight is ``embed`` itself when the embeddings are tied.
        head_dim: width of one attention head.
        inv_freq: (head_dim / 2,) float32 RoPE inverse frequencies.
        attention_scaling: the factor on RoPE's cos and sin (1.0 for the default RoPE).
        max_position_embeddings: positions the model was configured for (the RoPE table's default length).
        parallel: this rank's share of a tensor-parallel group (``cbrun.engine.model.layers.parallel``), the tensors
            above being its slices; None for a whole model.
        norm_scale_in_float32: the RMSNorms scale in float32, then cast (gpt-oss:
            ``cbrun.engine.model.layers.layernorm.rms_norm_float32_scale``); False: cast, then scale (Llama).
    """

    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    final_eps: float
    lm_head: Linear
    head_dim: int
    inv_freq: torch.Tensor
    attention_scaling: float
    max_position_embeddings: int
    parallel: TensorParallelWeights | None = None
    norm_scale_in_float32: bool = False

    def replace_dense_weights(self, replace: Callable[[torch.Tensor], torch.Tensor]) -> int:
        """Each unquantized projection weight ``w`` (the LM head's unless it is the tied embedding) becomes
        ``replace(w)``, in place: the loader packs oneDNN's weights so (``cbrun.engine.model.layers.linear.
        pack_for_onednn``), the packed copy then the only one. A MoE block's router and experts are left as they are.

        Returns:
            how many weights ``replace`` changed (returned another tensor for).
        """
        changed = sum(layer.replace_dense_weights(replace, keep=self.embed) for layer in self.layers)
        weight, bias = self.lm_head
        if weight is not self.embed and not isinstance(weight, QuantizedLinearWeight):
            packed = replace(weight)
            if packed is not weight:
                self.lm_head = (packed, bias)
                changed += 1
        return changed

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every distinct weight and bias tensor once (a tied LM head is the embedding), as ``parameters()``; a
        ``QuantizedLinearWeight`` as its values and scales."""
        seen: set[int] = set()
        linears = [self.lm_head] + [p for layer in self.layers for p in layer.linears()]
        norms = [self.final_norm] + [n for layer in self.layers for n in (layer.input_norm, layer.post_norm)]
        extra = [t for layer in self.layers for t in layer.extra_tensors()]
        stored = [t for linear in linears for t in linear if t is not None]
        parts = [p for t in stored for p in (t.tensors() if isinstance(t, QuantizedLinearWeight) else [t])]
        for tensor in [self.embed, *norms, *parts, *extra]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield tensor
