"""The routed experts of a MoE layer on the CPU in C (``cpu_moe.c``): one call per layer and step.

At decode a MoE layer's experts each see a few of the step's rows (``T * k / E`` on average), so the layer is a pass
over the hit experts' weights, and torch's GEMMs at 1 to 4 rows stream them at a third of the bandwidth a plain
pass reaches. The kernel groups the (token, slot) pairs by expert itself, then reads each hit expert's gate_up and
down rows once, in memory order, dotting each with all of the expert's rows; then ``silu(gate) * up`` and each
token's weighted sum over its slots in slot order (transformers' ``grouped_mm`` experts' order). Nothing is read
back to the host and no shape depends on the routing. Above ``MAX_ROWS_PER_EXPERT`` rows per expert on average
(prefill) a GEMM's blocking wins; the MoE block then runs its grouped GEMM (``cbrun.engine.model.layers.moe``).

A row's output depends on its own values only (each dot product's order is fixed by the width alone), not on the
other rows of its step or the thread count. bfloat16 experts are widened to float32 in registers, and the kernel
rounds to bfloat16 where torch's grouped path stores bfloat16. Built with ``cbrun.kernels.c_build`` on first use;
where it cannot build, ``unavailable_reason`` says why and the MoE block keeps its PyTorch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from cbrun.kernels.c_build import KernelLibrary

SOURCE = Path(__file__).with_name("cpu_moe.c")
#: The kernel runs a step while its mean rows per expert, ``T * k / E``, is at most this (a static rule on the
#: step's shape, never on the routing). On a Zen 4 core (Qwen3-MoE 512 wide, 32 experts of 256, float32, one
#: thread) the kernel is 3x the grouped GEMM at 0.5 to 2 rows an expert, 1.6x at 8, 1.3x at 16, even at 32, and
#: 0.65x at 64.
MAX_ROWS_PER_EXPERT = 16
#: The experts' dtypes the kernel takes.
DTYPES = (torch.float32, torch.bfloat16)

_ERRORS = {1: "could not allocate its work memory", 2: "met an expert id outside [0, num_experts)"}


def unavailable_reason() -> str | None:
    """Why the C kernel cannot run here (building it on first call), or None when it can."""
    return _LIBRARY.unavailable_reason()


def unsupported_reason(gate_up: torch.Tensor, down: torch.Tensor) -> str | None:
    """Why ``moe_experts`` cannot take these experts (or the kernel cannot build here), or None when it can.

    Args:
        gate_up: (E, 2I, hidden); down: (E, hidden, I): CPU tensors of one dtype of ``DTYPES``, unit stride along
            their last dimension.
    """
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return "quantized experts"
    if gate_up.device.type != "cpu" or down.device.type != "cpu":
        return f"the experts are on {gate_up.device.type}"
    if gate_up.dtype not in DTYPES or down.dtype != gate_up.dtype:
        return f"{gate_up.dtype} / {down.dtype} experts (the kernel takes float32 or bfloat16)"
    if gate_up.dim() != 3 or down.dim() != 3 or down.shape[0] != gate_up.shape[0]:
        return f"expert shapes {tuple(gate_up.shape)} and {tuple(down.shape)}"
    if gate_up.shape[1] != 2 * down.shape[2] or down.shape[1] != gate_up.shape[2]:
        return f"gate_up {tuple(gate_up.shape)} does not match down {tuple(down.shape)}"
    if gate_up.stride(2) != 1 or down.stride(2) != 1:
        return "the experts' rows are not contiguous"
    return _LIBRARY.unavailable_reason()


def runs_step(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether the kernel takes a step of ``num_tokens`` rows (``MAX_ROWS_PER_EXPERT``)."""
    return num_tokens * top_k <= MAX_ROWS_PER_EXPERT * num_experts


def moe_experts(
    x: torch.Tensor,
    routing_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    num_threads: int = 1,
) -> torch.Tensor:
    """Each token's weighted sum of its chosen experts' SiLU-gated MLPs (no biases).

    Args:
        x: (T, hidden) in the experts' dtype (float32 or bfloat16).
        routing_weights: (T, k) float32 or the experts' dtype (bfloat16 weights make each weighted output
            bfloat16 before the sum, as torch's product of two bfloat16 tensors does).
        expert_ids: (T, k) int64 in [0, E).
        gate_up: (E, 2I, hidden), each expert's gate rows then its up rows; down: (E, hidden, I)
            (``unsupported_reason`` None).
        num_threads: OpenMP threads (the result does not depend on it).

    Returns:
        (T, hidden) in x's dtype: ``sum_j w[t, j] * down[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t])``,
        ``e = expert_ids[t, j]``, the slots added in order j = 0..k-1 in float32.

    Raises:
        ValueError: experts ``unsupported_reason`` refuses, or inputs of the wrong shape or dtype.
        RuntimeError: the kernel is unavailable, could not allocate its work memory, or met an expert id out of
            range.
    """
    reason = unsupported_reason(gate_up, down)
    if reason is not None:
        raise ValueError(f"the CPU MoE kernel does not take these experts: {reason}")
    _check_inputs(x, routing_weights, expert_ids, gate_up)
    num_tokens, hidden = x.shape
    x = x.contiguous()
    route = routing_weights.to(torch.float32).contiguous()
    ids = expert_ids.contiguous()
    out = torch.empty_like(x)
    num_experts, width = gate_up.shape[0], down.shape[2]
    dims = (ctypes.c_int64 * 9)(
        num_tokens, hidden, ids.shape[1], num_experts, width, gate_up.stride(0), gate_up.stride(1),
        down.stride(0), down.stride(1),
    )  # fmt: skip
    bf16 = x.dtype == torch.bfloat16
    status = _LIBRARY.loaded().cbrun_moe_experts(
        x.data_ptr(), route.data_ptr(), ids.data_ptr(), gate_up.data_ptr(), down.data_ptr(), out.data_ptr(), dims,
        int(bf16), int(bf16 and routing_weights.dtype == torch.bfloat16), max(1, num_threads),
    )  # fmt: skip
    if status:
        raise RuntimeError(f"the CPU MoE kernel {_ERRORS.get(status, f'failed ({status})')}")
    return out


def _check_inputs(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor) -> None:
    """``moe_experts``' ValueErrors for x, the routing weights and the expert ids."""
    if x.dim() != 2 or x.shape[1] != gate_up.shape[2] or x.dtype != gate_up.dtype or x.device.type != "cpu":
        raise ValueError(
            f"x must be a (T, {gate_up.shape[2]}) {gate_up.dtype} CPU tensor; got {x.dtype} {tuple(x.shape)} on "
            f"{x.device}"
        )
    if ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids must be ({x.shape[0]}, k) int64; got {ids.dtype} {tuple(ids.shape)}")
    if weights.shape != ids.shape or weights.dtype not in (torch.float32, x.dtype):
        raise ValueError(
            f"routing_weights must be {tuple(ids.shape)} float32 or {x.dtype}; got {weights.dtype} "
            f"{tuple(weights.shape)}"
        )


def _bind(library: ctypes.CDLL) -> None:
    ptr = ctypes.c_void_p
    library.cbrun_moe_experts.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    library.cbrun_moe_experts.restype = ctypes.c_int


_LIBRARY = KernelLibrary(SOURCE, "the CPU MoE kernel", "about 1 s", _bind, "torch._grouped_mm")
