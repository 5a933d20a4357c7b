"""Every transformers causal-LM family either equals transformers' ``generate`` token for token (an argmax loop over
its forward pass where ``generate`` itself fails) or is refused at load by name: the committed results of
``benchmarks/family_walk.py`` cover every family, and a subset of them is run again here (a fixed set that holds
every outcome and refusal kind, plus families that rotate by the day of the year, so the whole mapping is re-walked
in the suite over a few weeks; ``CBRUN_FAMILY_WALK=all`` runs every one).
"""

from __future__ import annotations

import datetime
import gc
import os
from pathlib import Path

import pytest

from benchmarks import family_walk

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results-family-walk.md"
#: Families always walked: plain, MoE, sliding window, soft-capping, sinks (gpt-oss), partial rotary, composite
#: (multimodal) configs, and one of each refusal kind.
FIXED = [
    "llama",
    "gpt2",
    "gemma2",
    "cohere2",
    "gpt_oss",
    "mixtral",
    "qwen3_moe",
    "olmo2",
    "gptj",
    "phimoe",
    "dbrx",
    "fuyu",
    "deepseek_v3",  # multi-head latent attention
    "llama4_text",  # chunked attention
    "mpt",  # ALiBi
    "bloom",  # attention code of its own
    "git",  # attention classes picked by name
    "rwkv",  # recurrent, no attention heads
    "mamba",  # linear-attention layer kinds
    "nemotron",  # keyword arguments not passed on to attention
    "bert",  # non-causal
    "trocr",  # cross-attention
    "gpt_bigcode",  # one KV head the config does not state
    # Once not buildable with the generic tiny fields, now built with their own:
    "bart",  # a seq2seq decoder: cross-attention
    "gemma4_text",  # per-layer head sizes (per_layer_config)
    "dots3_note_text",  # multi-head latent attention with a latent rank per layer
    "gemma3n_text",  # KV shared across layers, per-layer embeddings: equal
    "emu3",  # a released checkpoint its ForCausalLM reads none of the weights of
    "musicgen",  # two text models, and transformers cannot load it as a causal LM
    "blt",  # transformers' generate fails: the reference is an argmax loop over its forward
    "gemma3n",  # needs timm, which is not installed
]
ROTATING = 4


def _suite_families() -> list[str]:
    every = family_walk.families()
    if os.environ.get("CBRUN_FAMILY_WALK") == "all":
        return every
    rest = [f for f in every if f not in FIXED]
    day = datetime.date.today().timetuple().tm_yday
    return FIXED + [rest[(day * ROTATING + i) % len(rest)] for i in range(ROTATING)]


@pytest.fixture(scope="module")
def recorded() -> dict[str, tuple[str, str, str]]:
    return family_walk.read_table(RESULTS)


def test_the_results_cover_every_family_and_none_runs_wrong(recorded):
    assert sorted(recorded) == family_walk.families()
    wrong = {name: row for name, row in recorded.items() if row[0] in ("DIFFERENT", "ERROR")}
    assert not wrong
    # A family is built with its own fields where the generic ones do not make it: only a missing package is left.
    unbuilt = {name: row for name, row in recorded.items() if row[0] == "not buildable"}
    assert all(row[1].startswith("needs a package that is not installed") for row in unbuilt.values()), unbuilt
    assert all(name in recorded for name in FIXED)


def test_a_refusal_names_its_feature():
    message = "attention feature not implemented: chunked attention (config.attention_chunk_size = 8); cbrun ..."
    assert family_walk.feature(message) == "chunked attention"


@pytest.mark.parametrize("model_type", _suite_families())
def test_family_walks_as_recorded(model_type, tmp_path, recorded):
    outcome = family_walk.walk(model_type, tmp_path)
    gc.collect()
    assert outcome.status not in ("DIFFERENT", "ERROR"), outcome.detail
    assert (outcome.status, outcome.detail, outcome.reference) == recorded[model_type]
