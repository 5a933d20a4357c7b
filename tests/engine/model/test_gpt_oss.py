"""gpt-oss on the lean path (``cbrun.engine.model.models.gpt_oss``): greedy tokens equal transformers' ``generate``
on a random gpt-oss (sinks, alternating sliding (window 4) and full layers, YaRN, the biased top-k-then-softmax
router, the clamped SwiGLU experts), loaded without transformers and from transformers' modules, for prompts longer
than the window; and its MXFP4 checkpoint, kept quantized, equals ``generate`` on the same weights dequantized by
transformers itself (``Mxfp4Config(dequantize=True)``)."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.model.config import read_config_json
from cbrun.engine.model.layers import moe as moe_layer
from cbrun.engine.model.layers.activation import ClampedSwiGLU
from cbrun.engine.model.layers.moe import (
    MoEWeights,
    SparseMoE,
    sparse_moe,
    sparse_moe_in_expert_chunks,
    sparse_moe_reference,
)
from cbrun.engine.model.layers.quantization.mxfp4 import Mxfp4Experts, dequantize_mxfp4, quantize_mxfp4
from cbrun.engine.model.layers.rotary_embedding import RopeParameters, read_rope_parameters, rope_inv_freq
from cbrun.engine.model.models.gpt_oss import DEFAULT_ROPE
from cbrun.engine.model.registry import parse_config
from tests.model_utils import TINY_DECODER, greedy_generate, random_prompts, run_engine, save_spread_weights

VOCAB = 128
NEW_TOKENS = 8
WINDOW = 4
#: lengths 1 to 21: most prompts are longer than the window, and decoding passes it in all
PROMPTS = [random_prompts(1, VOCAB, n, n, seed=n)[0] for n in (1, 5, 9, 14, 21)]
ENGINE = dict(page_size=4, max_batch_tokens=16, num_blocks=128)
CONFIG = dict(
    TINY_DECODER,
    vocab_size=VOCAB,
    intermediate_size=64,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
)
MXFP4 = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def _generate(model) -> list[list[int]]:
    return [greedy_generate(model.eval(), prompt, NEW_TOKENS) for prompt in PROMPTS]


def _eager(path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kwargs)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(model dir, transformers' greedy tokens, the tokens without sinks, the tokens without the window)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG)).eval()
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    assert model.config.rope_parameters["rope_type"] == "yarn"
    model_dir = save_spread_weights(model, tmp_path_factory.mktemp("gpt_oss"))
    expected = _generate(_eager(model_dir))
    no_sinks = _eager(model_dir)
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
    no_window = _eager(model_dir, sliding_window=4096)
    return model_dir, expected, _generate(no_sinks), _generate(no_window)


def test_the_controls_differ(gpt_oss):
    """Sinks and the window each change greedy tokens: a forward pass that ignored either would fail below."""
    _, expected, without_sinks, without_window = gpt_oss
    assert without_sinks != expected
    assert without_window != expected


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
@pytest.mark.parametrize("loader", ["auto", "transformers"])
def test_lean_greedy_equals_generate(gpt_oss, loader, attention_backend, caplog):
    """The safetensors loader (no transformers) and transformers' own modules, on the C kernel (auto: float32 on
    the CPU) and the PyTorch reference attention."""
    model_dir, expected, _, _ = gpt_oss
    config = EngineConfig(**ENGINE, loader=loader, model_impl="lean", attention_backend=attention_backend)
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        outputs = run_engine(model_dir, PROMPTS, config, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert "model implementation: lean (GptOssForCausalLM)" in caplog.text
    assert "MoE layers: 2, experts on grouped GEMM" in caplog.text
    if loader == "auto":
        assert "model loader: safetensors, without transformers" in caplog.text
    for i, want in enumerate(expected):
        assert outputs[i].error is None, outputs[i].error
        assert outputs[i].output_token_ids == want, f"prompt {i}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_lean_logits_equal_transformers_every_step(gpt_oss, dtype):
    """The lean pass over the safetensors-loaded tensors and over transformers' modules gives transformers'
    forward's logits bit for bit, every step (cbrun's attention under both), in float32, bfloat16 and float16
    (where transformers keeps the norms float32: ``keep_in_float32``)."""
    from tests.engine.model.test_safetensors_loader import _check_every_step

    assert _check_every_step(gpt_oss[0], dtype) > 10


def test_config_and_its_defaults_equal_auto_config(gpt_oss, tmp_path):
    from tests.engine.model.test_safetensors_loader import _edited_copy

    defaults = dict(rope_parameters=None, layer_types=None, sliding_window=None, head_dim=None, attention_bias=None)
    for path in (gpt_oss[0], _edited_copy(gpt_oss[0], tmp_path / "defaults", **defaults)):
        config, reason = parse_config(read_config_json(path))
        assert reason is None, reason
        auto = transformers.AutoConfig.from_pretrained(path)
        assert config.layer_types == tuple(auto.layer_types) and config.sliding_window == auto.sliding_window
        assert (config.head_dim, config.qkv_bias) == (auto.head_dim, auto.attention_bias)
        assert config.rope_theta == auto.rope_parameters["rope_theta"] and config.rope_type == "yarn"
        assert config.moe.num_experts == auto.num_local_experts and config.moe.top_k == auto.num_experts_per_tok
        assert config.moe.activation == ClampedSwiGLU(auto.swiglu_alpha, auto.swiglu_limit)
    assert config.sliding_window == 128 and config.rope_theta == 150000.0
    bad = _edited_copy(gpt_oss[0], tmp_path / "bad", layer_types=["sliding_attention", "chunked_attention"])
    assert "layer_types" in parse_config(read_config_json(bad))[1]


@pytest.mark.parametrize("model_impl", ["lean", "transformers"])
def test_greedy_equals_generate_on_the_triton_kernels(gpt_oss, model_impl):
    """The Triton attention (interpreted on the CPU: sinks and the sliding layers' ring block tables, whose rows
    must be contiguous) on both paths."""
    pytest.importorskip("triton")
    model_dir, expected, _, _ = gpt_oss
    loader = "auto" if model_impl == "lean" else "transformers"
    config = EngineConfig(**ENGINE, loader=loader, model_impl=model_impl, attention_backend="triton")
    prompts = PROMPTS[2:4]
    outputs = run_engine(model_dir, prompts, config, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [outputs[i].output_token_ids for i in range(len(prompts))] == expected[2:4]


def test_openai_config_keys_parse():
    """config.json as openai/gpt-oss-20b ships it (its keys and values, the shapes shrunk) is read, MXFP4 included."""
    raw = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 256,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 8,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_local_experts": 32,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": MXFP4,
        "rms_norm_eps": 1e-05,
        "rope_scaling": DEFAULT_ROPE,
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": 201088,
        "torch_dtype": "bfloat16",
    }
    config, reason = parse_config(raw)
    assert reason is None, reason
    assert config.quantization.method == "mxfp4" and config.sliding_window == 128 and config.moe.num_experts == 32


def _random_gpt_oss_moe(tokens: int, dtype: torch.dtype) -> tuple[MoEWeights, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, width = 8, 64, 32

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    moe = MoEWeights(
        router=randn(experts, hidden),
        gate_up=randn(experts, hidden, 2 * width, scale=0.5).transpose(1, 2),  # stored (E, in, out) as gpt-oss
        down=randn(experts, width, hidden, scale=0.3).transpose(1, 2),
        top_k=3,
        norm_topk_prob=False,
        weights_in_model_dtype=True,
        router_bias=randn(experts),
        softmax_after_topk=True,
        gate_up_bias=randn(experts, 2 * width),
        down_bias=randn(experts, hidden),
        activation=ClampedSwiGLU(1.702, 7.0),
    )
    return moe, randn(tokens, hidden)


@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_moe_grouped_path_equals_reference_and_transformers(tokens, dtype):
    """The grouped path equals the reference, and transformers' ``GptOssMLP`` on the same tensors (bit for bit in
    float32); the clamp is reached."""
    moe, x = _random_gpt_oss_moe(tokens, dtype)
    got = sparse_moe(x, moe)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, sparse_moe_reference(x, moe), rtol=tol, atol=tol)
    config = transformers.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=3)
    config._experts_implementation = "grouped_mm"  # what a loaded model runs on the CPU
    mlp = transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(config).to(dtype)
    with torch.no_grad():
        mlp.router.weight.copy_(moe.router)
        mlp.router.bias.copy_(moe.router_bias)
        mlp.experts.gate_up_proj.copy_(moe.gate_up.transpose(1, 2))
        mlp.experts.gate_up_proj_bias.copy_(moe.gate_up_bias)
        mlp.experts.down_proj.copy_(moe.down.transpose(1, 2))
        mlp.experts.down_proj_bias.copy_(moe.down_bias)
        want, _ = mlp(x[None])
    if dtype == torch.float32:
        assert torch.equal(got, want[0])
    else:
        torch.testing.assert_close(got, want[0], rtol=tol, atol=tol)
    gate_up = torch.einsum("th,eoh->eto", x.float(), moe.gate_up.float()) + moe.gate_up_bias.float()[:, None]
    assert gate_up.max() > 7.0  # the clamp matters


def test_gpt_oss_moe_reads_nothing_back_quantized_or_not():
    """No host read-back in the gpt-oss MoE forward (biases gathered by device expert ids), MXFP4 experts'
    per-forward dequantization included: a decode step stays capturable."""
    from tests.engine.model.test_moe import _HostReads

    moe, x = _random_gpt_oss_moe(3, torch.float32)
    quantized = replace(
        moe,
        gate_up=Mxfp4Experts(*quantize_mxfp4(moe.gate_up), torch.float32),
        down=Mxfp4Experts(*quantize_mxfp4(moe.down), torch.float32),
    )
    block = SparseMoE(quantized)
    block.experts_per_chunk = 3
    assert block.fallback_reason is None
    with _HostReads() as reads:
        sparse_moe(x, moe)
        got = block(x)
    assert reads.ops == []
    torch.testing.assert_close(got, sparse_moe_reference(x, quantized.dense()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("experts_per_chunk", [1, 3, 8])
@pytest.mark.parametrize("tokens", [1, 6, 40])
def test_quantized_experts_in_chunks_equal_all_at_once(experts_per_chunk, tokens):
    """Dequantizing the experts a chunk at a time gives the bits of the whole layer's at once."""
    moe, x = _random_gpt_oss_moe(tokens, torch.float32)
    quantized = replace(
        moe,
        gate_up=Mxfp4Experts(*quantize_mxfp4(moe.gate_up), torch.float32),
        down=Mxfp4Experts(*quantize_mxfp4(moe.down), torch.float32),
    )
    want = sparse_moe(x, quantized.dense())
    assert torch.equal(sparse_moe_in_expert_chunks(x, quantized, experts_per_chunk), want)


def test_yarn_inverse_frequencies_equal_transformers():
    for truncate in (True, False):
        params = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64, truncate=truncate)
        raw = dict(CONFIG, rope_parameters=params)
        rope, reason = read_rope_parameters(raw, default_theta=150000.0)  # GptOssConfig.default_theta
        assert reason is None and isinstance(rope, RopeParameters)
        inv_freq, scaling = rope_inv_freq(rope, 16, "cpu")
        module = transformers.GptOssForCausalLM(transformers.GptOssConfig(**raw)).model.rotary_emb
        assert torch.equal(inv_freq, module.inv_freq) and scaling == module.attention_scaling
    assert read_rope_parameters(dict(CONFIG, rope_parameters=dict(rope_type="yarn", low_freq_factor=1)))[0] is None


def test_yarn_on_a_llama_family_runs_lean_and_equals_generate(tmp_path, caplog):
    """YaRN is a ``ROPE_INIT`` entry: the other lean families read it too (here Llama, with mscale and
    ``truncate`` unset), logits bit for bit equal to transformers' forward every step."""
    from tests.engine.model.test_safetensors_loader import _check_every_step

    torch.manual_seed(0)
    rope = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=10000.0)
    llama = dict(CONFIG, intermediate_size=96, rope_parameters=rope)
    for key in ("num_local_experts", "num_experts_per_tok", "sliding_window"):
        del llama[key]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama)).eval()
    model_dir = save_spread_weights(model, tmp_path)
    assert parse_config(read_config_json(model_dir))[0].rope_type == "yarn"
    assert _check_every_step(model_dir) > 10
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        outputs = run_engine(model_dir, PROMPTS, EngineConfig(**ENGINE), SamplingParams(max_new_tokens=NEW_TOKENS))
    assert "model implementation: lean (LlamaForCausalLM)" in caplog.text
    expected = _generate(_eager(model_dir))
    assert [outputs[i].output_token_ids for i in range(len(PROMPTS))] == expected


def test_mxfp4_dequantization_round_trips_and_keeps_nibble_order():
    weight = torch.tensor([[0.5, -1.0, 6.0, 3.0] * 8])  # one block: max 6 -> scale 2^0
    blocks, scales = quantize_mxfp4(weight)
    assert scales.tolist() == [[127]]
    assert blocks[0, 0, 0].item() == 0x1 | (0xA << 4)  # 0.5 in the low nibble, -1.0 (code 10) in the high
    assert torch.equal(dequantize_mxfp4(blocks, scales), weight)
    experts = Mxfp4Experts(blocks[None].expand(2, -1, -1, -1), scales[None].expand(2, -1, -1), torch.bfloat16)
    assert experts.shape == (2, 1, 32) and torch.equal(experts.dequantize().float(), weight.expand(2, -1, -1))


def _mxfp4_copy(model_dir, path) -> None:
    """``model_dir`` as an MXFP4 checkpoint in the real layout: each expert projection's (E, in, out) weight
    transposed to (E, out, in) and stored as ``_blocks`` / ``_scales``."""
    shutil.copytree(model_dir, path)
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": MXFP4}))


def mxfp4_pair(model_dir, base) -> tuple:
    """(an MXFP4 copy of the gpt-oss ``model_dir``, an unquantized copy of the same weights dequantized), under
    ``base`` (for benchmarks: the dequantized twin is what transformers' ``Mxfp4Config(dequantize=True)`` holds)."""
    quantized, dequantized = base / "mxfp4", base / "mxfp4-dequantized"
    if not (quantized / "config.json").is_file():
        _mxfp4_copy(model_dir, quantized)
    if not (dequantized / "config.json").is_file():
        shutil.copytree(model_dir, dequantized)
        tensors = load_file(str(quantized / "model.safetensors"))
        for name in [n[: -len("_blocks")] for n in tensors if n.endswith("_blocks")]:
            real = dequantize_mxfp4(tensors.pop(name + "_blocks"), tensors.pop(name + "_scales"))
            tensors[name] = real.transpose(1, 2).contiguous()  # transformers' (E, in, out)
        save_file(tensors, str(dequantized / "model.safetensors"), metadata={"format": "pt"})
    return quantized, dequantized


@pytest.fixture(scope="module")
def mxfp4(gpt_oss, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4") / "model"
    _mxfp4_copy(gpt_oss[0], path)
    return path


def test_mxfp4_experts_stay_quantized_and_equal_generate_on_the_dequantized_weights(mxfp4, gpt_oss, monkeypatch):
    dequantized = _eager(mxfp4, quantization_config=transformers.Mxfp4Config(dequantize=True))
    expected = _generate(dequantized)
    assert expected != gpt_oss[1]  # the quantization changed the model: the oracle is its own
    monkeypatch.setattr(moe_layer, "EXPERT_CHUNK_ELEMENTS", 1)  # one expert dequantized at a time
    engine = LLMEngine.from_pretrained(str(mxfp4), EngineConfig(**ENGINE))
    moe = [layer.moe for layer in engine.model.weights.layers]
    assert all(isinstance(m.gate_up, Mxfp4Experts) and isinstance(m.down, Mxfp4Experts) for m in moe)
    block = engine.model_runner.lean_model.layers[0].moe
    assert block.fallback_reason is None and block.experts_per_chunk == 1  # the grouped GEMM, a chunk at a time
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = {o.request_id: o for o in engine.generate((i, p, params) for i, p in enumerate(PROMPTS))}
    for i, want in enumerate(expected):
        assert outputs[i].output_token_ids == want, f"prompt {i}"


def test_mxfp4_variants_are_refused_by_name(mxfp4, tmp_path):
    with pytest.raises(ValueError, match=r"quantization_config \(mxfp4\) runs only on cbrun's lean path"):
        LLMEngine.from_pretrained(str(mxfp4), EngineConfig(**ENGINE, loader="transformers"))
    odd = tmp_path / "odd"
    shutil.copytree(mxfp4, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps(config | {"quantization_config": MXFP4 | {"swizzle": True}}))
    with pytest.raises(ValueError, match="quantization_config is not implemented by cbrun: mxfp4 with swizzle"):
        LLMEngine.from_pretrained(str(odd), EngineConfig(**ENGINE))
    with pytest.raises(ValueError, match="tensor_parallel_size = 2 cannot split this model: gpt-oss.s stacked experts"):
        LLMEngine.from_pretrained(str(mxfp4), EngineConfig(**ENGINE, tensor_parallel_size=2))
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (odd / "config.json").write_text(json.dumps(config | {"quantization_config": fp8}))
    with pytest.raises(ValueError, match=r"not implemented by cbrun: fp8 \(float8\) on gpt-oss"):
        LLMEngine.from_pretrained(str(odd), EngineConfig(**ENGINE))
    (odd / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(odd / "model.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name].to(torch.int32)  # scales in another dtype than the layout's
    save_file(tensors, str(odd / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=f"tensor {name} is torch.int32, but MXFP4 stores uint8"):
        LLMEngine.from_pretrained(str(odd), EngineConfig(**ENGINE))


@pytest.mark.parametrize("quantized", [False, True])
def test_a_lean_decode_step_reads_nothing_back(gpt_oss, mxfp4, quantized, monkeypatch):
    """One decode step's whole lean forward (attention with sinks and windows, the MoE, MXFP4 experts a chunk at a
    time) makes no host read-back (``benchmarks.moe_lean``'s count)."""
    from benchmarks.moe_lean import HostReads

    monkeypatch.setattr(moe_layer, "EXPERT_CHUNK_ELEMENTS", 1)
    engine = LLMEngine.from_pretrained(str(mxfp4 if quantized else gpt_oss[0]), EngineConfig(**ENGINE))
    runner, counted = engine.model_runner, []
    forward = runner._forward

    def counting_forward(input_ids, positions, md, logits_indices):
        if md.max_seqlen_q != 1:
            return forward(input_ids, positions, md, logits_indices)
        with HostReads() as reads:
            out = forward(input_ids, positions, md, logits_indices)
        counted.append(sum(reads.ops.values()))
        return out

    runner._forward = counting_forward
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    list(engine.generate((i, p, params) for i, p in enumerate(PROMPTS)))
    assert counted and counted == [0] * len(counted)
    with HostReads() as reads:  # the count itself can fail: a read-back is counted
        torch.ones(2).sum().item()
    assert sum(reads.ops.values()) == 1


def test_batch_invariance_is_refused_by_name_and_auto_turns_it_off(gpt_oss):
    from cbrun.engine.worker.backends import batch_invariant_blocker_before_load

    reason = batch_invariant_blocker_before_load(EngineConfig(**ENGINE), str(gpt_oss[0]), "float32")
    assert reason is not None and "gpt-oss's MoE block" in reason
    with pytest.raises(ValueError, match="batch_invariant = on does not run this MoE block"):
        LLMEngine.from_pretrained(str(gpt_oss[0]), EngineConfig(**ENGINE, batch_invariant="on"))
