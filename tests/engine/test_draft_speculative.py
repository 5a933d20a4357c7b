"""Speculative decoding with a draft model: greedy outputs token-identical to speculation off, sampling keeps the
target distribution.

Oracles: llama2.c's goldens for stories260K, transformers' ``generate`` for random Llama / Qwen2, the engine with
speculation off (tight caches, prefix sharing, stops inside an accepted run), and a toy model's known distribution.
A draft equal to the target must accept every proposal; a random draft must change nothing.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import transformers

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.spec_decode.draft_proposer import check_draft_vocab
from tests.engine import spec_utils
from tests.engine.spec_utils import VOCAB
from tests.model_utils import TINY_DECODER, hf_greedy, random_llama_dir, random_prompts


def _off_and_draft(model_dir, draft_dir, requests, **config):
    return spec_utils.off_and_on(model_dir, requests, "draft", draft_model=draft_dir, **config)


# ---- refusals -------------------------------------------------------------------------------------------------
def test_config_needs_a_draft_model():
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(speculative="draft")
    assert EngineConfig(speculative="draft", draft_model="/some/dir").draft_model == "/some/dir"


def test_draft_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocab_size 96 differs from the target's 128"):
        LLMEngine.from_pretrained(
            str(random_llama_dir(VOCAB)),
            EngineConfig(speculative="draft", draft_model=str(random_llama_dir(96)), num_blocks=64),
        )
    tokenizer = SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1})
    other = SimpleNamespace(get_vocab=lambda: {"a": 1, "b": 0})
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_draft_vocab(2, 2, tokenizer, other)
    check_draft_vocab(2, 8, tokenizer, tokenizer)  # same tokenizer, padded embeddings: allowed


def test_draft_refuses_swap_shorter_draft_and_sliding_targets(tmp_path):
    target = str(random_llama_dir(VOCAB))
    with pytest.raises(ValueError, match="CPU swap"):
        LLMEngine.from_pretrained(
            target, EngineConfig(speculative="draft", draft_model=target, num_blocks=64, cpu_offload_space=0.01)
        )
    with pytest.raises(ValueError, match="maximum length 64 is below the target's 256"):
        LLMEngine.from_pretrained(
            target,
            EngineConfig(speculative="draft", draft_model=str(random_llama_dir(VOCAB, max_len=64)), num_blocks=64),
        )
    config = transformers.MistralConfig(**dict(TINY_DECODER, sliding_window=6))
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="sliding-window"):
        LLMEngine.from_pretrained(str(tmp_path), EngineConfig(speculative="draft", draft_model=target, num_blocks=64))
    with pytest.raises(ValueError, match="sliding-window"):  # as the draft
        LLMEngine.from_pretrained(target, EngineConfig(speculative="draft", draft_model=str(tmp_path), num_blocks=64))


# ---- exactness -------------------------------------------------------------------------------------------------
def test_draft_equal_to_target_accepts_every_proposal():
    model_dir = random_llama_dir(VOCAB)
    prompts = random_prompts(6, VOCAB, 1, 20, seed=7)
    requests = [(i, p, SamplingParams(max_new_tokens=20)) for i, p in enumerate(prompts)]
    (off, _), (draft, stats) = _off_and_draft(
        model_dir, model_dir, requests, page_size=4, num_blocks=256, num_speculative_tokens=4
    )
    for i, prompt in enumerate(prompts):
        assert draft[i].output_token_ids == off[i].output_token_ids == hf_greedy(model_dir, prompt, 20), i
    assert stats.num_proposed_tokens > 0 and stats.acceptance_rate == 1.0
    assert stats.as_dict()["acceptance_rate"] == 1.0
    assert 4 < stats.mean_tokens_per_verify_step <= 5


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_random_draft_equals_transformers_generate(arch):
    model_dir = spec_utils.target_model_dir(arch)
    prompts = spec_utils.repetitive_prompts(4) + random_prompts(4, VOCAB, 1, 20, seed=7)
    config = EngineConfig(
        page_size=4,
        max_batch_tokens=16,
        num_blocks=256,
        speculative="draft",
        draft_model=str(spec_utils.random_draft_dir()),
        num_speculative_tokens=3,
    )
    engine = LLMEngine.from_pretrained(str(model_dir), config)
    outputs = spec_utils.generate(engine, [(i, p, SamplingParams(max_new_tokens=20)) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert outputs[i].output_token_ids == hf_greedy(model_dir, prompt, 20), f"prompt {i}"
    stats = engine.stats
    assert stats.num_verify_steps > 0 and stats.num_accepted_tokens < stats.num_proposed_tokens


@pytest.fixture(scope="module")
def stories_random_draft(stories260k_dir):
    """A random Llama with stories260K's vocabulary, length and tokenizer files."""
    max_len = json.loads((stories260k_dir / "config.json").read_text())["max_position_embeddings"]
    path = spec_utils.random_draft_dir(512, max_len)
    for name in stories260k_dir.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(name, path / name.name)
    return path


@pytest.mark.parametrize("draft", ["itself", pytest.param("random", marks=pytest.mark.slow)])
def test_draft_reproduces_llama2c_goldens(stories260k_dir, stories_random_draft, reference_greedy, draft):
    draft_dir = stories260k_dir if draft == "itself" else stories_random_draft
    # A wide token budget: every request verifies in each step (a random draft's k + 1 forwards stay few).
    config = EngineConfig(
        page_size=4,
        max_batch_tokens=128,
        speculative="draft",
        draft_model=str(draft_dir),
        num_speculative_tokens=4 if draft == "itself" else 2,
    )
    engine = LLMEngine.from_pretrained(str(stories260k_dir), config)
    spec_utils.assert_goldens(
        spec_utils.generate(engine, spec_utils.golden_requests(reference_greedy)), reference_greedy
    )
    stats = engine.stats
    assert stats.num_verify_steps > 0
    if draft == "itself":
        assert stats.acceptance_rate == 1.0
    else:
        assert stats.acceptance_rate < 0.5


@pytest.mark.parametrize("config", spec_utils.PRESSURE_CONFIGS, ids=spec_utils.PRESSURE_IDS)
@pytest.mark.parametrize("draft", ["itself", "random"])
def test_draft_equals_off_under_pressure_and_sharing(config, draft):
    model_dir = random_llama_dir(VOCAB)
    shared = spec_utils.repetitive_prompts(1, seed=11)[0][:16]
    prompts = [shared + p[:6] for p in spec_utils.repetitive_prompts(6)] + random_prompts(4, VOCAB, 4, 20, seed=5)
    requests = [(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(prompts)]
    draft_dir = model_dir if draft == "itself" else spec_utils.random_draft_dir()
    (off, off_stats), (spec, spec_stats) = _off_and_draft(
        model_dir, draft_dir, requests, num_speculative_tokens=4, **config
    )
    spec_utils.assert_same_as_off(spec, off)
    assert spec_stats.num_verify_steps > 0
    if draft == "itself":  # the draft's KV survived soft resets and shared blocks: every proposal is right
        assert spec_stats.acceptance_rate == 1.0
    spec_utils.assert_pressure_happened(config, off_stats, spec_stats)


@pytest.mark.slow
def test_draft_stops_inside_an_accepted_run_where_plain_decoding_stops(stories260k_dir):
    """Stop tokens, stop strings, max_new_tokens and the model length cut a run the draft got all right."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(stories260k_dir))
    story = tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play outside.")
    off_engine = LLMEngine.from_pretrained(str(stories260k_dir), EngineConfig())
    plain = spec_utils.generate(off_engine, [("p", story, SamplingParams(max_new_tokens=40))])["p"].output_token_ids
    requests = [
        ("max", story, SamplingParams(max_new_tokens=9)),
        ("token", story, SamplingParams(max_new_tokens=40, stop_token_ids=(plain[7],))),
        ("string", story, SamplingParams(max_new_tokens=40, stop=(tokenizer.decode(plain[10:12]),))),
        ("length", story, SamplingParams(max_new_tokens=600, ignore_eos=True)),  # runs into the model length
    ]
    (off, _), (spec, stats) = _off_and_draft(stories260k_dir, stories260k_dir, requests, num_speculative_tokens=6)
    spec_utils.assert_same_stops(spec, off)
    assert off["length"].finish_reason == "length" and len(off["length"].output_token_ids) > 40
    assert stats.acceptance_rate == 1.0


@pytest.mark.slow
def test_sampling_with_a_draft_keeps_the_target_distribution(tmp_path):
    """Rejection sampling with the draft's own q: the verified tokens' frequencies over many seeded draws match a
    toy target's known distribution (chi-square, fixed seeds, so the test is deterministic). The draft is another
    toy model whose q differs from p, so accept (min(1, p/q)) and resample (norm(max(0, p - q))) both run."""
    vocab, num_draws = 8, 1500
    # Target: the successor (a + 1) with probability 0.6, any other 0.4 / 7. Draft: the successor with 0.3, a + 2
    # with 0.5, the rest 0.2 / 6, so it over-proposes a + 2 (p < q: rejections) and under-proposes a + 1.
    rows = torch.arange(vocab)
    target = torch.full((vocab, vocab), 0.4 / (vocab - 1), dtype=torch.float64)
    target[rows, (rows + 1) % vocab] = 0.6
    draft = torch.full((vocab, vocab), 0.2 / (vocab - 2), dtype=torch.float64)
    draft[rows, (rows + 1) % vocab] = 0.3
    draft[rows, (rows + 2) % vocab] = 0.5
    model_dir = spec_utils.markov_model_dir(target.float(), tmp_path / "target")
    draft_dir = spec_utils.markov_model_dir(draft.float(), tmp_path / "draft")
    prompt = list(range(vocab)) * 2
    tokens, stats = spec_utils.markov_draws(model_dir, prompt, num_draws, speculative="draft", draft_model=draft_dir)
    assert stats.num_verify_steps == num_draws  # t1 sampled plainly; then one verify step of up to 2 proposals
    # Acceptance of a proposal is sum_x min(p(x), q(x)) = 0.3 + 0.4/7 + 6 * 0.2/6 ~ 0.56 (both branches run often).
    assert 0.46 < stats.acceptance_rate < 0.66
    spec_utils.assert_markov_draws(tokens, target.numpy(), prompt[-1])


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_a_draft_model_without_draft_speculation_is_refused(speculative):
    with pytest.raises(ValueError, match=f'draft_model is set but speculative = "{speculative}"'):
        EngineConfig(speculative=speculative, draft_model="some/draft")
