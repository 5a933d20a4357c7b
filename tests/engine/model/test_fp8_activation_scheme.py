"""``engine.fp8_activation_scheme``: W8A8 on an FP8 checkpoint's linears (``torch._scaled_mm``, which PyTorch runs on
the CPU too), opt-in. A random Llama, Qwen2 (q/k/v biases) and Qwen3-MoE quantized here into compressed-tensors'
float8 per channel (``test_quantization._quantized_copy``) give, under "dynamic", at every step the token a
reference picks: transformers' model on the same weights dequantized, in bfloat16, whose quantized linears compute
``fp8_scaled_mm_ref`` (the activations rounded to float8 per row) on the checkpoint's own float8 weights and scales,
the MoE experts left weight-only as cbrun leaves them. The weight-only tokens fail that oracle and still equal
``generate`` on the dequantized weights. Everything "dynamic" cannot run is refused at load by name, exit 2 from the
CLI."""

from __future__ import annotations

import functools
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.model import safetensors_loader
from cbrun.engine.model.layers.quantization import fp8 as fp8_module
from cbrun.engine.model.layers.quantization.base import QuantizedExperts
from cbrun.engine.model.layers.quantization.fp8 import QuantizedWeight, w8a8_checkpoint_refusal, w8a8_linear
from cbrun.engine.model.layers.quantization.schemes import QuantScheme
from cbrun.engine.model.models.llama import LeanLlama
from cbrun.engine.worker.backends import batch_invariant_blocker
from cbrun.jobs.cli import main
from cbrun.jobs.output.writer import committed_parts
from cbrun.kernels.fp8_scaled_mm import FP8_ACTIVATION_SCHEMES, fp8_scaled_mm_ref
from tests.engine.model.test_quantization import MODEL, _quantized_copy, _with_quantization
from tests.jobs.test_resume import run_args
from tests.model_utils import greedy_generate, random_model_dir, random_prompts, run_engine

ENGINE_CONFIG = dict(page_size=4, max_batch_tokens=16, num_blocks=256, dtype="bfloat16")
NEW_TOKENS = 8
#: Qwen3-30B-A3B's layout in small: float8 attention and experts (head_dim 128).
MOE = dict(
    hidden_size=128, moe_intermediate_size=64, norm_topk_prob=True, num_attention_heads=2, num_key_value_heads=2
) | dict(head_dim=128)
SHAPES = {"llama": MODEL, "qwen2": MODEL, "qwen3_moe": MOE}
#: Float8 linears outside the experts: 7 a layer (q, k, v, o, gate, up, down), attention's 4 in a MoE layer; 2 layers.
W8A8_LINEARS = {"llama": 14, "qwen2": 14, "qwen3_moe": 8}
#: How far below the reference's largest logit the chosen token's may lie: 2 bfloat16 steps of that logit. The
#: engine's float32 sums run in another order than the reference's (torch._scaled_mm's, GEMMs over other row
#: counts), so a near-tie may fall either way; a token that is not the reference's lies further below.
ULPS = 2


@functools.lru_cache(maxsize=None)
def _checkpoints(model_type: str) -> tuple[Path, Path]:
    """(float8 per-channel checkpoint, the same weights dequantized as float32) of a random ``model_type``."""
    return _quantized_copy(random_model_dir(model_type, **SHAPES[model_type]), "ct-channel")


def _bf16_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()


def _w8a8_reference(quantized: Path, dequantized: Path) -> torch.nn.Module:
    """transformers' model of the dequantized weights in bfloat16, each linear the checkpoint quantized outside the
    MoE experts computing ``fp8_scaled_mm_ref`` on the checkpoint's own float8 weight and scale; the experts keep
    the dequantized weights (weight-only, as cbrun runs them)."""
    model = _bf16_model(dequantized)
    stored = load_file(str(quantized / "model.safetensors"))
    patched = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name + ".weight_scale" in stored and ".experts." not in name:
            qweight, scale = stored[name + ".weight"], stored[name + ".weight_scale"].float()

            def forward(x, module=module, qweight=qweight, scale=scale):
                out = fp8_scaled_mm_ref(x.reshape(-1, x.shape[-1]), qweight, scale, module.bias)
                return out.reshape(*x.shape[:-1], -1)

            module.forward = forward
            patched += 1
    assert patched > 0
    return model


def _misses(reference: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[int]:
    """The steps at which ``tokens`` (generated after ``prompt``) are not the reference's greedy choice given the
    tokens before them: one forward over prompt + tokens, each chosen logit compared with that step's largest."""
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    top = logits.max(dim=-1).values
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    slack = ULPS * torch.finfo(torch.bfloat16).eps * top.abs()
    return [step for step in range(len(tokens)) if chosen[step] < top[step] - slack[step]]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3_moe"])
def test_dynamic_gives_the_w8a8_references_tokens_and_none_the_dequantized_ones(model_type):
    quantized, dequantized = _checkpoints(model_type)
    prompts = random_prompts(6, 128, 1, 30)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    engine = LLMEngine.from_pretrained(str(quantized), EngineConfig(**ENGINE_CONFIG, fp8_activation_scheme="dynamic"))
    lean = engine.model_runner.lean_model
    assert lean.num_w8a8_linears == W8A8_LINEARS[model_type]
    moe = [layer.moe for layer in lean.layers if layer.moe is not None]
    assert all(isinstance(block.weights.gate_up, QuantizedExperts) for block in moe)  # experts: weight-only
    dynamic = {o.request_id: o.output_token_ids for o in engine.generate((i, p, params) for i, p in enumerate(prompts))}
    none = run_engine(quantized, prompts, EngineConfig(**ENGINE_CONFIG), params)
    reference = _w8a8_reference(quantized, dequantized)
    for i, prompt in enumerate(prompts):
        assert _misses(reference, prompt, dynamic[i]) == [], f"prompt {i}"
    # The oracle tells W8A8 from weight-only: the weight-only tokens are not the reference's ...
    assert any(_misses(reference, prompt, none[i].output_token_ids) for i, prompt in enumerate(prompts))
    # ... and stay those of generate on the dequantized weights.
    plain = _bf16_model(dequantized)
    for i, prompt in enumerate(prompts):
        assert none[i].output_token_ids == greedy_generate(plain, prompt, NEW_TOKENS), f"prompt {i}"


def test_the_settings_vocabulary_is_the_kernels():
    assert EngineConfig.__dataclass_fields__["fp8_activation_scheme"].default == "none"
    from cbrun.engine.config import FP8_ACTIVATION_SCHEMES as SETTING

    assert SETTING == FP8_ACTIVATION_SCHEMES


#: Checkpoints "dynamic" refuses before reading a weight: (quantization_config or None, dtype, the words named).
REFUSED_CHECKPOINTS = {
    "unquantized": (None, "bfloat16", "this checkpoint is not quantized: there is nothing to apply it to"),
    "gptq": (
        {"quant_method": "gptq", "bits": 4, "group_size": 128},
        "bfloat16",
        "this checkpoint holds gptq (gptq) weights",
    ),
    "fp8-block": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        "bfloat16",
        "not the fp8 weight_block_size [128, 128] layout",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED_CHECKPOINTS))
def test_a_checkpoint_without_per_channel_fp8_is_refused_by_name(case, tmp_path, monkeypatch):
    quantization, dtype, named = REFUSED_CHECKPOINTS[case]
    path = random_model_dir("llama")
    if quantization is not None:
        path = _with_quantization(path, tmp_path, quantization)
    monkeypatch.setattr(safetensors_loader, "load", lambda *a, **k: pytest.fail("a weight was read"))
    config = EngineConfig(**ENGINE_CONFIG | {"dtype": dtype}, fp8_activation_scheme="dynamic")
    with pytest.raises(ValueError, match='fp8_activation_scheme = "dynamic" \\(W8A8 with torch._scaled_mm\\)') as info:
        LLMEngine.from_pretrained(str(path), config)
    assert named in str(info.value) and 'set fp8_activation_scheme = "none"' in str(info.value)


def test_float32_and_a_width_off_16_are_refused_by_name():
    quantized, _ = _checkpoints("llama")
    with pytest.raises(ValueError, match="runs bf16 activations only .* and the engine runs float32"):
        LLMEngine.from_pretrained(
            str(quantized), EngineConfig(**ENGINE_CONFIG | {"dtype": "float32"}, fp8_activation_scheme="dynamic")
        )
    odd, _ = _quantized_copy(random_model_dir("llama", **MODEL | {"intermediate_size": 328}), "ct-channel")
    with pytest.raises(ValueError, match=r"a weight is 328 x 256; .*\(linear layers\[0\].gate\)"):
        LLMEngine.from_pretrained(str(odd), EngineConfig(**ENGINE_CONFIG, fp8_activation_scheme="dynamic"))


def test_cuda_below_sm_89_is_refused_and_sm_89_is_not(monkeypatch):
    scheme = QuantScheme("compressed-tensors", "float8", None, "weight_scale")
    cuda = torch.device("cuda")
    monkeypatch.setattr(fp8_module, "cuda_capability", lambda device: 80)
    assert "needs FP8 tensor cores (compute capability >= 8.9), and this runs on sm_80" in str(
        w8a8_checkpoint_refusal(scheme, cuda, torch.bfloat16)
    )
    monkeypatch.setattr(fp8_module, "cuda_capability", lambda device: 89)
    assert w8a8_checkpoint_refusal(scheme, cuda, torch.bfloat16) is None
    assert "runs on CUDA or the CPU, not mps" in str(
        w8a8_checkpoint_refusal(scheme, torch.device("mps"), torch.bfloat16)
    )


def test_a_model_whose_only_float8_weights_are_experts_is_refused():
    quantized, _ = _checkpoints("qwen3_moe")
    plan, reason = safetensors_loader.load_plan(quantized, "bfloat16")
    assert plan is not None, reason
    weights = safetensors_loader.load(plan, "cpu").weights
    for layer in weights.layers:  # the attention dequantized: float8 remains in the experts only
        for part in ("q", "k", "v", "o"):
            weight, bias = getattr(layer, part)
            assert isinstance(weight, QuantizedWeight)
            setattr(layer, part, (weight.dequantize(), bias))
    assert LeanLlama(weights, fp8_activation_scheme="none").num_w8a8_linears == 0
    with pytest.raises(ValueError, match="this model has none outside its MoE experts"):
        LeanLlama(weights, fp8_activation_scheme="dynamic")


def test_settings_it_does_not_run_with_are_refused_by_name():
    with pytest.raises(ValueError, match="fp8_activation_scheme must be one of \\('none', 'dynamic'\\), got 'static'"):
        EngineConfig(fp8_activation_scheme="static")
    with pytest.raises(ValueError, match='fp8_activation_scheme = "dynamic" does not run with batch_invariant = on'):
        EngineConfig(fp8_activation_scheme="dynamic", batch_invariant="on")
    with pytest.raises(ValueError, match="tensor_parallel_size = 2 does not run with fp8_activation_scheme"):
        EngineConfig(fp8_activation_scheme="dynamic", tensor_parallel_size=2)
    # a sampled job's "auto" resolves batch invariance off, saying why, rather than refusing
    config = EngineConfig(fp8_activation_scheme="dynamic")
    assert "fp8_activation_scheme = dynamic" in str(batch_invariant_blocker(config, True, False))


def test_w8a8_runs_every_float8_projection_through_scaled_mm(monkeypatch):
    """The projection function is ``w8a8_linear``, which reaches ``torch._scaled_mm`` (counted) once per linear."""
    quantized, _ = _checkpoints("llama")
    engine = LLMEngine.from_pretrained(str(quantized), EngineConfig(**ENGINE_CONFIG, fp8_activation_scheme="dynamic"))
    layer = engine.model_runner.lean_model.layers[0]
    assert all(p[2] is w8a8_linear for p in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down))
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    list(engine.generate([(0, [5, 6, 7], SamplingParams(max_new_tokens=1))]))
    assert len(calls) == W8A8_LINEARS["llama"]


def test_a_job_asking_dynamic_of_an_unquantized_model_exits_2_before_any_row(tiny_model_dir, tmp_path, capsys):
    rows = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["r0", "r1"], "prompt": ["row 0 says", "row 1 says"]}), rows)
    out = tmp_path / "out"
    args = run_args(tiny_model_dir, rows, out)
    args += ["--set", "engine.fp8_activation_scheme=dynamic", "--set", "engine.dtype=bfloat16"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert 'engine.fp8_activation_scheme = "dynamic" (W8A8 with torch._scaled_mm) quantizes the activations' in err
    assert "this checkpoint is not quantized" in err
    assert not out.exists() or not committed_parts(out)
