"""``benchmarks.tensor_parallel``'s FP8 copy: every projection float8 with 128 x 128 block scales that load as the
``fp8`` layout, within float8's rounding of the float32 weights, everything else unchanged; the table gives rank 0's
weight bytes."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from benchmarks.tensor_parallel import PROJECTIONS, _table, quantize_fp8
from cbrun.engine import EngineConfig, LLMEngine
from cbrun.engine.model.layers.quantization.fp8 import QuantizedWeight
from tests.model_utils import random_model_dir, session_tmp_dir


def test_the_fp8_copy_loads_as_block_quantized_weights_near_the_originals():
    model_dir = random_model_dir("llama", hidden_size=256, intermediate_size=512, num_attention_heads=2)
    copy = quantize_fp8(model_dir, session_tmp_dir("cbrun-tp-bench-fp8-") / "model")
    original, stored = load_file(str(model_dir / "model.safetensors")), load_file(str(copy / "model.safetensors"))
    engine = LLMEngine.from_pretrained(str(copy), EngineConfig(dtype="float32", num_blocks=16))
    for i, layer in enumerate(engine.model.weights.layers):
        for (weight, _), name in zip(layer.linears(), PROJECTIONS):
            assert isinstance(weight, QuantizedWeight) and weight.block == (128, 128)
            module = "self_attn" if name in PROJECTIONS[:4] else "mlp"
            want = original[f"model.layers.{i}.{module}.{name}.weight"]
            # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself, plus the block's smallest step
            error = (weight.dequantize() - want).abs()
            assert bool((error <= want.abs() / 16 + want.abs().max() / 448 * 2**-9).all()), name
    assert torch.equal(stored["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    engine.close()


def test_the_table_gives_rank_0s_weight_bytes():
    runs = [
        dict(
            tp=tp,
            threads=threads,
            decode_ms=10.0,
            prefill_ms=20.0,
            decode_comm_ms=0.0,
            prefill_comm_ms=0.0,
            outputs="same",
            weight_mib=mib,
        )  # fmt: skip
        for (tp, threads), mib in (((1, 1), 100.0), ((1, 2), 100.0), ((2, 1), 51.5))
    ]
    assert _table(runs).splitlines()[-1] == "| 2 x 1 | 10.0 | 0.0 | 20.0 | 0.0 | 1.00x | 1.00x | True | 51.5 |"
