"""Quantized checkpoints (``cbrun.engine.model.layers.quantization``): a random Llama quantized here into the real FP8
layouts (``fp8`` with 128x128 ``weight_scale_inv`` blocks, as Qwen3-FP8 and DeepSeek-V3 ship; compressed-tensors'
float8 per channel), kept float8 in memory, gives the greedy tokens transformers' ``generate`` gives on the same
weights dequantized (a float32 checkpoint written from them), with fewer resident weight bytes; the chunked GEMM
equals its reference; every layout cbrun does not implement is refused by name, exit 2 from the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.model.layers.quantization.base import DEQUANT_CHUNK_ELEMENTS, quantized_linear
from cbrun.engine.model.layers.quantization.fp8 import QuantizedWeight, dequantize
from cbrun.jobs.cli import main
from cbrun.jobs.output.writer import committed_parts
from tests.jobs.test_resume import run_args
from tests.model_utils import hf_greedy, random_model_dir, random_prompts, run_engine, session_tmp_dir

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
ENGINE_CONFIG = dict(page_size=4, max_batch_tokens=16, num_blocks=256, dtype="float32")
NEW_TOKENS = 8
#: Ragged blocks on purpose: 320 = 2.5 blocks of 128, 64 = half a block.
MODEL = dict(hidden_size=256, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2)
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _block_scales(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(ceil(out / bo), ceil(in / bi)) float32 scales, each block's max |w| over the float8 range."""
    bo, bi = block
    out_features, in_features = weight.shape
    padded = torch.zeros(-(-out_features // bo) * bo, -(-in_features // bi) * bi)
    padded[:out_features, :in_features] = weight.abs()
    amax = padded.view(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi).amax(dim=(1, 3))
    return (amax / FP8_MAX).clamp(min=1e-12)


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Each block's scale at every element of its block (an indexing of its own, independent of ``dequantize``)."""
    rows = torch.arange(shape[0]) // block[0]
    cols = torch.arange(shape[1]) // block[1]
    return scale[rows[:, None], cols[None, :]]


def _quantized_copy(model_dir: Path, layout: str) -> tuple[Path, Path]:
    """``model_dir`` quantized into ``layout`` ("fp8-block" or "ct-channel"), and the same weights dequantized as
    a float32 checkpoint with no quantization_config; the projections are quantized, embeddings, norms and the LM
    head stay float32 (as in the real checkpoints)."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        kind = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if kind not in _PROJECTIONS:
            quantized[name] = dequantized[name] = tensor
            continue
        block = (128, 128) if layout == "fp8-block" else (1, tensor.shape[1])
        scale = _block_scales(tensor, block)
        if layout == "ct-channel":
            scale = scale.to(torch.bfloat16).float()  # the checkpoints store bfloat16 channel scales
        q = (tensor / _expand(scale, block, tensor.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        quantized[name] = q
        base = name[: -len(".weight")]
        if layout == "fp8-block":
            quantized[base + ".weight_scale_inv"] = scale
        else:
            quantized[base + ".weight_scale"] = scale.to(torch.bfloat16)
        dequantized[name] = q.float() * _expand(scale, block, tensor.shape)
    config = json.loads((model_dir / "config.json").read_text())
    if layout == "fp8-block":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    else:
        config["quantization_config"] = _ct_config("float-quantized", {"strategy": "channel"})
    out = {}
    for kind, weights in (("quantized", quantized), ("dequantized", dequantized)):
        path = session_tmp_dir(f"cbrun-{layout}-{kind}-")
        for extra in model_dir.iterdir():
            if extra.name not in ("model.safetensors", "config.json"):
                shutil.copy(extra, path / extra.name)
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        stated = (
            dict(config) if kind == "quantized" else {k: v for k, v in config.items() if k != "quantization_config"}
        )
        (path / "config.json").write_text(json.dumps(stated))
        out[kind] = path
    return out["quantized"], out["dequantized"]


def _ct_config(fmt: str, weights: dict) -> dict:
    """A compressed-tensors quantization_config of one group over every Linear but the LM head (the shape of
    Red Hat's FP8-dynamic checkpoints)."""
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None}
                | weights,
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
    }


def _weight_bytes(engine: LLMEngine) -> int:
    return sum(t.numel() * t.element_size() for t in engine.model.parameters())


@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel"])
def test_quantized_greedy_equals_generate_on_the_dequantized_weights(layout):
    quantized, dequantized = _quantized_copy(random_model_dir("llama", **MODEL), layout)
    prompts = random_prompts(6, 128, 1, 30)
    engine = LLMEngine.from_pretrained(str(quantized), EngineConfig(**ENGINE_CONFIG))
    projections = [p for layer in engine.model.weights.layers for p in layer.linears()]
    assert len(projections) == 14 and all(isinstance(w, QuantizedWeight) for w, _ in projections)
    assert all(w.qweight.dtype == FP8 for w, _ in projections)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    outputs = {o.request_id: o for o in engine.generate((i, p, params) for i, p in enumerate(prompts))}
    for i, prompt in enumerate(prompts):
        assert outputs[i].output_token_ids == hf_greedy(dequantized, prompt, NEW_TOKENS), f"prompt {i}"
    # Resident weights: the projections' float8 values and scales instead of float32, everything else the same.
    plain = LLMEngine.from_pretrained(str(dequantized), EngineConfig(**ENGINE_CONFIG))
    dense = sum(w.qweight.numel() * 4 for w, _ in projections)
    held = sum(w.nbytes for w, _ in projections)
    assert _weight_bytes(plain) - _weight_bytes(engine) == dense - held
    assert held < 0.27 * dense


def test_chunked_gemm_equals_the_reference_and_one_chunk_is_exact():
    g = torch.Generator().manual_seed(3)
    out_features, in_features = 1100, 1000  # ragged blocks, more than one chunk
    assert out_features * in_features > DEQUANT_CHUNK_ELEMENTS
    values = (torch.randn(out_features, in_features, generator=g) * 40).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    scale = torch.rand(-(-out_features // 128), -(-in_features // 128), generator=g) + 0.5
    weight = QuantizedWeight(values, scale, (128, 128), torch.float32)
    want_weight = values.float() * _expand(scale, (128, 128), values.shape)
    assert torch.equal(dequantize(weight), want_weight)
    x, bias = torch.randn(5, in_features, generator=g), torch.randn(out_features, generator=g)
    assert weight.rows_per_chunk() < out_features and weight.rows_per_chunk() % 128 == 0
    torch.testing.assert_close(quantized_linear(x, weight, bias), x @ want_weight.T + bias, rtol=1e-5, atol=1e-3)
    small = QuantizedWeight(values[:200, :300], scale[:2, :3], (128, 128), torch.float32)
    assert torch.equal(
        quantized_linear(x[:, :300], small, None), torch.nn.functional.linear(x[:, :300], dequantize(small))
    )


#: Layouts cbrun does not run, as config.json states them, and the words their refusal names.
REFUSED = {
    "gptq-3-bit": ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with bits 3 (only 4)"),
    "awq-gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    "mxfp4-on-llama": (
        {"quant_method": "mxfp4"},
        "mxfp4 is implemented for gpt-oss's MoE experts only, not LlamaForCausalLM",
    ),
    "mxfp4-unknown-key": ({"quant_method": "mxfp4", "group_size": 64}, "mxfp4 with group_size"),
    "bitsandbytes": ({"quant_method": "bitsandbytes_4bit"}, "quant_method 'bitsandbytes_4bit'"),
    "fp8-static": (
        {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
        "activation_scheme 'static'",
    ),
    "fp8-per-tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size None"),
    "ct-int8-pack": (
        _ct_config("pack-quantized", {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 128}),
        "compressed-tensors pack-quantized weights",
    ),
    "ct-marlin": (_ct_config("marlin-24", {}), "compressed-tensors format 'marlin-24'"),
    "ct-fp8-group": (
        _ct_config("float-quantized", {"strategy": "group", "group_size": 128}),
        "weight strategy 'group'",
    ),
}


def _with_quantization(model_dir: Path, tmp_path: Path, quantization: dict) -> Path:
    path = tmp_path / "model"
    shutil.copytree(model_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    return path


@pytest.mark.parametrize("loader", ["auto", "transformers"])
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_layouts_cbrun_does_not_run_are_refused_by_name(case, loader, tmp_path):
    quantization, named = REFUSED[case]
    path = _with_quantization(random_model_dir("llama"), tmp_path, quantization)
    with pytest.raises(ValueError, match="quantization_config is not implemented by cbrun") as info:
        LLMEngine.from_pretrained(str(path), EngineConfig(**ENGINE_CONFIG, loader=loader))
    assert named in str(info.value)


def test_an_implemented_layout_on_transformers_is_refused_by_name():
    quantized, _ = _quantized_copy(random_model_dir("llama", **MODEL), "fp8-block")
    with pytest.raises(ValueError, match=r"quantization_config \(fp8\) runs only on cbrun's lean path") as info:
        LLMEngine.from_pretrained(str(quantized), EngineConfig(**ENGINE_CONFIG, loader="transformers"))
    assert "engine.loader = transformers" in str(info.value)
    with pytest.raises(ValueError, match="batch_invariant = on does not run quantized weights"):
        run_engine(quantized, [[1]], EngineConfig(**ENGINE_CONFIG, batch_invariant="on"), SamplingParams())


def test_a_job_on_a_refused_layout_exits_2_before_any_row(tiny_model_dir, tmp_path, capsys):
    model = _with_quantization(tiny_model_dir, tmp_path, {"quant_method": "gptq", "bits": 4, "desc_act": True})
    rows = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["r0", "r1"], "prompt": ["row 0 says", "row 1 says"]}), rows)
    out = tmp_path / "out"
    assert main(run_args(model, rows, out)) == 2
    err = capsys.readouterr().err
    assert "quantization_config is not implemented by cbrun: gptq with desc_act True" in err
    assert not out.exists() or not committed_parts(out)
