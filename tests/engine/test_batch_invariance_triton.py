"""``engine.batch_invariant = "on"`` on the GPU's kernels, run on the CPU: Triton attention and the Triton
invariant matmul and RMSNorm (``cbrun.kernels.batch_invariant``) in Triton's interpreter, on a tiny random Llama.

The CUDA path is the same engine code with the same kernels compiled; here every launch is interpreted, so the
model is tiny and the rows are few. A seeded row's tokens and logprob bits are the same alone and in batches of
other sampled, greedy and penalised rows, with prefills chunked by a small token budget.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from cbrun.kernels.batch_invariant import triton_invariant_unavailable_reason  # noqa: E402
from tests.model_utils import random_model_dir, random_prompts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    triton_invariant_unavailable_reason(DEVICE, torch.float32) is not None,
    reason=f"Triton invariant kernels: {triton_invariant_unavailable_reason(DEVICE, torch.float32)}",
)

VOCAB = 96
PROMPTS = random_prompts(8, VOCAB, 2, 14, seed=11)
CONFIG = dict(
    device=DEVICE,
    dtype="float32",
    attention_backend="triton",
    batch_invariant="on",
    page_size=4,
    num_blocks=128,
    max_batch_tokens=16,  # prefills of up to 14 tokens are chunked beside other rows
    allow_block_sharing=False,
    cuda_graphs="off",
)


def _engine() -> LLMEngine:
    model = random_model_dir("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1)
    return LLMEngine.from_pretrained(str(model), EngineConfig(**CONFIG))


def _targets() -> list:
    return [
        (("t", row), PROMPTS[row], SamplingParams(max_new_tokens=4, temperature=0.9, seed=31 + row, logprobs=2))
        for row in range(2)
    ]


def _others() -> list:
    kinds = [
        SamplingParams(max_new_tokens=3),
        SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, seed=5),
        SamplingParams(max_new_tokens=3, temperature=1.0, repetition_penalty=1.2, seed=6),
    ]
    return [(("o", j), PROMPTS[2 + j], kinds[j % 3]) for j in range(5)]


def _bits(outputs, ids) -> dict:
    found = {o.request_id: o for o in outputs}
    return {i: (found[i].output_token_ids, found[i].logprobs) for i in ids}


def test_seeded_rows_equal_alone_and_in_batches_on_the_triton_kernels():
    engine = _engine()
    lean = engine.model_runner.lean_model
    assert lean is not None and lean.invariant_kernels is not None  # the Triton kernels run this forward pass
    targets = _targets()
    alone = {rid: _bits(engine.generate([(rid, p, sp)]), [rid])[rid] for rid, p, sp in targets}
    batched = _bits(engine.generate(_others()[:2] + targets + _others()[2:]), alone)
    assert batched == alone
    assert all(len(tokens) == 4 and logprobs for tokens, logprobs in alone.values())
