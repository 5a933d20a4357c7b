"""The engine's Triton attention path (interpreted on the CPU) gives the same greedy outputs as the PyTorch path."""

import pytest

from cbrun.engine import EngineConfig, SamplingParams
from tests.model_utils import random_llama_dir, random_prompts, run_engine

pytest.importorskip("triton")


def test_triton_backend_matches_torch_backend():
    model_dir = random_llama_dir(128)
    prompts = random_prompts(4, 128, 3, 20, seed=31)
    params = SamplingParams(max_new_tokens=4)
    outputs = {}
    for backend in ("torch", "triton"):
        config = EngineConfig(page_size=4, num_blocks=64, max_batch_tokens=16, attention_backend=backend)
        outputs[backend] = [
            o.output_token_ids for _, o in sorted(run_engine(model_dir, prompts, config, params).items())
        ]
    assert outputs["triton"] == outputs["torch"]
