"""Model coverage: for each supported architecture, greedy outputs equal transformers' own generate.

Each model is a small random-weight config (no download) saved once per module. The engine runs all prompts
together with chunked prefill forced (16-token batches, 4-token pages); transformers runs them one at a time.
Sliding windows are 6 tokens, so prompts longer than the window, and generations that cross it, are covered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from tests.model_utils import (
    NO_SPECIAL_TOKENS,
    TINY_DECODER,
    WEIGHT_SCALE,
    assert_pool_balanced,
    greedy_generate,
    random_prompts,
    run_engine,
)

VOCAB = 128
NEW_TOKENS = 12
WINDOW = 6
#: Lengths around the window (6), the page size (4) and the batch budget (16), up to 40.
PROMPT_LENGTHS = (1, 2, 4, 5, 6, 7, 9, 12, 15, 16, 17, 23, 28, 33, 37, 40)
PROMPTS = [random_prompts(1, VOCAB, n, n, seed=n)[0] for n in PROMPT_LENGTHS]
ENGINE_CONFIG = dict(page_size=4, max_batch_tokens=16, num_blocks=256)

_DECODER = dict(TINY_DECODER, vocab_size=VOCAB)
_HYBRID = ["sliding_attention", "full_attention", "sliding_attention"]


@dataclass
class ModelSpec:
    """One architecture under test.

    Attributes:
        config_class, model_class: the transformers classes the random model is built with.
        config_kwargs: the small config.
        hf_attn: attention implementation of the transformers oracle.
        feature_off: config overrides, each switching off one thing this spec exists to cover (a window,
            soft-capping); the oracle's outputs must change under each, or the comparison would prove nothing.
    """

    config_class: type
    model_class: type
    config_kwargs: dict
    hf_attn: str = "sdpa"
    feature_off: list[dict] = field(default_factory=list)


SPECS = {
    "llama": ModelSpec(transformers.LlamaConfig, transformers.LlamaForCausalLM, _DECODER),
    "qwen2": ModelSpec(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, _DECODER),
    "qwen3": ModelSpec(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(_DECODER, head_dim=16)),
    "mistral": ModelSpec(
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(_DECODER, sliding_window=WINDOW),
        feature_off=[dict(sliding_window=1024)],
    ),
    # NOTE: final_logit_softcapping is monotonic, so it cannot change a greedy token; attn softcapping can.
    "gemma2": ModelSpec(
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(
            _DECODER,
            num_hidden_layers=3,
            head_dim=16,
            query_pre_attn_scalar=1,
            sliding_window=WINDOW,
            layer_types=_HYBRID,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=10.0,
        ),
        hf_attn="eager",  # Gemma2PreTrainedModel._supports_sdpa is False (no softcap in SDPA)
        feature_off=[dict(sliding_window=1024), dict(attn_logit_softcapping=None)],
    ),
    "gemma3": ModelSpec(
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            _DECODER,
            num_hidden_layers=3,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=_HYBRID,
        ),
        feature_off=[dict(sliding_window=1024)],
    ),
    "phi3": ModelSpec(transformers.Phi3Config, transformers.Phi3ForCausalLM, _DECODER),
    "gpt2": ModelSpec(
        transformers.GPT2Config,
        transformers.GPT2LMHeadModel,
        dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, **NO_SPECIAL_TOKENS),
    ),
}


def _save_random_model(spec: ModelSpec, path) -> str:
    torch.manual_seed(0)
    model = spec.model_class(spec.config_class(**spec.config_kwargs))
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(WEIGHT_SCALE)
    model.save_pretrained(path)
    return str(path)


def _hf_greedy_all(model_dir: str, attn: str, **config_overrides) -> list[list[int]]:
    """transformers ``generate``, greedy, one prompt at a time, exactly NEW_TOKENS new tokens each."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn, **config_overrides).eval()
    return [greedy_generate(model, prompt, NEW_TOKENS) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """``oracle(name) -> (model_dir, expected outputs)``, each model built and generated once per module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            spec = SPECS[name]
            model_dir = _save_random_model(spec, tmp_path_factory.mktemp(name))
            cache[name] = model_dir, _hf_greedy_all(model_dir, spec.hf_attn)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_matches_transformers(oracle, name):
    model_dir, expected = oracle(name)
    outputs = run_engine(
        model_dir, PROMPTS, EngineConfig(**ENGINE_CONFIG), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    )
    for i, want in enumerate(expected):
        assert outputs[i].error is None, outputs[i].error
        assert outputs[i].output_token_ids == want, f"{name}: prompt {i} (len {len(PROMPTS[i])})"


@pytest.mark.parametrize(
    "name,feature_off",
    [pytest.param(name, off, id=f"{name}-{'-'.join(off)}") for name, spec in SPECS.items() for off in spec.feature_off],
)
def test_oracle_applies_the_feature(oracle, name, feature_off):
    """transformers' generate really applies the window / soft-capping: switching it off changes its outputs."""
    model_dir, expected = oracle(name)
    assert _hf_greedy_all(model_dir, SPECS[name].hf_attn, **feature_off) != expected


_SMALL_ENCODER = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
)


@pytest.mark.parametrize(
    "config_class,model_class,config_kwargs",
    [
        pytest.param(
            transformers.T5Config,
            transformers.T5ForConditionalGeneration,
            dict(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=16, num_layers=1, num_heads=2),
            id="t5-encoder-decoder",
        ),
        # bert loads as BertLMHeadModel, whose layers are not causal unless config.is_decoder is set.
        pytest.param(transformers.BertConfig, transformers.BertForMaskedLM, _SMALL_ENCODER, id="bert-encoder"),
        pytest.param(
            transformers.Gemma3TextConfig,
            transformers.Gemma3ForCausalLM,
            dict(_SMALL_ENCODER, head_dim=16, use_bidirectional_attention=True, **NO_SPECIAL_TOKENS),
            id="gemma3-bidirectional",
        ),
    ],
)
def test_non_causal_model_is_rejected_at_load(tmp_path, config_class, model_class, config_kwargs):
    model_class(config_class(**config_kwargs)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="(?i)causal|decoder"):
        LLMEngine.from_pretrained(str(tmp_path), EngineConfig(page_size=4, num_blocks=16))


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_sliding_ring_stays_within_its_window_and_pool_balances(oracle, name):
    """Sliding requests recycle a fixed ring of blocks; full and sliding blocks share one pool of chunks."""
    model_dir, expected = oracle(name)
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(**ENGINE_CONFIG))
    bm = engine.block_manager
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(i, prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    outputs, longest = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.output_token_ids
        for request in engine.scheduler.running:
            assert len(request.sliding_block_table) <= bm.ring_blocks
            longest = max(longest, request.num_tokens)
        bm.check_consistency()
    assert longest > bm.ring_blocks * bm.page_size  # the ring was recycled
    assert [outputs[i] for i in range(len(PROMPTS))] == expected
    assert_pool_balanced(engine)


#: Prompts that repeat a phrase, so n-gram lookup proposes (and random models often keep the loop going).
REPEATING_PROMPTS = [(p * 8)[:12] for p in PROMPTS[2:8]]


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
@pytest.mark.parametrize(
    "cache",
    [dict(), dict(safety_margin=0.0), dict(safety_margin=0.0, cpu_offload_space=0.01)],
    ids=["roomy", "soft-resets", "swap"],
)
def test_ngram_speculation_matches_transformers_on_sliding_windows(oracle, name, cache):
    """Rejected proposals' slots in a sliding ring are rolled back (``BlockManager.trim``): outputs stay exact,
    under preemption too (soft reset and CPU swap of a trimmed ring)."""
    model_dir, _ = oracle(name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=SPECS[name].hf_attn).eval()
    with torch.no_grad():
        expected = [
            model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=24,
                min_new_tokens=24,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in REPEATING_PROMPTS
        ]
    # A tight pool: room for about one request's ring (Mistral) or its full blocks and ring (Gemma 3) at a time.
    num_blocks = {"mistral": 8, "gemma3": 12}[name] if cache else 256
    config = EngineConfig(
        **{**ENGINE_CONFIG, **cache, "num_blocks": num_blocks},
        speculative="ngram",
        ngram_min=1,
        num_speculative_tokens=3,
    )
    engine = LLMEngine.from_pretrained(model_dir, config)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    outputs = {o.request_id: o for o in engine.generate((i, p, params) for i, p in enumerate(REPEATING_PROMPTS))}
    for i, want in enumerate(expected):
        assert outputs[i].output_token_ids == want, f"{name}: prompt {i}"
    stats = engine.stats
    assert stats.num_accepted_tokens < stats.num_proposed_tokens  # rejected slots were written and rolled back
    if cache:
        assert stats.num_soft_resets + stats.num_offloads > 0
        if "cpu_offload_space" in cache:
            assert stats.num_offloads > 0
    engine.block_manager.check_consistency()
