"""GSM8K test row 597 on stories260K: the one row where cbrun and transformers ``generate`` were seen to differ.

Greedy step 46 of this row is a tie at the limit of float32: in float64 token 262 beats token 352 by 1.5e-6, 1.6
float32 ulps of the logit (11.473). Which one a float32 forward pass picks depends on rounding anywhere in the five
layers, so it changes with the batch around the row, in cbrun and in transformers alike:

- unpadded batch-1 ``generate`` (the purest oracle): 262 (by 1.9e-6); padded ``generate`` in its batch of 64
  (``cbrun bench --backends cbrun,hf-generate --batch-sizes 64``): 352 (by 9.5e-7).
- cbrun alone, and in the bench's batches: 262 with either attention backend. In the README's GSM8K job with
  ``attention_backend = "cpu"`` at 264b778: 352 (the 146,551 -> 146,572 generated-token change; ``torch`` gave
  262 there). With the CPU kernel of 6f13c1a the job gives 262 again (146,551 tokens).

The cause there is not the attention kernel: the row's prefill ends a step whose (tokens x 172) MLP tensor has a
length that is not a multiple of torch's 16-float vector loop, so the last intermediate features of the row's last
prompt token take ``F.silu``'s scalar tail path (a different ``exp``), one element differs by an ulp, and the tie
flips. transformers' own batch-1 decode takes that scalar path for features 160-171 of every token. Over all 1,319
rows and 146,551 greedy steps of that job, this step holds the smallest top-2 gap of the oracle; every other row's
tokens equal unpadded ``generate`` under both backends and both batch layouts.

These tests pin the row: cbrun alone equals unpadded ``generate``; the tie is below 2 ulps in float64; and in a
batch that puts the row's prefill at a step's end, cbrun's tokens equal the oracle's except possibly at that step,
and then only by choosing the other tied token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.kernels.cpu_attention import unavailable_reason
from tests.model_utils import hf_greedy

# GSM8K test split, row 597 (id gsm8k_test-00597): 120 prompt tokens with stories260K's tokenizer.
QUESTION = (
    "The three angles in a triangle add up to 180 degrees. One angle is twice the smallest angle, and one "
    "angle is three times the smallest angle. What is the measure of the largest angle in the triangle, in "
    "degrees?"
)
TIE_STEP, WINNER, RUNNER_UP = 46, 262, 352
NUM_TOKENS = TIE_STEP + 2
# The README job's engine settings (manifests/gsm8k-stories260k.toml).
JOB_ENGINE = dict(page_size=64, max_batch_tokens=512, max_requests_per_batch=64, num_threads=1)
BACKENDS = [
    "torch",
    pytest.param(
        "cpu", marks=pytest.mark.skipif(unavailable_reason() is not None, reason=f"CPU kernel: {unavailable_reason()}")
    ),
]


@pytest.fixture(scope="module")
def prompt(stories260k_dir) -> list[int]:
    ids = AutoTokenizer.from_pretrained(stories260k_dir, local_files_only=True)(QUESTION)["input_ids"]
    assert len(ids) == 120
    return ids


@pytest.fixture(scope="module")
def oracle(stories260k_dir, prompt) -> list[int]:
    """Unpadded batch-1 greedy ``generate`` in float32."""
    tokens = hf_greedy(stories260k_dir, prompt, NUM_TOKENS)
    assert tokens[TIE_STEP] == WINNER
    return tokens


def _cbrun(model_dir, requests, backend: str) -> dict:
    engine = LLMEngine.from_pretrained(str(model_dir), EngineConfig(**JOB_ENGINE, attention_backend=backend))
    return {o.request_id: o.output_token_ids for o in engine.generate(requests)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_alone_equals_unpadded_generate(stories260k_dir, prompt, oracle, backend):
    params = SamplingParams(max_new_tokens=NUM_TOKENS, ignore_eos=True)
    assert _cbrun(stories260k_dir, [("row", prompt, params)], backend)["row"] == oracle


def test_step_46_is_a_float32_tie(stories260k_dir, prompt, oracle):
    model = AutoModelForCausalLM.from_pretrained(stories260k_dir, dtype=torch.float64, local_files_only=True).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + oracle[:TIE_STEP]])).logits[0, -1]
    top = torch.topk(logits, 2)
    assert top.indices.tolist() == [WINNER, RUNNER_UP]
    gap = float(top.values[0] - top.values[1])
    ulp = float(np.spacing(np.float32(top.values[0])))
    assert 0 < gap < 2 * ulp  # 1.5e-6 against a float32 ulp of 9.5e-7 at this logit


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_at_a_step_end_differs_only_at_the_tie(stories260k_dir, prompt, oracle, backend):
    # Three 1-token prompts first: the row's prefill ends a 123-token step, whose 123 x 172 MLP tensor leaves 4
    # elements to F.silu's scalar tail (the README job's step held 183 tokens). The cpu backend of 264b778
    # picked 352 here, that of 6f13c1a picks 262: either is within float32 rounding of the tie.
    others = [(f"other-{i}", [1], SamplingParams(max_new_tokens=NUM_TOKENS + 8, ignore_eos=True)) for i in range(3)]
    row = ("row", prompt, SamplingParams(max_new_tokens=NUM_TOKENS, ignore_eos=True))
    tokens = _cbrun(stories260k_dir, others + [row], backend)["row"]
    assert tokens[:TIE_STEP] == oracle[:TIE_STEP]
    assert tokens[TIE_STEP] in (WINNER, RUNNER_UP)
    if tokens[TIE_STEP] == WINNER:
        assert tokens == oracle
