"""FP8 W8A8: the activations quantized to float8 per token, then ``torch._scaled_mm`` on FP8 tensor cores (opt-in).

cbrun's FP8 GEMM is weight-only by default (``fp8_gemm``: the activations stay in their dtype, each product is
the dequantized weight's), so a quantized checkpoint's greedy tokens equal transformers' ``generate`` on the same
weights dequantized. On parts with FP8 tensor cores (compute capability 8.9 and up: L4, L40S, H100, H200) the
W8A8 path is faster on large batches: each row of x gets a dynamic scale ``amax(|x_row|) / 448`` and is rounded to
float8_e4m3fn, and ``torch._scaled_mm`` multiplies the float8 operands with float32 accumulation and applies both
scales in its epilogue (vLLM's default for FP8 checkpoints with ``activation_scheme: "dynamic"``:
``scaled_fp8_quant(..., use_per_token_if_dynamic=True)`` then ``cutlass_scaled_mm`` / ``torch._scaled_mm``).
Rounding the activations changes the numbers against the dequantized-weight oracle, so it is a choice, off by
default: the engine setting ``engine.fp8_activation_scheme`` (vLLM's ``Fp8Config.activation_scheme`` vocabulary), ``"none"``
(weight-only, the default) or ``"dynamic"`` (per-token dynamic activation scales, this module).

What ``"dynamic"`` runs: per-output-channel and per-tensor weight scales (``torch._scaled_mm``'s row-wise scaling:
scale_a (M, 1), scale_b (1, N)) with bf16 activations (row-wise scaling writes bf16), on CUDA parts with FP8
tensor cores and on the CPU, where PyTorch runs ``torch._scaled_mm`` for float8 in its own code (the same
arithmetic: how the tests check the engine's W8A8 path). The 128 x 128 block layout needs
per-group activation scales and a block-scaled GEMM (DeepGEMM's), which cbrun does not have: it is refused by name,
as are CUDA parts below sm_89 and other dtypes (``select_fp8_gemm``).
"""

from __future__ import annotations

import functools

import torch

#: The values of the ``fp8_activation_scheme`` setting.
FP8_ACTIVATION_SCHEMES = ("none", "dynamic")
#: The largest float8_e4m3fn value.
FP8_E4M3_MAX = 448.0
#: The smallest per-token scale: an all-zero row still divides by something (vLLM's 1 / (448 * 512)).
MIN_ACTIVATION_SCALE = 1.0 / (FP8_E4M3_MAX * 512.0)
#: The first compute capability with FP8 tensor cores (Ada Lovelace).
FP8_MIN_CAPABILITY = 89
#: How a refusal of the W8A8 path starts: the setting and what it runs; as a ``cbrun.engine.setting_error``
#: template (the field: the setting, which a job names ``engine.fp8_activation_scheme``), and as plain text.
W8A8_TEMPLATE = '{fp8_activation_scheme} = "dynamic" (W8A8 with torch._scaled_mm)'
W8A8 = W8A8_TEMPLATE.format(fp8_activation_scheme="fp8_activation_scheme")


def select_fp8_gemm(
    activation_scheme: str, capability: int | None, dtype: torch.dtype, block: tuple[int, int], shape: tuple[int, int]
) -> str:
    """Which FP8 GEMM serves a linear: ``"weight_only"`` (``fp8_gemm``'s Triton kernel or the CPU path) or
    ``"scaled_mm"`` (``fp8_scaled_mm``).

    Args:
        activation_scheme: the ``fp8_activation_scheme`` setting, ``"none"`` or ``"dynamic"``.
        capability: the GPU's compute capability (major * 10 + minor), None on the CPU.
        dtype: the activations' dtype.
        block: the weight's scale block (bo, bi).
        shape: the weight's (out_features, in_features), (N, K).

    Raises:
        ValueError: an unknown scheme; or ``"dynamic"`` where it cannot run, naming why
            (``w8a8_unavailable_reason``, ``w8a8_weight_refusal``).
    """
    if activation_scheme not in FP8_ACTIVATION_SCHEMES:
        raise ValueError(f"fp8_activation_scheme must be one of {FP8_ACTIVATION_SCHEMES}, got {activation_scheme!r}")
    if activation_scheme == "none":
        return "weight_only"
    reason = w8a8_unavailable_reason(capability, dtype) or w8a8_weight_refusal(block, shape)
    if reason:
        raise ValueError(f"{W8A8} {reason}")
    return "scaled_mm"


def w8a8_unavailable_reason(capability: int | None, dtype: torch.dtype) -> str | None:
    """Why ``fp8_scaled_mm`` cannot run on this device with ``dtype`` activations (the words after ``W8A8``,
    ending in what to change), or None.

    Args:
        capability: the GPU's compute capability (major * 10 + minor), None on the CPU (where PyTorch runs
            ``torch._scaled_mm`` for float8 in its own code: ``cpu_scaled_mm_unavailable_reason``).
        dtype: the activations' dtype.
    """
    if capability is not None and capability < FP8_MIN_CAPABILITY:
        return (
            f"needs FP8 tensor cores (compute capability >= 8.9), and this runs on sm_{capability}; use "
            'fp8_activation_scheme = "none" (weight-only FP8, the default)'
        )
    if capability is None:
        reason = cpu_scaled_mm_unavailable_reason()
        if reason:
            return f'does not run on the CPU with this torch ({reason}); use fp8_activation_scheme = "none"'
    if dtype != torch.bfloat16:
        return (
            f"runs bf16 activations only (torch._scaled_mm writes bf16 with row-wise scales), and the engine "
            f'runs {str(dtype).removeprefix("torch.")}; set dtype = "bfloat16", or fp8_activation_scheme = "none"'
        )
    return None


def w8a8_weight_refusal(block: tuple[int, int], shape: tuple[int, int]) -> str | None:
    """Why ``fp8_scaled_mm`` cannot take a float8 weight of ``shape`` (N, K) with ``block`` (bo, bi) scales (the
    words after ``W8A8``, ending in what to change), or None: its scales must cover whole rows (per-channel, bo 1,
    or per-tensor, bo N) and N and K be multiples of 16."""
    out_features, in_features = shape
    if block[0] not in (1, out_features) or block[1] < in_features:
        return (
            f"runs per-channel or per-tensor FP8 weights, not the {block[0]} x {block[1]} block layout (that needs "
            'per-group activation scales); set fp8_activation_scheme = "none"'
        )
    if out_features % 16 or in_features % 16:
        return (
            f"needs both dimensions of each weight a multiple of 16, and a weight is {out_features} x "
            f'{in_features}; set fp8_activation_scheme = "none"'
        )
    return None


@functools.lru_cache(maxsize=None)
def cpu_scaled_mm_unavailable_reason() -> str | None:
    """Why this torch build cannot run ``torch._scaled_mm`` on float8 CPU tensors with row-wise scales and bf16
    output (the first line of its exception), or None: tried once on a 16 x 16 product, then remembered."""
    a = torch.ones(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return f"torch._scaled_mm failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return None


@functools.lru_cache(maxsize=None)
def cuda_capability(device: torch.device) -> int | None:
    """Compute capability (major * 10 + minor) of a CUDA device, None off CUDA; cached: asked every layer."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 quantization of the activations.

    Args:
        x: (M, K) fp16/bf16/fp32.

    Returns:
        (x_fp8, scale): (M, K) float8_e4m3fn ``round(x / scale)`` saturated to +-448, and (M, 1) float32
        ``max(amax(|x_row|) / 448, MIN_ACTIVATION_SCALE)``, so that ``x_fp8 * scale`` approximates x.
    """
    xf = x.to(torch.float32)
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX).clamp(min=MIN_ACTIVATION_SCALE)
    return (xf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale


def channel_scales(scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """A per-channel ((N, 1) or (N,)) or per-tensor ((1, 1), (1,) or ()) weight scale as the (1, N) float32 row
    ``torch._scaled_mm`` takes for ``scale_b``."""
    return scale.to(torch.float32).reshape(1, -1).expand(1, out_features).contiguous()


def fp8_scaled_mm_ref(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The arithmetic of ``fp8_scaled_mm`` in plain float32: ``(float(x_fp8) @ float(W_fp8).T) * scale_x *
    scale_w (+ bias)``, rounded once to x's dtype.

    Args:
        x: (M, K). qweight: (N, K) float8_e4m3fn. scale: the weight's per-channel or per-tensor float32 scale.
        bias: (N,) or None.
    """
    xq, sx = quantize_per_token(x)
    out = (xq.to(torch.float32) @ qweight.to(torch.float32).T) * sx * channel_scales(scale, qweight.shape[0])
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def fp8_scaled_mm(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """W8A8: ``x`` quantized per token, multiplied with the FP8 weight by ``torch._scaled_mm``.

    Runs where ``select_fp8_gemm`` returned ``"scaled_mm"`` (sm_89+, or the CPU, where PyTorch runs it in its own
    code: equal to ``fp8_scaled_mm_ref`` but for the order of its float32 sums).

    Args:
        x: (M, K) bf16. qweight: (N, K) float8_e4m3fn, rows contiguous (its transpose is the column-major
            operand ``torch._scaled_mm`` wants); K and N multiples of 16.
        scale: the weight's per-channel ((N, 1) / (N,)) or per-tensor float32 scale. bias: (N,) bf16 or None.

    Returns:
        (M, N) bf16.

    Raises:
        ValueError: naming the argument whose shape or dtype ``torch._scaled_mm`` cannot take.
    """
    out_features, in_features = qweight.shape
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"fp8_scaled_mm: x must be (M, {in_features}) bf16, got {x.dtype} {tuple(x.shape)}")
    if qweight.dtype != torch.float8_e4m3fn or qweight.stride(1) != 1:
        raise ValueError(f"fp8_scaled_mm: qweight must be row-major float8_e4m3fn, got {qweight.dtype}")
    if in_features % 16 or out_features % 16:
        raise ValueError(f"fp8_scaled_mm: K = {in_features} and N = {out_features} must be multiples of 16")
    if scale.numel() not in (1, out_features):
        raise ValueError(f"fp8_scaled_mm: scale must be per-channel or per-tensor, got shape {tuple(scale.shape)}")
    xq, sx = quantize_per_token(x)
    return torch._scaled_mm(
        xq,
        qweight.t(),
        scale_a=sx,
        scale_b=channel_scales(scale, out_features),
        bias=bias,
        out_dtype=torch.bfloat16,
    )
