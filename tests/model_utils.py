"""Small random-weight models and transformers' own greedy outputs, shared by engine tests."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from cbrun.bench.workloads import llama_shape

#: Random weights are scaled up so logits are well separated: a mismatch means a bug, not a rounding tie.
WEIGHT_SCALE = 3.0

#: Config fields of a model with no special tokens: nothing but the test's own limits stops a greedy run.
NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
#: The small decoder the random test models start from (fields of a transformers config; override per test):
#: hidden 64 over 2 layers, 4 query heads sharing 2 KV heads, MLP width 128, 128 tokens, 256 positions.
TINY_DECODER = dict(**llama_shape(64, 2, 4, 2, 128), vocab_size=128, max_position_embeddings=256, **NO_SPECIAL_TOKENS)


@functools.lru_cache(maxsize=None)
def random_llama_dir(vocab_size: int = 128, num_kv_heads: int = 2, max_len: int = 256, seed: int = 0) -> Path:
    """A random Llama with grouped-query attention (4 query heads), saved once per session to a temp dir."""
    config = LlamaConfig(
        **dict(TINY_DECODER, vocab_size=vocab_size, num_key_value_heads=num_kv_heads, max_position_embeddings=max_len)
    )
    return scaled_random_dir(LlamaForCausalLM, config, "cbrun-llama-", seed)


def scaled_random_dir(model_class, config, prefix: str, seed: int = 0) -> Path:
    """``model_class(config)`` initialised from ``seed``, every weight times WEIGHT_SCALE, saved to a new session
    temp dir named ``prefix...``."""
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(WEIGHT_SCALE)
    path = session_tmp_dir(prefix)
    model.save_pretrained(path)
    return path


@functools.lru_cache(maxsize=None)
def random_model_dir(model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """A small random model of ``model_type`` ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "qwen2_moe",
    "mixtral": 4 experts, 2 per token; Qwen2-MoE's shared expert 48 wide), every weight, bias and norm scale perturbed, saved once per session (safetensors);
    ``overrides`` are config fields."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }
    config_class, model_class = classes[model_type]
    fields = dict(TINY_DECODER, intermediate_size=96, max_position_embeddings=128)
    if model_type in ("mistral", "mixtral"):
        fields["sliding_window"] = None
    if model_type in ("qwen3_moe", "qwen2_moe", "mixtral"):
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        if model_type == "qwen2_moe":
            fields["shared_expert_intermediate_size"] = 48
        if model_type == "mixtral":
            del fields["moe_intermediate_size"]
    torch.manual_seed(seed)
    lists = {key: list(value) for key, value in overrides.items() if isinstance(value, tuple)}  # hashable here
    model = model_class(config_class(**{**fields, **overrides, **lists})).eval()
    path = session_tmp_dir(f"cbrun-{model_type}-")
    save_spread_weights(model, path)  # biases start at zero and norms at one: make them matter
    return path


def session_tmp_dir(prefix: str) -> Path:
    """A new temporary directory, removed when the test process exits (the models are cached per session)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def random_prompts(n: int, vocab_size: int, min_len: int = 1, max_len: int = 40, seed: int = 1) -> list[list[int]]:
    """``n`` prompts of random ids with lengths in [min_len, max_len]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab_size, (length,), generator=g).tolist() for length in lengths]


@functools.lru_cache(maxsize=None)
def _hf_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()


def save_spread_weights(model, path) -> str:
    """Save ``model`` to ``path`` with its weights scaled by WEIGHT_SCALE plus 0.05 N(0, 1) noise: spread enough
    that greedy tokens vary and unit weights (norms, sinks) are not all equal, so a feature ignored shows."""
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(WEIGHT_SCALE).add_(0.05 * torch.randn_like(param))
    model.save_pretrained(path)
    return str(path)


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers ``generate`` on one prompt, greedy, exactly ``max_new_tokens`` new tokens."""
    return greedy_generate(_hf_model(model_dir), prompt, max_new_tokens)


def greedy_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``model.generate`` (a transformers causal LM) on one prompt, greedy, exactly ``max_new_tokens`` new tokens."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def run_engine(model_dir: Path, prompts, config, params) -> dict:
    """Run every prompt through one engine; return ``{index: RequestOutput}`` and check block accounting."""
    from cbrun.engine import LLMEngine

    engine = LLMEngine.from_pretrained(str(model_dir), config)
    outputs = {o.request_id: o for o in engine.generate((i, p, params) for i, p in enumerate(prompts))}
    assert_pool_balanced(engine)
    return outputs


def assert_pool_balanced(engine) -> None:
    """After all requests finished: no block is referenced and the pool's states add up."""
    bm = engine.block_manager
    bm.check_consistency()
    assert all(r == 0 for r in bm.ref_counts)
    assert bm.num_free_blocks == bm.num_blocks


def assert_same_outputs_and_logprobs(got, want, abs_tol: float = 1e-4) -> None:
    """``got`` and ``want`` (``Request id -> RequestOutput``, the same ids): equal tokens, and where ``want`` has
    logprobs, the same top-token keys with values within ``abs_tol``."""
    import pytest

    for key in want:
        assert got[key].output_token_ids == want[key].output_token_ids, f"prompt {key}"
        if want[key].logprobs is not None:
            assert len(got[key].logprobs) == len(want[key].logprobs)
            for g, w in zip(got[key].logprobs, want[key].logprobs):
                assert g.keys() == w.keys()
                assert g == pytest.approx(w, abs=abs_tol)


def random_moe_weights(
    experts: int, top_k: int, hidden: int, width: int, dtype, norm: bool = True, cast: bool = False, seed: int = 0
):
    """A random MoE block (router, experts scaled by 1/sqrt(fan-in), no biases) in ``dtype``, seeded by its shape
    and ``seed``; ``norm``: renormalise the top-k weights; ``cast``: routing weights in the model dtype."""
    from cbrun.engine.model.layers.moe import MoEWeights

    g = torch.Generator().manual_seed(seed * 1000 + experts * 100 + top_k)
    return MoEWeights(
        router=torch.randn(experts, hidden, generator=g).to(dtype),
        gate_up=(torch.randn(experts, 2 * width, hidden, generator=g) / hidden**0.5).to(dtype),
        down=(torch.randn(experts, hidden, width, generator=g) / width**0.5).to(dtype),
        top_k=top_k,
        norm_topk_prob=norm,
        weights_in_model_dtype=cast,
    )
