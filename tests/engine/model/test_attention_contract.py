"""The attention contract (``cbrun.engine.model.layers.attention_contract``): gpt-oss's sinks run and equal transformers,
and what cbrun does not implement is refused by name, at load and at call time."""

from __future__ import annotations

import pytest
import torch
import transformers

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.model.layers import attention_contract
from cbrun.engine.model.layers.attention import paged_attention_forward
from cbrun.engine.model.layers.attention_contract import UnsupportedAttention
from tests.model_utils import TINY_DECODER, greedy_generate, random_prompts, run_engine, save_spread_weights

VOCAB = 128
NEW_TOKENS = 8
PROMPTS = [random_prompts(1, VOCAB, n, n, seed=n)[0] for n in (1, 3, 6, 9, 14)]
ENGINE = dict(page_size=4, max_batch_tokens=16, num_blocks=128)
_SMALL = dict(TINY_DECODER, vocab_size=VOCAB, intermediate_size=64, head_dim=16)


def _generate(model_dir: str) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    return [greedy_generate(model, prompt, NEW_TOKENS) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A random gpt-oss (sinks, alternating sliding (window 4) and full layers, MoE, YaRN RoPE) and its
    transformers greedy outputs; also those of the same model with its sinks at -inf (no sink)."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        **_SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, layer_types=None
    )
    model = transformers.GptOssForCausalLM(config).eval()
    assert config.layer_types == ["sliding_attention", "full_attention"]
    model_dir = save_spread_weights(model, tmp_path_factory.mktemp("gpt_oss"))
    expected = _generate(model_dir)
    without = transformers.GptOssForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        for layer in without.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
    no_sink_dir = tmp_path_factory.mktemp("gpt_oss_no_sinks")
    without.save_pretrained(no_sink_dir)
    return model_dir, expected, _generate(str(no_sink_dir))


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
def test_gpt_oss_equals_transformers(gpt_oss, attention_backend):
    """The C kernel (auto on the CPU, float32) and the PyTorch reference add the sinks as transformers does."""
    model_dir, expected, without_sinks = gpt_oss
    assert without_sinks != expected  # the sinks change greedy tokens: the comparison can fail
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = run_engine(model_dir, PROMPTS, EngineConfig(**ENGINE, attention_backend=attention_backend), params)
    for i, want in enumerate(expected):
        assert outputs[i].error is None, outputs[i].error
        assert outputs[i].output_token_ids == want, f"prompt {i}"


def test_deepseek_v3_mla_is_refused_at_load(tmp_path):
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        **_SMALL,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedAttention, match="multi-head latent attention is not implemented"):
        LLMEngine.from_pretrained(str(tmp_path), EngineConfig(**ENGINE))


class _Module(torch.nn.Module):
    layer_idx = 0


@pytest.mark.parametrize(
    "kwargs,feature",
    [
        (dict(position_bias=torch.zeros(1)), "'position_bias'"),
        (dict(sinks=torch.zeros(4)), "'sinks'"),
        (dict(dropout=0.1), "attention dropout"),
        (dict(is_causal=False), "non-causal"),
        (dict(attention_mask=torch.zeros(1, 1, 2, 2)), "attention mask"),
    ],
)
def test_hook_refuses_what_it_does_not_implement(kwargs, feature):
    """At call time, an argument the hook would otherwise drop raises, naming it (the load check catches it
    first; this is the backstop)."""
    q = torch.zeros(1, 4, 2, 16)
    k = torch.zeros(1, 2, 2, 16)
    call = {"attention_mask": None, "cbrun_metadata": object(), **kwargs}
    with pytest.raises(UnsupportedAttention, match=feature):
        paged_attention_forward(_Module(), q, k, k, **call)


def test_layers_of_different_attention_shapes_are_refused_by_name():
    """Gemma 4's full-attention layers have twice the head size of its sliding ones (``per_layer_config``): the
    global ``head_dim`` cannot even be read, and cbrun's cache has one shape, so the config is refused naming
    the key and both values."""
    config = transformers.Gemma4TextConfig(
        **_SMALL, sliding_window=4, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, global_head_dim=32
    )
    assert "head_dim" in config.per_layer_attributes
    with pytest.raises(UnsupportedAttention, match="attention shapes or windows that differ between layers .*head_dim"):
        attention_contract.check_config(config)
    uniform = transformers.Gemma4TextConfig(
        **_SMALL, sliding_window=4, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, global_head_dim=16
    )
    attention_contract.check_config(uniform)  # the same per-layer keys at one value: nothing differs


def test_a_model_of_several_text_models_is_refused_by_name():
    """MusicGen holds a T5 text encoder beside its audio-codebook decoder: no one decoder-only causal LM."""
    with pytest.raises(UnsupportedAttention, match="a model of several text models .*MusicgenConfig"):
        attention_contract.check_config(transformers.MusicgenConfig())


def test_a_checkpoint_without_some_of_the_models_weights_is_refused(tmp_path):
    """transformers leaves weights a checkpoint lacks at random initial values (an Emu3 checkpoint read by its
    ``ForCausalLM``): refused at load, naming them, never run."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL)).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 of LlamaForCausalLM's weights \(model.norm.weight\)"):
        LLMEngine.from_pretrained(str(tmp_path), EngineConfig(**ENGINE, loader="transformers"))


def test_a_checkpoint_transformers_cannot_build_as_a_causal_lm_is_refused(tmp_path, monkeypatch):
    """Whatever transformers' own classes raise while building the model (MusicGen's causal LM handed the whole
    config: AttributeError) is a refusal at load naming the error, not a crash."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL)).save_pretrained(tmp_path)

    def fails(*args, **kwargs):
        raise AttributeError("'MusicgenConfig' object has no attribute 'dropout'")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fails)
    with pytest.raises(ValueError, match="transformers cannot load .* as a causal LM \\(AttributeError: 'Musicgen"):
        LLMEngine.from_pretrained(str(tmp_path), EngineConfig(**ENGINE, loader="transformers"))
