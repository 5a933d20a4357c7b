"""llama2.c's own greedy outputs for stories260K, token for token, batched together, chunked, at several page sizes."""

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from model_utils import assert_pool_balanced


@pytest.mark.parametrize("page_size", [4, 16, 64])
def test_engine_reproduces_llama2c_goldens(stories260k_dir, reference_greedy, page_size):
    prompts = [line["prompt_token_ids"] for line in reference_greedy]
    config = EngineConfig(page_size=page_size, max_batch_tokens=16)
    # llama2.c runs positions 0 .. max_positions - 1, so it generates at most max_positions - len(prompt) + 1 tokens.
    engine = LLMEngine.from_pretrained(str(stories260k_dir), config)
    requests = [(i, line["prompt_token_ids"],
                 SamplingParams(max_new_tokens=line["max_positions"] - len(line["prompt_token_ids"]) + 1))
                for i, line in enumerate(reference_greedy)]
    outputs = {o.request_id: o for o in engine.generate(requests)}
    for i, line in enumerate(reference_greedy):
        assert outputs[i].output_token_ids == line["output_token_ids"], f"line {i}: {line['prompt']!r}"
    assert len(outputs) == len(prompts)
    assert_pool_balanced(engine)
