"""Quantized checkpoints on the lean path: which ``quantization_config`` layouts cbrun runs (``QuantScheme``), and
the refusal, by name, of every other one. The weight types they are read into are ``base`` / ``fp8`` / ``int4``
beside this module.

Implemented (weight-only: the activations stay in the engine's dtype, each product is the dequantized weight's):

- ``quant_method: "fp8"`` (transformers' ``FineGrainedFP8Config``; Qwen3-FP8, DeepSeek-V3): each linear's
  ``weight`` is float8_e4m3fn (out, in), its ``weight_scale_inv`` float (ceil(out / bo), ceil(in / bi)) for
  ``weight_block_size: [bo, bi]``; the real weight is ``weight[i, j] * weight_scale_inv[i // bo, j // bi]``
  (DeepSeek-V3's ``weight_dequant``: the "inverse" scale multiplies).
- ``quant_method: "compressed-tensors"``, ``format: "float-quantized"``, one config group of 8-bit float weights
  with the ``channel`` or ``tensor`` strategy (Neural Magic / Red Hat "FP8-dynamic" checkpoints): ``weight``
  float8_e4m3fn (out, in), ``weight_scale`` (out, 1) or (1,); the real weight is ``weight * weight_scale``.
- int4 weight-only (``cbrun.engine.model.layers.quantization.int4``): compressed-tensors ``format: "pack-quantized"`` (4-bit int
  weights by group or channel, symmetric or with packed zero points: llm-compressor's W4A16), ``quant_method:
  "gptq"`` (bits 4, ``desc_act: false``, the v1 ``checkpoint_format: "gptq"``) and ``quant_method: "awq"`` (bits 4,
  the GEMM version with zero points), all kept as packed 4-bit codes with group scales.
- ``quant_method: "mxfp4"`` (gpt-oss's checkpoints): the MoE experts' ``*_blocks`` (uint8, two e2m1 codes a byte)
  and ``*_scales`` (uint8 e8m0, one per 32 values), kept as stored (``cbrun.engine.model.layers.quantization.mxfp4``);
  only a family whose experts are stored so reads it (``ModelFamily.unsupported_quantization``), every other
  refuses it by name (``cbrun.engine.model.registry.checkpoint_quantization``).

The float8 layouts are one block scale here: per-channel is the block (1, in), per-tensor the block (out, in).
Dynamic activation quantization (``activation_scheme: "dynamic"``, ``input_activations`` dynamic per token) is a
choice of the GEMM that serves the checkpoint, not of its weights: by default cbrun does not quantize activations
(weight-only, so its greedy tokens equal transformers' ``generate`` on the same weights dequantized); the engine
setting ``fp8_activation_scheme = "dynamic"`` asks for it on float8 per-channel / per-tensor weights
(``cbrun.engine.model.layers.quantization.fp8.w8a8_linear``). Anything
else (other methods, static activation scales, act-order, other bit widths, MXFP4 outside gpt-oss's experts, a
KV-cache scheme) is refused
by name at load (``checkpoint_quantization``), on every loader: transformers would dequantize some of them at load
on the CPU, or need a package or a GPU, so no path would run them as the checkpoint means.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: mxfp4 config keys: which modules transformers leaves unquantized (gpt-oss quantizes its experts only, whatever
#: the list says: any other ``*_blocks`` tensor is refused by the loader's name check) and whether it dequantizes
#: at load (a loading choice; the stored weights are the same).
_MXFP4_KEYS = frozenset({"quant_method", "modules_to_not_convert", "dequantize"})
_FP8_KEYS = frozenset({"quant_method", "activation_scheme", "weight_block_size", "fmt", "modules_to_not_convert"})
_CT_KEYS = frozenset(
    {
        "quant_method",
        "format",
        "config_groups",
        "ignore",
        "quantization_status",
        "kv_cache_scheme",
        "global_compression_ratio",
        "sparsity_config",
        "transform_config",
        "version",
    }
)
#: GPTQ config keys that change the checkpoint's layout or numbers, with the one value cbrun runs (None: absent
#: or null). Every other key (damp_percent, true_sequential, the kernel and calibration choices) does not.
_GPTQ_LAYOUT = {"checkpoint_format": ("gptq", None), "format": ("gptq", None), "pack_dtype": ("int32", None)}
#: AWQ config keys that change the layout, with the values cbrun runs.
_AWQ_LAYOUT = {"version": ("gemm", "GEMM", None), "backend": ("autoawq", None), "zero_point": (True, None)}
IMPLEMENTED = (
    'fp8 (weight_block_size [bo, bi], fmt "e4m3", activation_scheme "dynamic"); compressed-tensors '
    "float-quantized (8-bit float weights, channel or tensor strategy); compressed-tensors pack-quantized "
    "(4-bit int weights, group or channel strategy, weight-only); gptq (bits 4, desc_act false, "
    'checkpoint_format "gptq"); awq (bits 4, version "gemm", zero_point true); mxfp4 (gpt-oss\'s MoE experts: '
    "*_blocks uint8 e2m1 codes, *_scales uint8 e8m0 per 32 values)"
)


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's quantization, as cbrun runs it.

    Attributes:
        method: ``quant_method`` as config.json states it ("fp8", "compressed-tensors", "gptq" or "awq").
        layout: how each quantized linear is stored: "float8" (a float8 ``weight`` and a block scale),
            "pack-quantized" (compressed-tensors' int4), "gptq" or "awq" (``cbrun.engine.model.layers.quantization.int4``),
            "mxfp4" (MoE experts' ``*_blocks`` / ``*_scales``, read by the family itself: no per-linear suffixes).
        block: float8: (bo, bi) the block each scale covers; None: the whole input row (per-channel, bo 1) or
            the whole matrix (per-tensor), read from each scale's shape.
        scale_suffix: float8: the name of each weight's scale tensor after the linear's name
            ("weight_scale_inv" or "weight_scale").
        group_size: int4: input features per scale; None: one group per output row.
        symmetric: int4 compressed-tensors: no zero-point tensor (the zero is the code 8).
    """

    method: str
    layout: str = "float8"
    block: tuple[int, int] | None = None
    scale_suffix: str = ""
    group_size: int | None = None
    symmetric: bool = True

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The tensor names, after each quantized linear's ``name.``, that hold its weight; the first marks a
        linear as quantized (a linear without it is a plain weight)."""
        if self.layout == "float8":
            return (self.scale_suffix, "weight")
        if self.layout == "pack-quantized":
            zero = () if self.symmetric else ("weight_zero_point",)
            return ("weight_packed", "weight_scale", "weight_shape", *zero)
        if self.layout == "gptq":
            return ("qweight", "qzeros", "scales", "g_idx")
        if self.layout == "mxfp4":
            return ()  # stacked experts' tensors, named by the family (``checkpoint_shapes``)
        return ("qweight", "qzeros", "scales")

    @property
    def optional_suffixes(self) -> frozenset[str]:
        """Suffixes a quantized linear may lack (GPTQ's ``g_idx``: contiguous groups when absent)."""
        return frozenset({"g_idx"}) if self.layout == "gptq" else frozenset()

    def block_of(self, weight_shape: tuple[int, int], scale_shape: tuple[int, ...]) -> tuple[int, int] | None:
        """float8: the (bo, bi) block a scale of ``scale_shape`` covers on a weight of ``weight_shape``, None when
        the shapes do not fit this scheme."""
        out_features, in_features = weight_shape
        if self.block is not None:
            bo, bi = self.block
            return self.block if tuple(scale_shape) == (-(-out_features // bo), -(-in_features // bi)) else None
        if tuple(scale_shape) in ((out_features, 1), (out_features,)):
            return (1, in_features)
        if tuple(scale_shape) in ((1,), (), (1, 1)):
            return (out_features, in_features)
        return None


def read_quantization(raw: object) -> tuple[QuantScheme | None, str | None]:
    """config.json's ``quantization_config`` as a ``QuantScheme``, or ``(None, why cbrun does not run it)``.

    Args:
        raw: the ``quantization_config`` value (a dict in any checkpoint transformers reads).
    """
    if not isinstance(raw, dict):
        return None, f"quantization_config {raw!r} is not an object"
    method = raw.get("quant_method")
    if method == "fp8":
        return _fp8_scheme(raw)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(raw)
    if method == "gptq":
        return _gptq_scheme(raw)
    if method == "awq":
        return _awq_scheme(raw)
    if method == "mxfp4":
        unknown = sorted(set(raw) - _MXFP4_KEYS)
        if unknown:
            return None, f"mxfp4 with {', '.join(unknown)}"
        return QuantScheme("mxfp4", "mxfp4"), None
    return None, f"quant_method {method!r}"


def _fp8_scheme(raw: dict) -> tuple[QuantScheme | None, str | None]:
    unknown = sorted(set(raw) - _FP8_KEYS)
    if unknown:
        return None, f"fp8 with {', '.join(unknown)}"
    if raw.get("fmt", "e4m3") != "e4m3":
        return None, f"fp8 with fmt {raw['fmt']!r} (only e4m3)"
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        return None, f"fp8 with activation_scheme {raw['activation_scheme']!r} (static input scales)"
    block = raw.get("weight_block_size")
    if not isinstance(block, list) or len(block) != 2 or not all(_positive_int(b) for b in block):
        return None, f"fp8 with weight_block_size {block!r} (only block-quantized weights, [bo, bi])"
    return QuantScheme("fp8", "float8", (block[0], block[1]), "weight_scale_inv"), None


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _compressed_tensors_scheme(raw: dict) -> tuple[QuantScheme | None, str | None]:
    name = "compressed-tensors"
    unknown = sorted(set(raw) - _CT_KEYS)
    if unknown:
        return None, f"{name} with {', '.join(unknown)}"
    fmt = raw.get("format")
    if fmt not in ("float-quantized", "pack-quantized"):
        return None, f"{name} format {fmt!r}"
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if raw.get(key):
            return None, f"{name} with {key}"
    if raw.get("quantization_status", "compressed") not in ("compressed", "frozen"):
        return None, f"{name} quantization_status {raw['quantization_status']!r}"
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        return None, f"{name} with {len(groups) if isinstance(groups, dict) else 0} config groups (only one)"
    (group,) = groups.values()
    if not isinstance(group, dict) or group.get("targets") != ["Linear"]:
        return None, f"{name} config group targets {group.get('targets') if isinstance(group, dict) else None!r}"
    weights = group.get("weights") or {}
    if fmt == "pack-quantized":
        return _ct_int4_scheme(group, weights)
    wanted = {"num_bits": 8, "type": "float", "symmetric": True}
    if any(weights.get(k) != v for k, v in wanted.items()) or weights.get("dynamic", False):
        return None, f"{name} weights {weights!r} (only static symmetric 8-bit float)"
    if weights.get("strategy") not in ("channel", "tensor") or weights.get("group_size") is not None:
        return None, f"{name} weight strategy {weights.get('strategy')!r} (only channel or tensor)"
    for key in ("input_activations", "output_activations"):
        act = group.get(key)
        if act is not None and not (key == "input_activations" and act.get("dynamic") is True):
            return None, f"{name} {key} {act!r} (static activation scales)"
    return QuantScheme(name, "float8", None, "weight_scale"), None


def _ct_int4_scheme(group: dict, weights: dict) -> tuple[QuantScheme | None, str | None]:
    """compressed-tensors ``pack-quantized``: 4-bit int weights by group (or channel), weight-only."""
    name = "compressed-tensors pack-quantized"
    if weights.get("num_bits") != 4 or weights.get("type") != "int" or weights.get("dynamic", False):
        return None, f"{name} weights {weights!r} (only static 4-bit int)"
    strategy, group_size = weights.get("strategy"), weights.get("group_size")
    if not (strategy == "group" and _positive_int(group_size)) and not (strategy == "channel" and not group_size):
        return None, f"{name} weight strategy {strategy!r} with group_size {group_size!r} (only group or channel)"
    if weights.get("actorder") not in (None, "weight"):
        return None, f"{name} with actorder {weights['actorder']!r} (a weight_g_idx permutation)"
    if weights.get("block_structure") is not None:
        return None, f"{name} with block_structure {weights['block_structure']!r}"
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            return None, f"{name} {key} {group[key]!r} (only weight-only, W4A16)"
    symmetric = weights.get("symmetric", True) is not False
    return QuantScheme("compressed-tensors", "pack-quantized", group_size=group_size, symmetric=symmetric), None


def _int4_group_size(method: str, bits: object, group_size: object) -> tuple[int | None, str | None]:
    """(group size or None for one group per row, None) or (None, why not)."""
    if bits != 4:
        return None, f"{method} with bits {bits!r} (only 4)"
    if group_size == -1:
        return None, None
    if not isinstance(group_size, int) or not _positive_int(group_size):
        return None, f"{method} with group_size {group_size!r}"
    return group_size, None


def _gptq_scheme(raw: dict) -> tuple[QuantScheme | None, str | None]:
    group_size, reason = _int4_group_size("gptq", raw.get("bits"), raw.get("group_size", 128))
    if reason:
        return None, reason
    if raw.get("desc_act", False) is not False:
        return None, f"gptq with desc_act {raw['desc_act']!r} (act-order: only desc_act false)"
    for key, values in _GPTQ_LAYOUT.items():
        if raw.get(key) not in values:
            return None, f"gptq with {key} {raw[key]!r}"
    if raw.get("dynamic"):
        return None, "gptq with dynamic (per-module bits or group sizes)"
    return QuantScheme("gptq", "gptq", group_size=group_size), None


def _awq_scheme(raw: dict) -> tuple[QuantScheme | None, str | None]:
    bits = raw.get("bits", raw.get("w_bit"))
    group_size, reason = _int4_group_size("awq", bits, raw.get("group_size", raw.get("q_group_size")))
    if reason:
        return None, reason
    if group_size is None:
        return None, "awq with group_size -1"
    for key, values in _AWQ_LAYOUT.items():
        if raw.get(key) not in values:
            return None, f"awq with {key} {raw[key]!r}"
    return QuantScheme("awq", "awq", group_size=group_size), None


def checkpoint_quantization(model_dir: str | Path) -> QuantScheme | None:
    """The model directory's quantization, None for an unquantized checkpoint (or a config.json that cannot be
    read: the loaders report that themselves).

    Raises:
        ValueError: naming the ``quantization_config`` and what cbrun implements, when it is not implemented.
    """
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("quantization_config") is None:
        return None
    scheme, reason = read_quantization(raw["quantization_config"])
    if scheme is None:
        raise ValueError(refusal(reason or "unreadable"))
    return scheme


def refusal(reason: str) -> str:
    """The error text for a ``quantization_config`` cbrun does not run."""
    return (
        f"config.json's quantization_config is not implemented by cbrun: {reason}; implemented: {IMPLEMENTED}. "
        "Use an unquantized checkpoint or one of these layouts"
    )
