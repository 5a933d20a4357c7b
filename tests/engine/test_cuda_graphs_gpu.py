"""Real CUDA graphs (needs a GPU; skipped elsewhere): greedy outputs with graphs on equal graphs off, token for
token, and captures stay within the buckets. The CPU counterpart is tests/engine/test_cuda_graphs.py."""

import pytest
import torch

from tests.engine.test_cuda_graphs import MODELS, generate, shared_prefix_prompts
from tests.model_utils import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB = 128
CUDA = {"device": "cuda", "attention_backend": "triton", "dtype": "float32"}


@pytest.mark.parametrize("model", list(MODELS))
def test_cuda_graphs_equal_eager(model):
    prompts = shared_prefix_prompts()
    eager, _ = generate(model, prompts, cuda_graphs="off", **CUDA)
    graphed, engine = generate(model, prompts, cuda_graphs="on", **CUDA)
    assert graphed == eager
    stats = engine.stats
    assert 0 < stats.num_cuda_graph_captures <= len(engine.model_runner.graph_buckets.sizes)
    assert stats.num_cuda_graph_captures <= stats.num_cuda_graph_replays < stats.num_steps


def test_cuda_graphs_equal_eager_with_speculation_and_async_off():
    pattern = random_prompts(1, VOCAB, 5, 5, seed=9)[0]
    prompts = [pattern * 4, pattern[:3] * 5]
    config = {
        "new_tokens": 16,
        "speculative": "ngram",
        "num_speculative_tokens": 3,
        "speculative_row_cost": 0.0,
        "async_batching": "off",
        **CUDA,
    }
    eager, _ = generate("qwen2", prompts, cuda_graphs="off", **config)
    graphed, engine = generate("qwen2", prompts, cuda_graphs="on", **config)
    assert graphed == eager and engine.stats.num_cuda_graph_replays > 0
