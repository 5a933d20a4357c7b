"""The sparse mixture-of-experts block of the lean forward pass (Qwen3-MoE, Mixtral, gpt-oss, each family's file
naming its tensors): a top-k router and the experts as one grouped operation, with no host read-back, so a step
stays capturable.

Per token ``x`` (hidden,), with ``E`` experts of width ``I`` and ``k`` experts per token (Shazeer et al. 2017,
"Outrageously large neural networks"; Mixtral, Jiang et al. 2024)::

    p = softmax(router @ x)                       # (E,) in float32
    w, e = topk(p, k)                             # the k largest, in descending order
    w = w / sum(w)                                # Mixtral always; Qwen3-MoE when norm_topk_prob
    y = sum_j w_j * down[e_j] @ (silu(gate[e_j] @ x) * up[e_j] @ x)

gpt-oss (``GptOssMLP``) routes the other way round and adds biases: ``l = router @ x + b``, ``w, e = topk(l, k)``,
``w = softmax(w)`` in the model dtype, and each expert is
``down[e] @ act(gate_up[e] @ x + b_gate_up[e]) + b_down[e]`` with ``act`` its clamped SwiGLU on interleaved
gate/up columns (``cbrun.engine.model.layers.activation.ClampedSwiGLU``).

``sparse_moe`` computes the experts for all ``T * k`` (token, expert) pairs at once: the pairs are sorted by
expert (a stable sort, a static shape), each expert's rows become one group of a grouped GEMM
(``torch._grouped_mm``, whose group offsets are a device tensor, not host ints), then SiLU-and-multiply, the
grouped down GEMM, the routing weights, and the per-token sum over its ``k`` slots. Every shape depends on ``T``
only, never on which experts were chosen, so the step has nothing to read back. This is the dataflow of vLLM's
and SGLang's ``fused_moe`` (tokens sorted by expert, then one GEMM per expert group) without their block padding,
which a grouped GEMM over exact offsets does not need.

Quantized experts run ``sparse_moe_in_expert_chunks``: the same GEMMs, a chunk of experts dequantized at a time.

On the CPU, dense float32 / bfloat16 SiLU experts run a C kernel at decode (``cbrun.kernels.cpu_moe``, dispatched
as ``torch.ops.cbrun.cpu_moe``): with a few rows an expert the grouped GEMM streams the weights at a third of the
memory bandwidth, while the kernel reads each hit expert's weight rows once, in order, dotting each with all the
expert's rows. It groups the pairs itself (no read-back either) and sums the slots in the same order. A step above
``cpu_moe.MAX_ROWS_PER_EXPERT`` rows an expert on average (``T * k / E``, a static rule: prefill) runs the grouped
GEMM. On CUDA the fused Triton kernel (``cbrun.kernels.fused_moe``) runs what ``select_moe_backend`` gives it.

``sparse_moe_reference`` is the plain PyTorch reference: every expert on every token, then the chosen ones
gathered. It is also the fallback where the grouped GEMM cannot run (a device or dtype ``torch._grouped_mm``
lacks, rows whose strides are not 16-byte multiples on the CPU).

The summation order is transformers 5's (``integrations/moe.py``, ``grouped_mm``): each expert's output times
its weight, in (token, slot) order, summed over the slots, so the lean path equals transformers' MoE block.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cbrun.engine.model.layers.activation import silu_and_mul
from cbrun.engine.model.layers.quantization.base import ExpertStack, QuantizedExperts
from cbrun.kernels import cpu_moe, custom_ops
from cbrun.kernels.quantized_matmul import triton_unsupported_reason

if TYPE_CHECKING:
    from cbrun.kernels.fused_moe import ExpertWeights

logger = logging.getLogger("cbrun.engine")

#: A quantized MoE layer dequantizes its experts about this many weight elements at a time (at least one expert;
#: 16 MiB of float32): the transient of its forward pass (``SparseMoE``) off the fused kernel.
EXPERT_CHUNK_ELEMENTS = 1 << 22


@dataclass
class MoEWeights:
    """One sparse MoE block's tensors and routing rule.

    Attributes:
        router: (E, hidden) the router's weight (no bias).
        gate_up: (E, 2 * I, hidden) each expert's gate rows then its up rows, as transformers 5 stacks them.
        down: (E, hidden, I) each expert's down projection. Either may be an ``ExpertStack`` (a quantized
            checkpoint's experts, kept quantized; ``SparseMoE`` dequantizes them a chunk at a time in each forward).
        top_k: experts per token (``num_experts_per_tok``).
        norm_topk_prob: renormalise the k chosen probabilities to sum to 1.
        weights_in_model_dtype: cast the routing weights to the model dtype before they scale the experts'
            outputs (Qwen3-MoE); False keeps them float32 (Mixtral), so the product and the sum are float32.
        router_bias: (E,) the router's bias (gpt-oss), or None.
        softmax_after_topk: pick the top-k router logits, then softmax over those k in the logits' dtype
            (gpt-oss's ``GptOssTopKRouter``); False: softmax over all E in float32, then top-k.
        gate_up_bias: (E, 2 * I) and down_bias: (E, hidden) each expert's biases (gpt-oss), or None.
        activation: (S, 2 * I) -> (S, I) the experts' gated activation (``silu_and_mul`` on gate-then-up columns;
            gpt-oss's ``ClampedSwiGLU`` on interleaved ones).
    """

    router: torch.Tensor
    gate_up: torch.Tensor | ExpertStack
    down: torch.Tensor | ExpertStack
    top_k: int
    norm_topk_prob: bool
    weights_in_model_dtype: bool
    router_bias: torch.Tensor | None = None
    softmax_after_topk: bool = False
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    activation: Callable[[torch.Tensor], torch.Tensor] = field(default=silu_and_mul)

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        biases = [b for b in (self.router_bias, self.gate_up_bias, self.down_bias) if b is not None]
        parts = [self.router, self.gate_up, self.down, *biases]
        return [t for p in parts for t in (p.tensors() if isinstance(p, ExpertStack) else [p])]

    @property
    def quantized(self) -> bool:
        return isinstance(self.gate_up, ExpertStack) or isinstance(self.down, ExpertStack)

    def dense(self, experts: slice = slice(None)) -> MoEWeights:
        """These weights with quantized experts dequantized (``experts`` of them; all by default), else itself."""
        if not self.quantized:
            return self

        def real(w):
            return w.dequantize(experts) if isinstance(w, ExpertStack) else w[experts]

        return replace(self, gate_up=real(self.gate_up), down=real(self.down))


def route(x: torch.Tensor, moe: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for each token.

    Args:
        x: (T, hidden) the normed hidden states.
        moe: the block.

    Returns:
        ``(weights, expert_ids)``: (T, k) routing weights (float32, or the model dtype where
        ``moe.weights_in_model_dtype``) and (T, k) int64 expert ids, in descending probability.
    """
    logits = F.linear(x, moe.router, moe.router_bias)
    if moe.softmax_after_topk:
        top, expert_ids = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(top, dim=1, dtype=top.dtype), expert_ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if moe.weights_in_model_dtype:
        weights = weights.to(logits.dtype)
    return weights, expert_ids


def grouped_gemm_unavailable_reason(moe: MoEWeights) -> str | None:
    """Why ``torch._grouped_mm`` cannot run this block's experts (``sparse_moe`` then runs the reference), or None."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    device = moe.gate_up.device
    if device.type == "cuda":
        if moe.gate_up.dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) < (8, 0):
            return "torch._grouped_mm on CUDA needs bfloat16 weights on sm80 or newer"
        return None
    if device.type != "cpu":
        return f"torch._grouped_mm does not run on {device.type}"
    width = moe.down.shape[-1]  # I
    for name, tensor in (("gate_up", moe.gate_up), ("down", moe.down)):
        # the (E, in, out) operand the GEMM reads: every stride but the unit one must be a 16-byte multiple
        strides = [s for s in tensor.transpose(1, 2).stride() if s != 1]
        if any((s * tensor.element_size()) % 16 for s in strides) or tensor.data_ptr() % 16:
            return f"{name}'s rows are not 16-byte aligned (torch._grouped_mm on the CPU needs them)"
    if (2 * width * moe.gate_up.element_size()) % 16:
        return "2 * moe_intermediate_size is not a 16-byte multiple"
    return None


def sparse_moe(x: torch.Tensor, moe: MoEWeights, grouped: bool = True) -> torch.Tensor:
    """The MoE block's output: route, then the experts as one grouped GEMM pair (see the module docstring).

    Args:
        x: (T, hidden) the normed hidden states, in the model dtype.
        moe: the block.
        grouped: use ``torch._grouped_mm``; False runs ``sparse_moe_reference`` (chosen once per model, by
            ``grouped_gemm_unavailable_reason``).

    Returns:
        (T, hidden) in ``x``'s dtype.
    """
    weights, expert_ids = route(x, moe)
    if not grouped:
        return experts_reference(x, weights, expert_ids, moe)
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)  # (S,), S = T * k, in (token, slot) order
    order = torch.argsort(flat_ids, stable=True)  # pairs sorted by expert
    out = _grouped_experts(x[order // top_k], moe, flat_ids, order, moe.num_experts, 0)
    out = out * weights.reshape(-1)[order, None]
    unsorted = torch.empty_like(out)
    unsorted[order] = out  # back to (token, slot) order
    return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


def _grouped_experts(
    rows: torch.Tensor, moe: MoEWeights, flat_ids: torch.Tensor, order: torch.Tensor, num_groups: int, first: int
) -> torch.Tensor:
    """Experts ``first .. first + num_groups - 1`` (``moe.gate_up`` / ``moe.down`` hold just those) on the pairs
    sorted by ``order`` (theirs first, by expert; any others after them, left uncomputed: garbage rows).

    Args:
        rows: (S, hidden) each sorted pair's token row.
        flat_ids: (S,) int64 each pair's expert, in (token, slot) order.
        order: (S,) the sort.

    Returns:
        (S, hidden) each sorted pair's expert output, biases added, before the routing weight.
    """
    sorted_ids = flat_ids[order]
    local = sorted_ids - first
    mine = (local >= 0) & (local < num_groups)
    counts = torch.zeros(num_groups, dtype=torch.int32, device=rows.device)
    counts.scatter_add_(0, local.clamp(0, num_groups - 1), mine.to(torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)  # (G,) each group's end row; rows past the last are skipped
    gate_up = torch._grouped_mm(rows, moe.gate_up.transpose(1, 2), offs=offsets)  # (S, 2I)
    if moe.gate_up_bias is not None:  # after the GEMM, as transformers' ``_grouped_linear``
        gate_up.add_(moe.gate_up_bias[sorted_ids])
    hidden = moe.activation(gate_up)  # (S, I)
    out = torch._grouped_mm(hidden, moe.down.transpose(1, 2), offs=offsets)  # (S, hidden)
    if moe.down_bias is not None:
        out.add_(moe.down_bias[sorted_ids])
    return out


def sparse_moe_in_expert_chunks(x: torch.Tensor, moe: MoEWeights, experts_per_chunk: int) -> torch.Tensor:
    """``sparse_moe`` over quantized experts, dequantizing ``experts_per_chunk`` of them at a time: the transient
    is one chunk's real weights, not the layer's.

    Per chunk the pairs are sorted with the chunk's experts first (a stable sort on the expert id, the others
    keyed past the chunk), so its groups start at row 0 and the grouped GEMM computes only the chunk's rows (rows
    past the last offset are skipped); those rows are kept, the rest masked out. Each expert's group holds the
    same rows in the same order as in ``sparse_moe``, so the outputs are its bits. No shape depends on the routing
    and nothing is read back: the loop runs over a fixed number of chunks.

    Args:
        x: (T, hidden) in the model dtype.
        moe: the block (its experts ``ExpertStack``s).
        experts_per_chunk: experts dequantized at once.

    Returns:
        (T, hidden) in ``x``'s dtype.
    """
    weights, expert_ids = route(x, moe)
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    outputs: torch.Tensor | None = None  # (S, hidden) in (token, slot) order
    for first in range(0, moe.num_experts, experts_per_chunk):
        chunk = slice(first, min(first + experts_per_chunk, moe.num_experts))
        count = chunk.stop - first
        local = flat_ids - first
        mine = (local >= 0) & (local < count)
        order = torch.argsort(torch.where(mine, local, count), stable=True)  # the chunk's pairs first, by expert
        out = _grouped_experts(x[order // top_k], moe.dense(chunk), flat_ids, order, count, first)
        if outputs is None:
            outputs = torch.empty_like(out)
        outputs[order] = torch.where(mine[order, None], out, outputs[order])
    assert outputs is not None
    out = outputs * weights.reshape(-1)[:, None]
    return out.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


def sparse_moe_reference(x: torch.Tensor, moe: MoEWeights) -> torch.Tensor:
    """The MoE block by its definition (every expert on every token): the oracle of ``sparse_moe``."""
    weights, expert_ids = route(x, moe)
    return experts_reference(x, weights, expert_ids, moe)


def experts_reference(
    x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, moe: MoEWeights
) -> torch.Tensor:
    """Each token's weighted sum of its chosen experts, computing all E experts on all T tokens (static shapes,
    E times the arithmetic of the grouped path).

    Args:
        x: (T, hidden); weights: (T, k) routing weights; expert_ids: (T, k) int64.

    Returns:
        (T, hidden) in ``x``'s dtype.
    """
    gate_up = torch.einsum("th,eoh->eto", x, moe.gate_up)  # (E, T, 2I)
    if moe.gate_up_bias is not None:
        gate_up = gate_up + moe.gate_up_bias[:, None]
    hidden = moe.activation(gate_up)
    every = torch.einsum("eti,ehi->eth", hidden, moe.down)  # (E, T, hidden)
    if moe.down_bias is not None:
        every = every + moe.down_bias[:, None]
    tokens = torch.arange(x.shape[0], device=x.device)[:, None]
    chosen = every[expert_ids, tokens]  # (T, k, hidden)
    return (chosen * weights[..., None]).sum(dim=1).to(x.dtype)


@dataclass(frozen=True)
class MoEConfig:
    """A MoE family's expert settings, read from config.json (``cbrun.engine.model.config``).

    Attributes:
        num_experts: E (``num_experts`` or ``num_local_experts``).
        top_k: experts per token (``num_experts_per_tok``).
        intermediate_size: each expert's width I (Qwen3-MoE's ``moe_intermediate_size``, Mixtral's
            ``intermediate_size``).
        norm_topk_prob: renormalise the chosen probabilities (always for Mixtral).
        weights_in_model_dtype: as ``MoEWeights``.
        sparse_layers: indices of the decoder layers whose MLP is the MoE block (the rest are dense MLPs).
        activation: the experts' activation (``MoEWeights.activation``).
        shared_expert_intermediate_size: the width of a dense SiLU MLP every MoE layer also runs, its output
            scaled by ``sigmoid(shared_expert_gate @ x)`` and added to the experts' (Qwen2-MoE); 0 for none.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    weights_in_model_dtype: bool
    sparse_layers: tuple[int, ...]
    activation: Callable[[torch.Tensor], torch.Tensor] = field(default=silu_and_mul)
    shared_expert_intermediate_size: int = 0


#: The paths that run a block's experts (``select_moe_backend``).
MOE_BACKENDS = ("triton", "cpu_kernel", "grouped_mm", "reference")


def select_moe_backend(moe: MoEWeights, grouped_reason: str | None) -> tuple[str, str]:
    """Which path runs a MoE block's experts, and why (for the log). The one place this is decided::

        CUDA   quantized experts      -> "triton": cbrun.kernels.fused_moe, the experts kept quantized in memory
                                         and dequantized in the kernel's inner loop (no per-forward dequantization)
               dense bf16, sm_90+     -> "grouped_mm": torch._grouped_mm
               other dense            -> "triton" (fp16 / fp32 experts, pre-sm_90 parts)
        CPU    dense fp32 / bf16 SiLU -> "cpu_kernel": cbrun.kernels.cpu_moe (C) for steps of at most
               experts, no biases        cpu_moe.MAX_ROWS_PER_EXPERT rows an expert on average (decode); a larger
                                         step runs the grouped GEMM ("grouped_mm" below, else "reference")
        other  grouped GEMM runs      -> "grouped_mm" (quantized experts dequantized per forward, this layer's)
               else                   -> "reference" (sparse_moe_reference's arithmetic)

    On CUDA a layout the kernel cannot step through (an int4 group that is not a multiple of 16) or an install
    without Triton falls to the last rule; on the CPU so do quantized experts, float16 ones, gpt-oss's (expert
    biases, its clamped SwiGLU) and a machine where the C kernel does not build (the reason is logged).

    Args:
        moe: the block.
        grouped_reason: ``grouped_gemm_unavailable_reason`` of its (dequantized) experts.

    Returns:
        ``(backend, reason)``, backend one of ``MOE_BACKENDS``.
    """
    device = moe.router.device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if device.type == "cuda":
        blocker = _triton_blocker(moe)
    else:
        blocker = _cpu_kernel_blocker(moe) if device.type == "cpu" else None
    return choose_moe_backend(device.type, capability, moe.quantized, moe.gate_up.dtype, grouped_reason, blocker)


def choose_moe_backend(
    device_type: str,
    capability: tuple[int, int] | None,
    quantized: bool,
    dtype: torch.dtype,
    grouped_reason: str | None,
    kernel_blocker: str | None,
) -> tuple[str, str]:
    """``select_moe_backend``'s rule on the facts it gathers (the device, its compute capability, whether the
    experts are quantized, their dtype, why the grouped GEMM or the device's own kernel, the fused Triton one on
    CUDA and the C one on the CPU, cannot run them)."""
    fallback = ("grouped_mm", "torch._grouped_mm") if grouped_reason is None else ("reference", grouped_reason)
    if device_type != "cuda":
        if device_type == "cpu" and not quantized and kernel_blocker is None:
            return "cpu_kernel", (
                f"the C kernel up to {cpu_moe.MAX_ROWS_PER_EXPERT} rows an expert on average, {fallback[0]} above"
            )
        why = f" (the C kernel: {kernel_blocker})" if device_type == "cpu" and kernel_blocker else ""
        return fallback[0], f"{fallback[1]} on {device_type}{why}"
    if quantized:
        if kernel_blocker is None:
            return "triton", "quantized experts: the fused Triton kernel dequantizes them in its inner loop"
        return fallback[0], f"{kernel_blocker}; the experts are dequantized per forward"
    if dtype == torch.bfloat16 and capability is not None and capability >= (9, 0):
        return fallback
    if kernel_blocker is None:
        return "triton", f"{dtype} experts on sm_{''.join(map(str, capability or ()))}: no torch._grouped_mm"
    return fallback[0], kernel_blocker


def _cpu_kernel_blocker(moe: MoEWeights) -> str | None:
    """Why the C kernel (``cbrun.kernels.cpu_moe``) cannot run this block's experts, or None. The router runs in
    PyTorch (``route``) whatever its rule; the kernel computes SiLU-gated experts without biases."""
    if moe.gate_up_bias is not None or moe.down_bias is not None:
        return "the experts have biases"
    if moe.activation is not silu_and_mul:
        return f"the experts' activation {getattr(moe.activation, '__name__', moe.activation)!r} is not SiLU"
    if moe.quantized:
        return "quantized experts"
    assert isinstance(moe.gate_up, torch.Tensor) and isinstance(moe.down, torch.Tensor)
    return cpu_moe.unsupported_reason(moe.gate_up, moe.down)


def _triton_blocker(moe: MoEWeights) -> str | None:
    """Why the fused Triton kernel cannot run this block's experts, or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    # NOTE: the kernel offers expert biases and gpt-oss's clamped SwiGLU (fused_moe_triton's arguments), but only
    # the SiLU block without biases is wired to it: a block with more keeps the other paths rather than run wrong.
    for name in ("router_bias", "gate_up_bias", "down_bias"):
        if getattr(moe, name, None) is not None:
            return f"the block's {name} is not wired to the fused kernel"
    activation = getattr(moe, "activation", None)
    if activation is not None and getattr(activation, "__name__", None) != "silu_and_mul":
        return f"the experts' activation {activation!r} is not wired to the fused kernel"
    for experts in (moe.gate_up, moe.down):
        if not isinstance(experts, (torch.Tensor, QuantizedExperts)):
            return f"{type(experts).__name__} experts are not wired to the fused kernel"
    for experts in (moe.gate_up, moe.down):
        if isinstance(experts, QuantizedExperts):
            for part in experts.experts[0]:
                reason = triton_unsupported_reason(part.kernel_layout)
                if reason is not None:
                    return reason
    return None


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    logger.info(message)


def kernel_expert_weights(moe: MoEWeights) -> tuple[ExpertWeights, ExpertWeights, ExpertWeights]:
    """(gate, up, down) as the fused kernel reads them: views of dense experts, or quantized experts stacked once
    (``QuantizedExperts.stack_for_kernel``, which rebinds the per-expert weights to views: no second copy)."""
    from cbrun.kernels.fused_moe import ExpertWeights

    if isinstance(moe.gate_up, QuantizedExperts) and isinstance(moe.down, QuantizedExperts):
        gate, up = moe.gate_up.stack_for_kernel()
        (down,) = moe.down.stack_for_kernel()
        return gate, up, down
    assert isinstance(moe.gate_up, torch.Tensor) and isinstance(moe.down, torch.Tensor), "mixed quantized experts"
    width = moe.down.shape[-1]
    gate_up = moe.gate_up
    return (
        ExpertWeights("dense", gate_up[:, :width]),
        ExpertWeights("dense", gate_up[:, width:]),
        ExpertWeights("dense", moe.down),
    )


def fused_experts(
    x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, experts: tuple[ExpertWeights, ...]
) -> torch.Tensor:
    """The routed experts through the fused Triton kernel, dispatched as one op (``torch.ops.cbrun.fused_moe``, so
    a CUDA-graph recorder sees it): SiLU-and-multiply, no biases.

    Args:
        x: (T, hidden); weights: (T, k) routing weights; expert_ids: (T, k) int64; experts: ``kernel_expert_weights``.

    Returns:
        (T, hidden) in x's dtype.
    """
    from cbrun.kernels.fused_moe import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, expert_op_args

    gate, up, down = experts
    return custom_ops.fused_moe(
        x,
        weights,
        expert_ids,
        expert_op_args(gate),
        expert_op_args(up),
        expert_op_args(down),
        gate.format,
        down.format,
        [*gate.block, *down.block],
        "silu",
        None,
        None,
        None,
        SWIGLU_OAI_ALPHA,
        SWIGLU_OAI_LIMIT,
    )


class SparseMoE:
    """A MoE block ready to run: its weights and the path that runs its experts (``select_moe_backend``, chosen
    once, at load, and logged once per distinct choice), or, under batch invariance, the linear every expert runs
    through.

    Args:
        weights: the block's tensors. On the Triton path, quantized experts are stacked for the kernel here.
        invariant_linear: under ``engine.batch_invariant``, the batch-invariant linear as a function of the weight
            (``linear.batch_invariant_linear``, or the Triton one): the block then runs ``sparse_moe_invariant``.

    Raises:
        ValueError: ``invariant_linear`` with quantized experts.
    """

    def __init__(self, weights: MoEWeights, invariant_linear: Callable[[torch.Tensor], Callable] | None = None) -> None:
        self.weights = weights
        # NOTE: quantized experts are judged on one expert dequantized: a fresh tensor of the dtype and row widths
        # the grouped GEMM will read each forward.
        self.fallback_reason = grouped_gemm_unavailable_reason(weights.dense(slice(0, 1)))
        per_expert = weights.gate_up.shape[1] * weights.gate_up.shape[2] + weights.down.shape[1] * weights.down.shape[2]
        #: quantized experts dequantized at once (``EXPERT_CHUNK_ELEMENTS``, at least one)
        self.experts_per_chunk = max(1, EXPERT_CHUNK_ELEMENTS // per_expert)
        self.invariant = None
        self.kernel_weights: tuple[ExpertWeights, ...] | None = None
        if invariant_linear is not None:
            if weights.quantized:
                raise ValueError(
                    "batch_invariant = on does not run quantized experts; set engine.batch_invariant = off"
                )
            if not _plain_silu_block(weights):
                raise ValueError(
                    "batch_invariant = on does not run this MoE block (a router bias, top-k before the softmax, "
                    "expert biases or an activation other than SiLU: gpt-oss's) yet; set engine.batch_invariant = off"
                )
            assert isinstance(weights.gate_up, torch.Tensor) and isinstance(weights.down, torch.Tensor)
            self.invariant = (
                invariant_linear(weights.router),
                invariant_linear(weights.gate_up[0]),
                invariant_linear(weights.down[0]),
            )
            self.backend = "batch_invariant"
            return
        self.backend, reason = select_moe_backend(weights, self.fallback_reason)
        _log_once(f"MoE experts: {self.backend} ({reason})")
        if self.backend == "triton":
            self.kernel_weights = kernel_expert_weights(weights)

    def __call__(self, x: torch.Tensor, silu_mul: Callable | None = None) -> torch.Tensor:
        """(T, hidden) -> (T, hidden): the fused Triton kernel; the C kernel (a step of at most
        ``cpu_moe.MAX_ROWS_PER_EXPERT`` rows an expert on average, else ``sparse_moe``); ``sparse_moe`` (quantized
        experts dequantized ``experts_per_chunk`` at a time by ``sparse_moe_in_expert_chunks`` where the grouped
        GEMM runs, else the layer's all at once); or ``sparse_moe_invariant`` with ``silu_mul`` (``silu(gate) * up``
        of two (n, I) tensors) under batch invariance."""
        if self.invariant is not None:
            assert silu_mul is not None, "the batch-invariant block needs the step's silu_mul"
            return sparse_moe_invariant(x, self.weights, *self.invariant, silu_mul)
        if self.kernel_weights is not None:
            weights, expert_ids = route(x, self.weights)
            return fused_experts(x, weights, expert_ids, self.kernel_weights)
        grouped = self.fallback_reason is None
        if self.backend == "cpu_kernel" and cpu_moe.runs_step(x.shape[0], self.weights.top_k, self.weights.num_experts):
            weights, expert_ids = route(x, self.weights)
            gate_up, down = self.weights.gate_up, self.weights.down
            assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            return custom_ops.cpu_moe(x, weights, expert_ids, gate_up, down, torch.get_num_threads())
        if self.weights.quantized and grouped:
            return sparse_moe_in_expert_chunks(x, self.weights, self.experts_per_chunk)
        return sparse_moe(x, self.weights.dense(), grouped=grouped)


def sparse_moe_invariant(
    x: torch.Tensor,
    moe: MoEWeights,
    router_linear: Callable,
    gate_up_linear: Callable,
    down_linear: Callable,
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The MoE block with each token's sums in one order whatever else is in the step (``engine.batch_invariant``).

    The grouped GEMM sums each expert's group in an order set by the group's size, which is the step's share of
    tokens routed to it. Here the router and every expert run through the batch-invariant linear (a row's result
    does not depend on how many rows come with it), each expert over its own rows (one host read of the per-expert
    counts a layer), the routing weights renormalise and each token's slots add up by explicit adds in slot order,
    so a token's output depends on the token alone. The same math as ``sparse_moe``, in other roundings.

    Args:
        x: (T, hidden) the normed hidden states.
        moe: the block (unquantized).
        router_linear, gate_up_linear, down_linear: ``F.linear``-like invariant functions of the router's, an
            expert's gate/up and an expert's down weights.
        silu_mul: ``silu(gate) * up`` of two contiguous (n, I) tensors, row-wise (may overwrite ``gate``).

    Returns:
        (T, hidden) in ``x``'s dtype.
    """
    assert isinstance(moe.gate_up, torch.Tensor) and isinstance(moe.down, torch.Tensor)
    weights, expert_ids = _route_invariant(x, moe, router_linear)
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)  # (S,), S = T * k, in (token, slot) order
    order = torch.argsort(flat_ids, stable=True)  # pairs sorted by expert
    rows = x[order // top_k]  # (S, hidden)
    counts = torch.bincount(flat_ids, minlength=moe.num_experts).tolist()  # NOTE: a host read, once a layer
    out = _experts_one_by_one(rows, counts, moe, gate_up_linear, down_linear, silu_mul)
    out = out * weights.reshape(-1)[order, None]
    unsorted = torch.empty_like(out)
    unsorted[order] = out  # back to (token, slot) order
    return _sum_slots(unsorted.view(num_tokens, top_k, -1)).to(x.dtype)


def _route_invariant(x: torch.Tensor, moe: MoEWeights, router_linear: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` with the router through the invariant ``router_linear`` and the top-k weights renormalised by
    ``_sum_slots`` (a reduction's order may follow the number of tokens): ``(weights, expert_ids)``, each (T, k)."""
    logits = router_linear(x, moe.router, None)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / _sum_slots(weights)[:, None]
    if moe.weights_in_model_dtype:
        weights = weights.to(logits.dtype)
    return weights, expert_ids


def _experts_one_by_one(
    rows: torch.Tensor,
    counts: list[int],
    moe: MoEWeights,
    gate_up_linear: Callable,
    down_linear: Callable,
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Each expert's MLP over its own group of the sorted pairs (``counts[e]`` rows for expert e, in expert order),
    each a separate call of the invariant linears, so a row's sums never depend on its group's size.

    Returns:
        (S, hidden) each sorted pair's expert output, before the routing weight.
    """
    assert isinstance(moe.gate_up, torch.Tensor) and isinstance(moe.down, torch.Tensor)
    width = moe.down.shape[-1]
    out = rows.new_empty(rows.shape[0], moe.down.shape[1])
    start = 0
    for expert, count in enumerate(counts):
        if count:
            gate_up = gate_up_linear(rows[start : start + count], moe.gate_up[expert], None)  # (n, 2I)
            hidden = silu_mul(gate_up[:, :width].contiguous(), gate_up[:, width:].contiguous())  # (n, I)
            out[start : start + count] = down_linear(hidden, moe.down[expert], None)
            start += count
    return out


def _sum_slots(values: torch.Tensor) -> torch.Tensor:
    """(T, k, ...) -> (T, ...): the slots added one by one in slot order (elementwise adds: the same order for
    every token whatever the number of tokens, which a reduction kernel does not promise)."""
    total = values[:, 0]
    for slot in range(1, values.shape[1]):
        total = total + values[:, slot]
    return total


def _plain_silu_block(moe: MoEWeights) -> bool:
    """Whether the block is the softmax-then-top-k router without a bias over bias-free SiLU experts (what
    ``sparse_moe_invariant`` computes)."""
    biases = (moe.router_bias, moe.gate_up_bias, moe.down_bias)
    return not moe.softmax_after_topk and all(b is None for b in biases) and moe.activation is silu_and_mul


def unsupported_moe_reason(mlp: torch.nn.Module, block_class: str) -> str | None:
    """Why a transformers MoE block cannot run as ``MoEWeights``, or None when it can.

    Args:
        mlp: the decoder layer's MLP module.
        block_class: the family's sparse MoE block class name (transformers is not imported here).
    """
    name = type(mlp).__name__
    if name != block_class:
        return f"MoE block {name} is not {block_class}"
    experts = mlp.experts
    if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False):
        return "the experts have biases or transposed weights"
    if type(experts.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
        return f"expert activation {type(experts.act_fn).__name__} (only SiLU is implemented)"
    if getattr(mlp.gate, "bias", None) is not None:
        return "the router has a bias"
    return None


def moe_weights_from_module(
    mlp: torch.nn.Module, norm_topk_prob: bool | None, weights_in_model_dtype: bool
) -> MoEWeights:
    """A transformers MoE block's own tensors (no copies), for a block ``unsupported_moe_reason`` accepts.

    Args:
        mlp: the block.
        norm_topk_prob: the family's rule (Mixtral: always True), None to read the router's ``norm_topk_prob``.
        weights_in_model_dtype: as ``MoEWeights``.
    """
    return MoEWeights(
        router=mlp.gate.weight,
        gate_up=mlp.experts.gate_up_proj,
        down=mlp.experts.down_proj,
        top_k=mlp.gate.top_k,
        norm_topk_prob=bool(mlp.gate.norm_topk_prob) if norm_topk_prob is None else norm_topk_prob,
        weights_in_model_dtype=weights_in_model_dtype,
    )
