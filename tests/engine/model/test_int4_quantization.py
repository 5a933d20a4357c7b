"""int4 weight-only checkpoints (``cbrun.engine.model.layers.quantization.int4``): a random Llama / Qwen3 quantized here, 4 bits with
group 128, into the real layouts (compressed-tensors ``pack-quantized`` symmetric and with zero points, GPTQ v1 with
``desc_act: false``, AWQ GEMM), written as those tools write them (tensor names, packing, dtypes, config.json),
kept packed in memory, gives the greedy tokens transformers' ``generate`` gives on the same weights dequantized (a
float32 checkpoint written from them by this file's own unpacking, independent of cbrun's); the chunked GEMM
equals its reference; what cbrun does not run of these formats is refused by name.

The compressed-tensors writer here was checked once against compressed-tensors 0.20.0's own ``pack_to_int32`` /
``unpack_from_int32`` (weights and packed zero points: the same int32 words; not a dependency of the suite)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.model.layers.quantization.base import DEQUANT_CHUNK_ELEMENTS, QuantizedLinearWeight, quantized_linear
from cbrun.engine.model.layers.quantization.int4 import Int4Weight, pack_rows
from tests.model_utils import hf_greedy, random_model_dir, random_prompts, session_tmp_dir

ENGINE_CONFIG = dict(page_size=4, max_batch_tokens=16, num_blocks=256, dtype="float32")
NEW_TOKENS = 8
GROUP = 128
#: down_proj's 320 inputs are 2.5 groups of 128: the last group ragged on purpose.
MODEL = dict(hidden_size=256, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2)
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _groups(weight: torch.Tensor) -> list[slice]:
    return [slice(g, min(g + GROUP, weight.shape[1])) for g in range(0, weight.shape[1], GROUP)]


def _quantize(weight: torch.Tensor, symmetric: bool) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """Round-to-nearest per (row, group): (codes (out, in) 0..15, zeros (out, groups) 0..15, scales (out, groups)
    float32). Symmetric: zero 8 and scale max|w| / 7; else min..max over 15 steps."""
    codes = np.zeros(weight.shape, dtype=np.int64)
    zeros = np.zeros((weight.shape[0], len(_groups(weight))), dtype=np.int64)
    scales = torch.zeros(zeros.shape)
    for g, cols in enumerate(_groups(weight)):
        w = weight[:, cols]
        if symmetric:
            scale, zero = (w.abs().amax(1) / 7).clamp(min=1e-8), torch.full((w.shape[0],), 8.0)
        else:
            lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
            scale = ((hi - lo) / 15).clamp(min=1e-8)
            zero = (-lo / scale).round().clamp(0, 15)
        codes[:, cols] = (w / scale[:, None] + zero[:, None]).round().clamp(0, 15).numpy()
        zeros[:, g], scales[:, g] = zero.numpy(), scale
    return codes, zeros, scales


def _pack_along_columns(values: np.ndarray, order: list[int] | None = None) -> torch.Tensor:
    """(rows, n) 0..15 -> (rows, ceil(n / 8)) int32: word k holds columns 8k.. in 4-bit fields, field i taking
    column ``8k + order[i]`` (compressed-tensors' ``pack_to_int32`` and GPTQ's order: 0..7; AWQ's interleaved)."""
    order = order or list(range(8))
    rows, n = values.shape
    padded = np.zeros((rows, -(-n // 8) * 8), dtype=np.uint32)
    padded[:, :n] = values
    packed = np.zeros((rows, padded.shape[1] // 8), dtype=np.uint32)
    for i, column in enumerate(order):
        packed |= padded[:, column::8] << np.uint32(4 * i)
    return torch.from_numpy(packed.view(np.int32).copy())


def _unpack_along_columns(packed: torch.Tensor, n: int, order: list[int] | None = None) -> np.ndarray:
    order = order or list(range(8))
    words = packed.numpy().view(np.uint32)
    out = np.zeros((words.shape[0], words.shape[1] * 8), dtype=np.int64)
    for i, column in enumerate(order):
        out[:, column::8] = (words >> np.uint32(4 * i)) & 15
    return out[:, :n]


def _expand(per_group: torch.Tensor, in_features: int) -> torch.Tensor:
    """(out, groups) -> (out, in) each group's value at each of its columns."""
    return per_group[:, torch.arange(in_features) // GROUP]


def _layout_tensors(base: str, weight: torch.Tensor, layout: str) -> tuple[dict, torch.Tensor]:
    """One linear's stored tensors in ``layout`` and its real weight, unpacked again from those stored tensors
    by the format's own formula (float32)."""
    out_features, in_features = weight.shape
    codes, zeros, scales = _quantize(weight, symmetric=layout == "ct-sym")
    if layout in ("ct-sym", "ct-asym"):
        scale = scales.to(torch.bfloat16)  # llm-compressor stores scales in the model's dtype
        stored = {
            base + "weight_packed": _pack_along_columns(codes),  # the signed code q + 8: what pack_to_int32 writes
            base + "weight_scale": scale,
            base + "weight_shape": torch.tensor([out_features, in_features]),
        }
        signed = _unpack_along_columns(stored[base + "weight_packed"], in_features) - 8
        zero_point = np.zeros_like(zeros)
        if layout == "ct-asym":
            zero_point = zeros - 8  # signed zero points, packed + 8 along the output rows (packed_dim 0)
            stored[base + "weight_zero_point"] = _pack_along_columns((zero_point + 8).T).T.contiguous()
            zero_point = _unpack_along_columns(stored[base + "weight_zero_point"].T.contiguous(), out_features).T - 8
        real = torch.from_numpy(signed - zero_point[:, np.arange(in_features) // GROUP]).float()
        return stored, real * _expand(scale.float(), in_features)
    scale = scales.to(torch.float16)  # AutoGPTQ / AutoAWQ store float16 scales
    if layout == "gptq":
        stored = {base + "qweight": _gptq_qweight(codes)}  # (in / 8, out): packed along the inputs
        stored[base + "qzeros"] = _pack_along_columns((zeros.T - 1) & 15)  # v1: zero - 1, packed along outputs
        stored[base + "scales"] = scale.T.contiguous()
        stored[base + "g_idx"] = torch.arange(in_features, dtype=torch.int32) // GROUP
        q = _unpack_along_columns(stored[base + "qweight"].T.contiguous(), in_features)  # (out, in)
        z = ((_unpack_along_columns(stored[base + "qzeros"], out_features) + 1) & 15).T  # (out, groups)
    else:
        stored = {
            base + "qweight": _pack_along_columns(codes.T.copy(), AWQ_ORDER),  # (in, out / 8)
            base + "qzeros": _pack_along_columns(zeros.T.copy(), AWQ_ORDER),  # (groups, out / 8)
            base + "scales": scale.T.contiguous(),
        }
        q = _unpack_along_columns(stored[base + "qweight"], out_features, AWQ_ORDER).T
        z = _unpack_along_columns(stored[base + "qzeros"], out_features, AWQ_ORDER).T
    real = torch.from_numpy(np.ascontiguousarray(q - z[:, np.arange(in_features) // GROUP])).float()
    return stored, real * _expand(stored[base + "scales"].T.float(), in_features)


def _gptq_qweight(codes: np.ndarray) -> torch.Tensor:
    """GPTQ's qweight (in / 8, out): row r, bits 4i hold input 8r + i of each output column (AutoGPTQ's pack)."""
    intweight = codes.T.astype(np.uint32)  # (in, out)
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for i in range(8):
            qweight[row] |= intweight[8 * row + i] << np.uint32(4 * i)
    return torch.from_numpy(qweight.view(np.int32).copy())


def _quantization_config(layout: str) -> dict:
    """config.json's quantization_config as llm-compressor, AutoGPTQ (through transformers' GPTQConfig) and
    AutoAWQ write it."""
    if layout.startswith("ct"):
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": layout == "ct-sym",
                        "strategy": "group",
                        "group_size": GROUP,
                        "dynamic": False,
                        "actorder": None,
                        "block_structure": None,
                        "observer": "minmax",
                        "observer_kwargs": {},
                    },
                    "input_activations": None,
                    "output_activations": None,
                }
            },
            "ignore": ["lm_head"],
            "quantization_status": "compressed",
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
            "sparsity_config": {},
            "version": "0.9.0",
        }
    if layout == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": GROUP,
            "desc_act": False,
            "sym": False,
            "damp_percent": 0.01,
            "true_sequential": True,
            "static_groups": False,
            "checkpoint_format": "gptq",
            "model_name_or_path": None,
            "model_file_base_name": None,
            "use_exllama": True,
        }
    return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}


def _quantized_copy(model_dir: Path, layout: str) -> tuple[Path, Path]:
    """``model_dir`` with every decoder projection quantized into ``layout``, and the same weights dequantized as
    a float32 checkpoint without quantization_config (embeddings, norms and the LM head stay float32)."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        kind = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if kind not in _PROJECTIONS:
            quantized[name] = dequantized[name] = tensor
            continue
        stored, real = _layout_tensors(name[: -len("weight")], tensor, layout)
        quantized.update(stored)
        dequantized[name] = real
    config = json.loads((model_dir / "config.json").read_text())
    out = {}
    for kind, weights in (("quantized", quantized), ("dequantized", dequantized)):
        path = session_tmp_dir(f"cbrun-{layout}-{kind}-")
        for extra in model_dir.iterdir():
            if extra.name not in ("model.safetensors", "config.json"):
                shutil.copy(extra, path / extra.name)
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        stated = config | {"quantization_config": _quantization_config(layout)} if kind == "quantized" else config
        (path / "config.json").write_text(json.dumps(stated))
        out[kind] = path
    return out["quantized"], out["dequantized"]


def _weight_bytes(engine: LLMEngine) -> int:
    return sum(t.numel() * t.element_size() for t in engine.model.parameters())


@pytest.mark.parametrize(
    "model_type,layout",
    [("llama", "ct-sym"), ("llama", "ct-asym"), ("llama", "gptq"), ("llama", "awq"), ("qwen3", "ct-sym")],
)
def test_int4_greedy_equals_generate_on_the_dequantized_weights(model_type, layout):
    quantized, dequantized = _quantized_copy(random_model_dir(model_type, **MODEL), layout)
    prompts = random_prompts(5, 128, 1, 30)
    engine = LLMEngine.from_pretrained(str(quantized), EngineConfig(**ENGINE_CONFIG))
    projections = [p for layer in engine.model.weights.layers for p in layer.linears()]
    assert len(projections) == 14 and all(isinstance(w, Int4Weight) for w, _ in projections)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    outputs = {o.request_id: o for o in engine.generate((i, p, params) for i, p in enumerate(prompts))}
    for i, prompt in enumerate(prompts):
        assert outputs[i].output_token_ids == hf_greedy(dequantized, prompt, NEW_TOKENS), f"prompt {i}"
    # Resident weights: the projections' packed codes, zeros and scales instead of float32.
    plain = LLMEngine.from_pretrained(str(dequantized), EngineConfig(**ENGINE_CONFIG))
    dense = sum(w.shape.numel() * 4 for w, _ in projections)
    held = sum(w.nbytes for w, _ in projections)
    assert _weight_bytes(plain) - _weight_bytes(engine) == dense - held
    assert held < 0.15 * dense  # 4 bits of 32, plus a float32 scale and a uint8 zero per 128


def test_chunked_int4_gemm_equals_the_reference():
    g = torch.Generator().manual_seed(5)
    out_features, in_features = 4100, 300  # more than one chunk, a ragged last group, in not a multiple of 8
    assert out_features * in_features > DEQUANT_CHUNK_ELEMENTS
    codes = torch.randint(0, 16, (out_features, in_features), generator=g)
    groups = -(-in_features // GROUP)
    zeros = torch.randint(0, 16, (out_features, groups), generator=g).to(torch.uint8)
    scales = torch.rand(out_features, groups, generator=g) + 0.01
    weight = Int4Weight(pack_rows(codes), zeros, scales, in_features, GROUP, torch.float32)
    want = (codes - _expand(zeros.long(), in_features)).float() * _expand(scales, in_features)
    assert torch.equal(weight.dequantize(), want)
    assert torch.equal(weight.dequantize(100, 300), want[100:300])
    x, bias = torch.randn(5, in_features, generator=g), torch.randn(out_features, generator=g)
    assert weight.rows_per_chunk() < out_features
    torch.testing.assert_close(quantized_linear(x, weight, bias), x @ want.T + bias, rtol=1e-5, atol=1e-4)


def _ct_variant(weights: dict | None = None, **group) -> dict:
    """The compressed-tensors int4 config with its one group's ``weights`` and other fields changed."""
    config = _quantization_config("ct-sym")
    ((name, base),) = config["config_groups"].items()
    changed = base | group | {"weights": base["weights"] | (weights or {})}
    return config | {"config_groups": {name: changed}}


#: Variants of these formats cbrun does not run, as config.json states them, and the words their refusal names.
REFUSED = {
    "gptq-desc-act": (_quantization_config("gptq") | {"desc_act": True}, "gptq with desc_act True"),
    "gptq-8-bit": (_quantization_config("gptq") | {"bits": 8}, "gptq with bits 8 (only 4)"),
    "gptq-v2": (_quantization_config("gptq") | {"checkpoint_format": "gptq_v2"}, "checkpoint_format 'gptq_v2'"),
    "gptq-marlin": (_quantization_config("gptq") | {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    "awq-gemv": (_quantization_config("awq") | {"version": "gemv"}, "awq with version 'gemv'"),
    "awq-no-zero": (_quantization_config("awq") | {"zero_point": False}, "awq with zero_point False"),
    "ct-actorder-group": (_ct_variant(weights={"actorder": "group"}), "actorder 'group'"),
    "ct-int8": (_ct_variant(weights={"num_bits": 8}), "only static 4-bit int"),
    "ct-w4a8": (
        _ct_variant(input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
        "only weight-only, W4A16",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_int4_variants_cbrun_does_not_run_are_refused_by_name(case, tmp_path):
    quantization, named = REFUSED[case]
    path = tmp_path / "model"
    shutil.copytree(random_model_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    with pytest.raises(ValueError, match="quantization_config is not implemented by cbrun") as info:
        LLMEngine.from_pretrained(str(path), EngineConfig(**ENGINE_CONFIG))
    assert named in str(info.value)


def test_a_config_stating_int4_over_plain_weights_is_refused(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(random_model_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": _quantization_config("gptq")}))
    with pytest.raises(ValueError, match=r"runs only on cbrun's lean path") as info:
        LLMEngine.from_pretrained(str(path), EngineConfig(**ENGINE_CONFIG))
    assert "config.json states gptq quantization, but no tensor is named *.qweight" in str(info.value)


def test_an_act_order_g_idx_under_desc_act_false_is_refused(tmp_path):
    quantized, _ = _quantized_copy(random_model_dir("llama", **MODEL), "gptq")
    path = tmp_path / "model"
    shutil.copytree(quantized, path)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()  # an act-order permutation the config does not state
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"g_idx is not the contiguous groups of desc_act false"):
        LLMEngine.from_pretrained(str(path), EngineConfig(**ENGINE_CONFIG))


@pytest.mark.parametrize("layout", ["ct-sym", "gptq", "fp8-block"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_quantized_moe_experts_stay_quantized_and_equal_generate_on_the_dequantized_weights(layout, model_type):
    from cbrun.engine.model.layers.quantization.base import QuantizedExperts
    from tests.engine.model import test_quantization as fp8

    shared = dict(shared_expert_intermediate_size=128) if model_type == "qwen2_moe" else {}
    model_dir = random_model_dir(model_type, hidden_size=128, moe_intermediate_size=64, norm_topk_prob=True, **shared)
    writer = fp8._quantized_copy if layout == "fp8-block" else _quantized_copy
    quantized, dequantized = writer(model_dir, layout)
    prompts = random_prompts(5, 128, 1, 30)
    engine = LLMEngine.from_pretrained(str(quantized), EngineConfig(**ENGINE_CONFIG))
    blocks = [layer.moe for layer in engine.model.weights.layers]
    assert all(isinstance(m.gate_up, QuantizedExperts) and isinstance(m.down, QuantizedExperts) for m in blocks)
    assert engine.model_runner.lean_model.layers[0].moe.fallback_reason is None  # the grouped GEMM runs them
    if model_type == "qwen2_moe":  # the shared expert is a dense MLP: its projections quantized as any other
        assert all(isinstance(layer.gate[0], QuantizedLinearWeight) for layer in engine.model.weights.layers)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    outputs = {o.request_id: o for o in engine.generate((i, p, params) for i, p in enumerate(prompts))}
    for i, prompt in enumerate(prompts):
        assert outputs[i].output_token_ids == hf_greedy(dequantized, prompt, NEW_TOKENS), f"prompt {i}"
    plain = LLMEngine.from_pretrained(str(dequantized), EngineConfig(**ENGINE_CONFIG))
    assert _weight_bytes(engine) < 0.6 * _weight_bytes(plain)
