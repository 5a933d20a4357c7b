"""The fp8 KV cache (``engine.kv_cache_dtype = "fp8_e4m3"``): K/V stored as float8_e4m3fn with a per-tensor scale,
dequantized as attention reads them. fp8 is lossy, so the oracle is transformers' ``generate`` with an attention
that reads the same float8-rounded K/V (``quantize_kv`` then ``dequantize_kv`` on every key and value, which is
what a cache of rounded values holds): greedy tokens equal it, token for token, on the lean path and through
transformers' modules; the cache holds one byte per value; what cannot read it is refused by name."""

from __future__ import annotations

import functools

import pytest
import torch

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.worker.kv_cache import KVCache
from cbrun.kernels.reference import KV_FP8_DTYPE, dequantize_kv, quantize_kv
from tests.model_utils import _hf_model, greedy_generate, random_model_dir, random_prompts

ENGINE_CONFIG = dict(page_size=4, max_batch_tokens=16, num_blocks=128, dtype="float32")
NEW_TOKENS = 8
FP8_ATTENTION = "fp8_kv_sdpa"


@functools.lru_cache(maxsize=None)
def _fp8_reference(model_dir):
    """transformers' model over SDPA whose keys and values are first rounded as the fp8 cache stores them."""
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def attention(module, query, key, value, attention_mask, **kwargs):
        key, value = dequantize_kv(quantize_kv(key), key.dtype), dequantize_kv(quantize_kv(value), value.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(FP8_ATTENTION, attention)
    AttentionMaskInterface.register(FP8_ATTENTION, sdpa_mask)
    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=FP8_ATTENTION).eval()


def _generate(model_dir, prompts, **config) -> tuple[LLMEngine, dict]:
    engine = LLMEngine.from_pretrained(str(model_dir), EngineConfig(**ENGINE_CONFIG, **config))
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    return engine, {
        o.request_id: o.output_token_ids for o in engine.generate((i, p, params) for i, p in enumerate(prompts))
    }


@pytest.mark.parametrize("model_type,model_impl", [("llama", "auto"), ("qwen3", "auto"), ("llama", "transformers")])
def test_fp8_kv_greedy_equals_generate_reading_the_same_rounded_kv(model_type, model_impl):
    model_dir = random_model_dir(model_type)
    prompts = random_prompts(6, 128, 1, 30)
    engine, outputs = _generate(model_dir, prompts, kv_cache_dtype="fp8_e4m3", model_impl=model_impl)
    assert engine.model_runner.kv_cache.kv.dtype == KV_FP8_DTYPE
    reference = _fp8_reference(model_dir)
    for i, prompt in enumerate(prompts):
        assert outputs[i] == greedy_generate(reference, prompt, NEW_TOKENS), f"prompt {i}"
    # The rounding shows in the tokens here (the random weights' keys are large), so a cache left in full
    # precision would fail the equality above.
    _, full = _generate(model_dir, prompts, model_impl=model_impl)
    assert sum(full[i] != outputs[i] for i in range(len(prompts))) >= 3


def test_the_rounding_changes_the_logits_so_the_oracle_can_tell_fp8_from_full_precision():
    model_dir = random_model_dir("llama")
    prompt = torch.tensor([random_prompts(1, 128, 20, 20)[0]])
    with torch.no_grad():
        exact, rounded = (m(prompt).logits for m in (_hf_model(model_dir), _fp8_reference(model_dir)))
    assert not torch.allclose(exact, rounded, atol=1e-4)


def test_the_fp8_cache_holds_one_byte_per_value():
    model_dir = random_model_dir("llama")
    fp8, _ = _generate(model_dir, [[1, 2, 3]], kv_cache_dtype="fp8_e4m3")
    full, _ = _generate(model_dir, [[1, 2, 3]])
    assert fp8.model_runner.kv_cache.kv.shape == full.model_runner.kv_cache.kv.shape
    assert full.model_runner.kv_cache.kv.nbytes == 4 * fp8.model_runner.kv_cache.kv.nbytes  # float32 model
    # A memory budget sizes the pool by bytes per block: half of bfloat16's, so twice the tokens.
    shape = (2, 4, 2, 16)  # layers, page size, KV heads, head dim
    assert KVCache.bytes_per_block(*shape, torch.bfloat16) == 2 * KVCache.bytes_per_block(*shape, KV_FP8_DTYPE)


def test_quantize_kv_saturates_and_rounds_to_e4m3():
    x = torch.tensor([0.0, 1.0, 0.3, 500.0, -1000.0, 1e-9])
    stored = quantize_kv(x)
    assert stored.dtype == KV_FP8_DTYPE
    assert dequantize_kv(stored, torch.float32).tolist() == [0.0, 1.0, 0.3125, 448.0, -448.0, 0.0]


@pytest.mark.parametrize(
    "settings,named",
    [
        (dict(attention_backend="cpu"), "set attention_backend = auto or torch"),
        (dict(attention_backend="triton"), "the triton kernels read K/V in the model's dtype"),
        (dict(tensor_parallel_size=2), "does not run with kv_cache_dtype = 'fp8_e4m3'"),
    ],
)
def test_what_cannot_read_an_fp8_cache_is_refused_by_name(settings, named):
    with pytest.raises(ValueError, match="kv_cache_dtype") as info:
        EngineConfig(**ENGINE_CONFIG, kv_cache_dtype="fp8_e4m3", **settings)
    assert named in str(info.value)
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8_e4m3'\)"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_offloaded_fp8_pages_come_back_as_they_left():
    from tests.model_utils import random_llama_dir

    model_dir, prompts = random_llama_dir(128), random_prompts(24, 128, 1, 24, seed=5)
    params = SamplingParams(max_new_tokens=48)

    def run(**config):
        engine = LLMEngine.from_pretrained(
            str(model_dir), EngineConfig(page_size=8, kv_cache_dtype="fp8_e4m3", **config)
        )
        outputs = {
            o.request_id: o.output_token_ids for o in engine.generate((i, p, params) for i, p in enumerate(prompts))
        }
        return [outputs[i] for i in range(len(prompts))], engine.stats

    roomy, _ = run(num_blocks=512, max_batch_tokens=256)
    tight, stats = run(num_blocks=16, max_batch_tokens=32, cpu_offload_space=0.001, allow_block_sharing=False)
    assert stats.num_offloads > 0
    assert tight == roomy
