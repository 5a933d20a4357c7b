"""What the speculative-decoding tests (n-gram and draft) share: their prompts and models, engines run with
speculation off and on, the requests of llama2.c's goldens, a toy model of known distribution, and the checks
that compare them."""

from __future__ import annotations

import functools

import numpy as np
import torch
import transformers

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from tests.model_utils import TINY_DECODER, assert_pool_balanced, random_llama_dir, random_prompts, scaled_random_dir

VOCAB = 128

#: Engine settings under which speculation must change nothing: a tight cache (soft resets happen) and prefix
#: sharing; ``num_blocks`` tells them apart in ``assert_pressure_happened``.
PRESSURE_CONFIGS = [
    dict(page_size=4, max_batch_tokens=24, num_blocks=12, safety_margin=0.0),
    dict(page_size=4, max_batch_tokens=32, num_blocks=256, allow_block_sharing=True),
]
PRESSURE_IDS = ["tight-cache", "prefix-sharing"]

#: Rows whose greedy token is changed on the host (penalties, min_new_tokens, stop tokens, log-probabilities).
HOST_PROCESSED_PARAMS = [
    SamplingParams(max_new_tokens=16, repetition_penalty=1.3),
    SamplingParams(max_new_tokens=16, presence_penalty=0.5, frequency_penalty=0.3, logprobs=2),
    SamplingParams(
        max_new_tokens=16,
        min_new_tokens=5,
        stop_token_ids=(3, 7, 11),
        logprobs=0,
        logprobs_mode="processed_logprobs",
    ),
]


def generate(engine: LLMEngine, requests) -> dict:
    """``{request id: RequestOutput}`` of ``engine`` on ``requests``; the block pool must be balanced after."""
    outputs = {o.request_id: o for o in engine.generate(requests)}
    assert_pool_balanced(engine)
    return outputs


def repetitive_prompts(n: int, seed: int = 3) -> list[list[int]]:
    """Prompts that repeat a random phrase, so n-gram lookup finds proposals (random models loop, too)."""
    phrases = random_prompts(n, VOCAB, 3, 9, seed=seed)
    return [(phrase * 5)[:30] for phrase in phrases]


@functools.lru_cache(maxsize=None)
def target_model_dir(arch: str):
    """The random Llama of ``random_llama_dir``, or a Qwen2 of the same shape and seed ("llama" or "qwen2")."""
    if arch == "llama":
        return random_llama_dir(VOCAB)
    return scaled_random_dir(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**TINY_DECODER), "cbrun-qwen2-")


def random_draft_dir(vocab: int = VOCAB, max_len: int = 256):
    """A random Llama of another seed: its proposals are mostly wrong."""
    return random_llama_dir(vocab, max_len=max_len, seed=7)


def off_and_on(model_dir, requests, speculative: str, draft_model=None, **config) -> list:
    """``[(outputs, stats) with speculation off, (outputs, stats) with ``speculative``]``, the same ``config``."""
    results = []
    for mode, draft in (("off", None), (speculative, draft_model)):
        engine_config = EngineConfig(speculative=mode, draft_model=None if draft is None else str(draft), **config)
        engine = LLMEngine.from_pretrained(str(model_dir), engine_config)
        results.append((generate(engine, requests), engine.stats))
    return results


def assert_same_as_off(spec: dict, off: dict) -> None:
    """Every request's tokens and finish reason equal speculation off's."""
    assert spec.keys() == off.keys()
    for key in off:
        assert spec[key].output_token_ids == off[key].output_token_ids, f"prompt {key}"
        assert spec[key].finish_reason == off[key].finish_reason, f"prompt {key}"


def assert_same_stops(spec: dict, off: dict) -> None:
    """Every request's tokens, finish reason, stop reason and text equal speculation off's."""
    for name in off:
        assert spec[name].output_token_ids == off[name].output_token_ids, name
        assert (spec[name].finish_reason, spec[name].stop_reason, spec[name].text) == (
            off[name].finish_reason,
            off[name].stop_reason,
            off[name].text,
        ), name


def assert_pressure_happened(config: dict, off_stats, spec_stats) -> None:
    """The ``PRESSURE_CONFIGS`` entry did what it is there for: soft resets in both runs, or cached prompt tokens."""
    if config["num_blocks"] == 12:
        assert off_stats.num_soft_resets > 0 and spec_stats.num_soft_resets > 0
    else:
        assert spec_stats.num_cached_prompt_tokens > 0


def golden_requests(reference_greedy: list[dict]) -> list:
    """One request per llama2.c golden line, with the budget llama2.c had."""
    return [
        (
            i,
            line["prompt_token_ids"],
            SamplingParams(max_new_tokens=line["max_positions"] - len(line["prompt_token_ids"]) + 1),
        )
        for i, line in enumerate(reference_greedy)
    ]


def assert_goldens(outputs: dict, reference_greedy: list[dict]) -> None:
    """Every golden line's tokens equal llama2.c's."""
    for i, line in enumerate(reference_greedy):
        assert outputs[i].output_token_ids == line["output_token_ids"], f"line {i}: {line['prompt']!r}"


def markov_model_dir(transitions, path) -> str:
    """A Llama whose next-token distribution is ``transitions[last token]`` exactly: every block's output
    projections are zero (the residual stream is the last token's embedding), embeddings are scaled one-hot rows,
    so the final RMSNorm gives ``sqrt(hidden) * onehot``, and the LM head holds ``log(transitions)``."""
    vocab, hidden = transitions.shape[0], 64
    config = transformers.LlamaConfig(
        **dict(
            TINY_DECODER,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=64,
            num_hidden_layers=1,
            tie_word_embeddings=False,
        )
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, :vocab] = torch.log(transitions).T / hidden**0.5
    model.save_pretrained(path)
    return str(path)


def markov_draws(model_dir: str, prompt: list[int], num_draws: int, **speculation) -> tuple[np.ndarray, object]:
    """``num_draws`` seeded 3-token samples (temperature 1) after ``prompt``, all in one engine with the
    ``speculation`` fields and up to 2 proposals a step: ``(tokens (num_draws x 3), the engine's stats)``."""
    config = EngineConfig(
        **speculation,
        num_speculative_tokens=2,
        num_blocks=512,
        page_size=4,
        max_batch_tokens=512,
        max_requests_per_batch=128,
        speculative_max_batch=128,
    )
    engine = LLMEngine.from_pretrained(model_dir, config)
    requests = [(i, prompt, SamplingParams(max_new_tokens=3, temperature=1.0, seed=i)) for i in range(num_draws)]
    outputs = generate(engine, requests)
    return np.array([outputs[i].output_token_ids for i in range(num_draws)]), engine.stats


def chi_square_p(observed, expected_probs) -> float:
    """Pearson's chi-square p-value, cells with an expected count under 5 pooled into one."""
    from scipy.stats import chisquare

    expected = np.asarray(expected_probs) * sum(observed)
    small = expected < 5
    obs = np.append(np.asarray(observed)[~small], np.asarray(observed)[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def assert_markov_draws(tokens: np.ndarray, transitions: np.ndarray, last_prompt_token: int) -> None:
    """``tokens`` (draws x 3 new tokens of a ``markov_model_dir`` model) follow ``transitions`` (vocab x vocab,
    float64): the joint of the first two tokens and the marginal of the third pass a chi-square test at 1e-3.

    The second token is the verified one: its joint with the first (which fixes the proposal) shows a wrong
    accept/resample rule."""
    vocab = transitions.shape[0]
    t = transitions
    exact12 = (t[last_prompt_token][:, None] * t).reshape(-1)  # p(t1, t2), t1 major
    exact3 = exact12 @ np.tile(t, (vocab, 1))  # sum over (t1, t2) of p(t1, t2) * p(t3 | t2)
    observed12 = np.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab)
    assert chi_square_p(observed12, exact12) > 1e-3, (observed12, exact12 * len(tokens))
    observed3 = np.bincount(tokens[:, 2], minlength=vocab)
    assert chi_square_p(observed3, exact3) > 1e-3, (observed3, exact3 * len(tokens))
