"""llama2.c's own greedy outputs for stories260K, token for token, batched together, chunked, at several page sizes."""

import pytest

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from tests.model_utils import assert_pool_balanced


@pytest.mark.parametrize("page_size", [4, 16, 64])
def test_engine_reproduces_llama2c_goldens(stories260k_dir, reference_greedy, page_size):
    prompts = [line["prompt_token_ids"] for line in reference_greedy]
    config = EngineConfig(page_size=page_size, max_batch_tokens=16)
    # llama2.c runs positions 0 .. max_positions - 1, so it generates at most max_positions - len(prompt) + 1 tokens.
    engine = LLMEngine.from_pretrained(str(stories260k_dir), config)
    requests = [
        (
            i,
            line["prompt_token_ids"],
            SamplingParams(max_new_tokens=line["max_positions"] - len(line["prompt_token_ids"]) + 1),
        )
        for i, line in enumerate(reference_greedy)
    ]
    outputs = {o.request_id: o for o in engine.generate(requests)}
    for i, line in enumerate(reference_greedy):
        assert outputs[i].output_token_ids == line["output_token_ids"], f"line {i}: {line['prompt']!r}"
    assert len(outputs) == len(prompts)
    assert_pool_balanced(engine)


@pytest.mark.parametrize("page_size", [4, 16, 64])
def test_job_reproduces_llama2c_goldens(stories260k_dir, reference_greedy, tmp_path, page_size):
    """The whole job path (Parquet in, cbrun run, Parquet out), all prompts in one job, chunked prefill forced."""
    from tests.golden_job import run_golden_job

    settings = [f"engine.page_size={page_size}", "engine.max_batch_tokens=16"]
    rows = run_golden_job(stories260k_dir, reference_greedy, tmp_path, tmp_path / f"out-{page_size}", settings)
    assert [r["row_index"] for r in rows] == list(range(len(reference_greedy)))
    for row, line in zip(rows, reference_greedy):
        assert row["completion_token_ids"] == line["output_token_ids"], line["prompt"]
