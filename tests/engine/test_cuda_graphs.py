"""CUDA graphs emulated on the CPU (``cuda_graphs = "emulate"``): greedy outputs equal the eager engine's token for
token over every kind of step, only decode and uniform verify steps are graphed, and the emulation catches a
replay that reads tensors computed outside its capture."""

import pytest
import torch

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.worker.cuda_graphs import CudaGraphRunner, _Captured
from cbrun.engine.worker.graph_emulation import EmulatedGraph
from tests.model_utils import assert_pool_balanced, random_model_dir, random_prompts

VOCAB = 128
#: Full attention, every layer sliding (one allocator of ring blocks), and full and sliding layers mixed (two
#: allocators, so two sets of static slot mappings and block tables).
MODELS = {
    "llama": {},
    "qwen2": {},
    "mistral-window": {"sliding_window": 6},
    "qwen2-mixed": {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
}


def model_dir(name: str):
    return random_model_dir(name.split("-")[0], **MODELS[name])


def generate(model: str, prompts, *, new_tokens: int = 8, **config) -> tuple[list[list[int]], LLMEngine]:
    config = {"page_size": 4, "num_blocks": 128, "max_batch_tokens": 24, "max_requests_per_batch": 8, **config}
    engine = LLMEngine.from_pretrained(str(model_dir(model)), EngineConfig(loader="transformers", **config))
    params = SamplingParams(max_new_tokens=new_tokens)
    outputs = {o.request_id: o.output_token_ids for o in engine.generate((i, p, params) for i, p in enumerate(prompts))}
    assert_pool_balanced(engine)
    return [outputs[i] for i in range(len(prompts))], engine


def shared_prefix_prompts(n: int = 8, seed: int = 7) -> list[list[int]]:
    """Mixed lengths; half the prompts start with the same 9 tokens (prefix cache hits on 4-token pages)."""
    prompts = random_prompts(n, VOCAB, 1, 20, seed=seed)
    prefix = random_prompts(1, VOCAB, 9, 9, seed=seed + 1)[0]
    return [prefix + p if i % 2 else p for i, p in enumerate(prompts)]


def assert_emulation_equals_eager(model: str, prompts, **config) -> LLMEngine:
    eager, _ = generate(model, prompts, cuda_graphs="off", **config)
    graphed, engine = generate(model, prompts, cuda_graphs="emulate", **config)
    assert graphed == eager
    stats = engine.stats
    assert stats.num_cuda_graph_replays > 0
    assert 0 < stats.num_cuda_graph_captures <= stats.num_cuda_graph_replays < stats.num_steps  # prefills eager
    return engine


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_emulated_graphs_equal_eager_over_mixed_steps_and_prefix_sharing(model, backend):
    engine = assert_emulation_equals_eager(model, shared_prefix_prompts(), attention_backend=backend)
    if "sliding_window" not in MODELS[model]:  # prefix sharing is off for models with sliding windows
        assert engine.stats.num_cached_prompt_tokens > 0


@pytest.mark.parametrize("swap_gib", [0.0, 0.001])
def test_emulated_graphs_equal_eager_under_preemption(swap_gib):
    prompts = random_prompts(8, VOCAB, 1, 12, seed=5)
    engine = assert_emulation_equals_eager(
        "llama",
        prompts,
        new_tokens=16,
        num_blocks=10,
        cpu_offload_space=swap_gib,
        allow_block_sharing=False,
        attention_backend="cpu",
    )
    stats = engine.stats
    assert (stats.num_offloads > 0) if swap_gib else (stats.num_soft_resets > 0 and stats.num_offloads == 0)


def test_emulated_graphs_equal_eager_with_speculation():
    pattern = random_prompts(1, VOCAB, 5, 5, seed=9)[0]
    prompts = [pattern * 4, pattern[:3] * 5]
    engine = assert_emulation_equals_eager(
        "qwen2",
        prompts,
        new_tokens=16,
        speculative="ngram",
        num_speculative_tokens=3,
        attention_backend="cpu",
        speculative_row_cost=0.0,
    )
    assert engine.stats.num_verify_steps > 0
    shapes = engine.model_runner._graph_runner._graphs
    assert any(shape.query_len > 1 for shape in shapes)  # uniform verify steps were graphed too


def test_emulated_graphs_keep_seeded_sampled_rows():
    prompts = random_prompts(7, VOCAB, 2, 20, seed=23)
    outputs = {}
    for mode in ("off", "emulate"):
        engine = LLMEngine.from_pretrained(
            str(model_dir("qwen2")),
            EngineConfig(loader="transformers", page_size=4, num_blocks=128, max_batch_tokens=24, cuda_graphs=mode),
        )
        requests = (
            (i, p, SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=100 + i))
            for i, p in enumerate(prompts)
        )
        outputs[mode] = {o.request_id: o.output_token_ids for o in engine.generate(requests)}
    assert engine.stats.num_cuda_graph_replays > 0
    assert outputs["emulate"] == outputs["off"]


def test_emulated_graphs_with_async_batching_bookkeeping():
    """Async batching's path on the CPU (set by hand, as tests/engine/test_async_batching.py does): tokens the step
    in flight sampled are carried into the static input buffer on the device, and logits the host still reads are
    copied out of the graph's output before the next replay."""
    prompts = random_prompts(7, VOCAB, 2, 20, seed=29)

    def params(i):
        return (
            SamplingParams(max_new_tokens=10, temperature=0.8, seed=i) if i % 2 else SamplingParams(max_new_tokens=10)
        )

    outputs = {}
    for mode, overlap in (("off", False), ("emulate", True)):
        engine = LLMEngine.from_pretrained(
            str(model_dir("llama")),
            EngineConfig(loader="transformers", page_size=4, num_blocks=128, max_batch_tokens=24, cuda_graphs=mode),
        )
        engine.overlap_steps = engine.model_runner.async_batching = overlap
        outputs[mode] = {
            o.request_id: o.output_token_ids for o in engine.generate((i, p, params(i)) for i, p in enumerate(prompts))
        }
    assert engine.stats.num_cuda_graph_replays > 0
    assert outputs["emulate"] == outputs["off"]


def test_emulated_graphs_equal_eager_with_a_draft_model():
    prompts = random_prompts(3, VOCAB, 2, 10, seed=21)
    draft = str(model_dir("llama"))  # the target itself: every proposal is accepted, so verify steps are uniform
    engine = assert_emulation_equals_eager(
        "llama", prompts, speculative="draft", draft_model=draft, num_speculative_tokens=3, speculative_row_cost=0.0
    )
    assert engine.stats.num_accepted_tokens > 0
    assert any(shape.query_len == 4 for shape in engine.model_runner._graph_runner._graphs)


@pytest.mark.slow
def test_emulated_graphs_equal_eager_on_triton_interpreter():
    pytest.importorskip("triton")
    prompts = random_prompts(3, VOCAB, 2, 9, seed=11)
    assert_emulation_equals_eager("llama", prompts, new_tokens=3, attention_backend="triton")


def test_captures_are_bounded_by_the_buckets():
    prompts = random_prompts(8, VOCAB, 1, 12, seed=13)
    _, engine = generate("llama", prompts, cuda_graphs="emulate", new_tokens=12, attention_backend="cpu")
    runner = engine.model_runner._graph_runner
    assert {shape.num_requests for shape in runner._graphs} <= set(engine.model_runner.graph_buckets.sizes)
    assert all(shape.query_len == 1 for shape in runner._graphs)
    assert runner.num_captures == len(runner._graphs) <= len(engine.model_runner.graph_buckets.sizes)


def test_graphed_decode_passes_its_true_query_length():
    _, engine = generate("llama", random_prompts(3, VOCAB, 1, 5, seed=17), cuda_graphs="emulate", new_tokens=3)
    runner = engine.model_runner._graph_runner
    for shape in runner._graphs:
        md = runner._static_inputs(shape)[2]
        assert md.max_seqlen_q == shape.query_len == 1 and md.cu_seqlens_q.shape[0] == shape.num_requests + 1
        assert md.kernels_as_ops


def _capture_reusing_warm_up_metadata(self: CudaGraphRunner, shape, check_reads: bool = False) -> _Captured:
    """The fault this module guards against: the capture reuses the warm-up's metadata, so the per-layer slot
    mappings and block tables the warm-up cached in it (``GroupMetadata.for_layer``) feed every replay.
    ``check_reads``: capture with the emulation's check that only static tensors come from outside."""
    inputs = self._static_inputs(shape)
    self._forward(*inputs)
    graph = EmulatedGraph()
    with graph.capture(self._static_tensors() if check_reads else None):
        logits = self._forward(*inputs)
    return _Captured(graph, logits)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_emulation_catches_stale_metadata(monkeypatch, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    prompts = random_prompts(4, VOCAB, 2, 10, seed=3)
    config = {"attention_backend": backend, "new_tokens": 6 if backend == "torch" else 3}
    eager, _ = generate("llama", prompts, cuda_graphs="off", **config)
    monkeypatch.setattr(CudaGraphRunner, "_capture", _capture_reusing_warm_up_metadata)
    stale, engine = generate("llama", prompts, cuda_graphs="emulate", **config)
    assert engine.stats.num_cuda_graph_replays > 0
    assert stale != eager


def test_emulated_capture_refuses_tensors_computed_outside_it(monkeypatch):
    def capture(self, shape):
        return _capture_reusing_warm_up_metadata(self, shape, check_reads=True)

    monkeypatch.setattr(CudaGraphRunner, "_capture", capture)
    with pytest.raises(RuntimeError, match="computed outside"):
        generate(
            "llama",
            random_prompts(2, VOCAB, 2, 6, seed=3),
            cuda_graphs="emulate",
            new_tokens=3,
            attention_backend="torch",
        )


def test_emulated_graph_replays_recorded_work_over_new_values():
    x = torch.arange(4.0)
    scale = torch.tensor(2.0)
    out = torch.zeros(4)
    graph = EmulatedGraph()
    with graph.capture():
        y = (x * scale).to(torch.float64)  # a fresh tensor, and ``to`` that copies
        out.add_(y.float().cumsum(0))  # in place into a static output
    assert graph.num_ops > 0
    x.copy_(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    out.zero_()
    graph.replay()
    assert out.tolist() == [2.0, 4.0, 6.0, 8.0]
    assert y.tolist() == [2.0, 2.0, 2.0, 2.0]  # the recorded intermediate was rewritten in place


def test_emulated_capture_refuses_host_reads():
    x = torch.ones(3)
    graph = EmulatedGraph()
    with pytest.raises(RuntimeError, match="on the host"), graph.capture():
        if bool(x.sum() > 0):
            x.mul_(2)


def test_config_validates_cuda_graphs():
    assert EngineConfig(cuda_graphs="emulate").cuda_graphs == "emulate"
    with pytest.raises(ValueError, match="cuda_graphs must be one of"):
        EngineConfig(cuda_graphs="fake")
    with pytest.raises(ValueError, match="cuda_graph_max_batch_size"):
        EngineConfig(cuda_graph_max_batch_size=0)


def test_stats_count_graphs():
    _, engine = generate("llama", random_prompts(2, VOCAB, 1, 5, seed=19), cuda_graphs="emulate", new_tokens=4)
    stats = engine.stats.as_dict()
    assert stats["num_cuda_graph_captures"] >= 1 and stats["num_cuda_graph_replays"] >= 3
    _, eager = generate("llama", random_prompts(2, VOCAB, 1, 5, seed=19), cuda_graphs="off", new_tokens=4)
    assert eager.stats.num_cuda_graph_captures == eager.stats.num_cuda_graph_replays == 0
