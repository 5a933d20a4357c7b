"""Families of transformers' causal LMs built from one generic tiny config: each either equals transformers'
``generate`` token for token or is refused at load by name.

NOTE: a fixed subset of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (the families a hand-run walk over the first ones
alphabetically reached, docs/models.md); the walk over every family is not a test yet.
"""

from __future__ import annotations

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from tests.model_utils import greedy_generate, save_spread_weights

#: Config fields set where a family's config has them (sliding windows of 4 tokens, 4 experts, 2 per token).
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    sliding_window=4,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)
PROMPTS = [[3, 17, 5, 99, 42, 7], [11, 2]]
NEW_TOKENS = 5
EQUAL = ["apertus", "arcee", "aria_text", "bitnet", "cohere", "cohere2", "gemma2", "gpt2", "llama"]
#: family -> what the refusal names.
REFUSED = {
    "bloom": "token mixing other than one attention per layer",
    "big_bird": "token mixing other than one attention per layer",
    "mamba": "linear_attention layers",
    "bert": "non-causal",
    "camembert": "non-causal",
}


def _tiny_model_dir(model_type: str, path) -> str:
    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    config = config_class(**{k: v for k, v in TINY.items() if hasattr(default, k)})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    return save_spread_weights(model, path)


def _generate(model_dir: str) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    return [greedy_generate(model, p, NEW_TOKENS) for p in PROMPTS]


def test_the_families_are_transformers_causal_lms():
    assert set(EQUAL) | set(REFUSED) <= set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.mark.parametrize("model_type", EQUAL)
def test_family_equals_transformers(model_type, tmp_path):
    model_dir = _tiny_model_dir(model_type, tmp_path)
    expected = _generate(model_dir)
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(page_size=4, max_batch_tokens=16, num_blocks=64))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = {o.request_id: o for o in engine.generate((i, p, params) for i, p in enumerate(PROMPTS))}
    assert [outputs[i].output_token_ids for i in range(len(PROMPTS))] == expected


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_family_is_refused_at_load_by_name(model_type, tmp_path):
    model_dir = _tiny_model_dir(model_type, tmp_path)
    with pytest.raises(ValueError, match=REFUSED[model_type]):
        LLMEngine.from_pretrained(model_dir, EngineConfig(page_size=4, max_batch_tokens=16, num_blocks=64))
