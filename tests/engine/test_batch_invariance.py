"""``engine.batch_invariant = "on"``: a seeded row's tokens and logprob bits are the same alone and in any batch.

The rows are compared alone (one request in the engine), in batches of 3, 32 and 64 requests among other greedy,
sampled and penalised rows, with prefills chunked by a small token budget, under preemption (a small cache, with
recompute and with CPU swap), and with a shared prompt prefix served from the prefix cache. Rows chosen at random
seldom draw a token whose choice a 1e-5 change of the logits would flip, so ``test_boundary_seed_flips_off_but_not_on``
searches for a seed whose uniform number lands between the cumulative probabilities of the row's logits alone and in
its batch under "off", and shows the token it draws differ there and not under "on".
"""

from __future__ import annotations

import random

import pytest
import torch

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.sample import sampler
from cbrun.engine.sample.sampler import inverse_cdf
from cbrun.kernels.cpu_attention import unavailable_reason
from tests.model_utils import assert_pool_balanced, random_model_dir, random_prompts

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"C kernel: {unavailable_reason()}")

VOCAB = 128
MODEL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, max_position_embeddings=256)
PROMPTS = random_prompts(64, VOCAB, 1, 30, seed=5)
BASE = dict(page_size=4, num_blocks=1024, max_batch_tokens=64, allow_block_sharing=False)
TARGETS = range(4)  # rows under test, n = 2 samples each


def model_dir():
    return random_model_dir("llama", **MODEL)


def run(requests, invariant: str = "on", **overrides) -> dict:
    engine = LLMEngine.from_pretrained(
        str(model_dir()), EngineConfig(**{**BASE, "batch_invariant": invariant, **overrides})
    )
    outputs = {o.request_id: o for o in engine.generate(requests)}
    assert_pool_balanced(engine)
    return outputs


def target_requests(temperature: float) -> list:
    # n = 2: two samples of each row, each with its own seed (as a job derives them)
    return [
        (
            (row, sample),
            PROMPTS[row],
            SamplingParams(
                max_new_tokens=10, temperature=temperature, seed=7919 * row + sample, logprobs=2, ignore_eos=True
            ),
        )
        for row in TARGETS
        for sample in range(2)
    ]


def fillers(count: int, prompts=PROMPTS) -> list:
    kinds = [
        SamplingParams(max_new_tokens=12),
        SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9),
        SamplingParams(max_new_tokens=9, temperature=1.0, repetition_penalty=1.3, presence_penalty=0.2),
    ]
    return [(f"f{j}", prompts[(j + 4) % len(prompts)], kinds[j % 3]) for j in range(count)]


def tokens_and_bits(outputs: dict, ids) -> dict:
    """{request id: (tokens, logprobs)}: Python floats of float32 logprobs, so == compares their bits."""
    return {i: (outputs[i].output_token_ids, outputs[i].logprobs) for i in ids}


@pytest.fixture(scope="module", params=[0.6, 1.0])
def alone(request):
    temperature = request.param
    targets = target_requests(temperature)
    return temperature, {rid: tokens_and_bits(run([(rid, p, sp)]), [rid])[rid] for rid, p, sp in targets}


@pytest.mark.parametrize("batch_size", [3, 32, 64])
def test_seeded_rows_equal_alone_and_in_batches(alone, batch_size):
    temperature, want = alone
    targets = target_requests(temperature)[: min(batch_size, 8)]
    requests = targets + fillers(batch_size - len(targets))
    random.Random(batch_size).shuffle(requests)
    got = tokens_and_bits(run(requests, max_batch_tokens=13), [rid for rid, _, _ in targets])
    assert got == {rid: want[rid] for rid, _, _ in targets}


@pytest.mark.parametrize("swap", [0.0, 0.01])
def test_seeded_rows_equal_under_preemption(alone, swap):
    temperature, want = alone
    targets = target_requests(temperature)
    engine_overrides = dict(num_blocks=28, max_batch_tokens=16, cpu_offload_space=swap)
    engine = LLMEngine.from_pretrained(
        str(model_dir()), EngineConfig(**{**BASE, "batch_invariant": "on", **engine_overrides})
    )
    outputs = {o.request_id: o for o in engine.generate(targets + fillers(16))}
    assert engine.stats.num_offloads + engine.stats.num_soft_resets > 0  # preemption did happen
    assert tokens_and_bits(outputs, want) == want


def test_seeded_rows_equal_with_prefix_sharing():
    # Every row after a shared 12-token prefix: in the batch the prefix's blocks are computed once and shared.
    prefix = random_prompts(1, VOCAB, 12, 12, seed=9)[0]
    prompts = [prefix + p for p in PROMPTS[:16]]
    targets = [
        (
            row,
            prompts[row],
            SamplingParams(max_new_tokens=8, temperature=0.8, seed=31 + row, logprobs=1, ignore_eos=True),
        )
        for row in range(4)
    ]
    want = {rid: tokens_and_bits(run([(rid, p, sp)]), [rid])[rid] for rid, p, sp in targets}
    engine = LLMEngine.from_pretrained(
        str(model_dir()), EngineConfig(**{**BASE, "batch_invariant": "on", "allow_block_sharing": True})
    )
    outputs = {o.request_id: o for o in engine.generate(targets + fillers(12, prompts))}
    assert engine.stats.prefix_hit_rate > 0
    assert tokens_and_bits(outputs, want) == want


class _LogitsRecorder:
    """Wraps the engine's lean forward pass and keeps each step's logits."""

    def __init__(self, lean) -> None:
        self._lean = lean
        self.steps: list[torch.Tensor] = []

    def __getattr__(self, name):
        return getattr(self._lean, name)

    def __call__(self, *args):
        logits = self._lean(*args)
        self.steps.append(logits.clone())
        return logits


def first_logits(requests, target, invariant: str) -> torch.Tensor:
    """The logits row of ``target``'s first sampled token, in an engine running ``requests``."""
    engine = LLMEngine.from_pretrained(str(model_dir()), EngineConfig(**{**BASE, "batch_invariant": invariant}))
    recorder = _LogitsRecorder(engine.model_runner.lean_model)
    engine.model_runner.lean_model = recorder
    list(engine.generate([(rid, p, SamplingParams(max_new_tokens=1)) for rid, p in requests]))
    # requests prefill in one step (the budget fits them), in the order given: the target's row is its index
    index = [rid for rid, _ in requests].index(target)
    return recorder.steps[0][index]


def boundary_seed(a: torch.Tensor, b: torch.Tensor, temperature: float, tries: int = 1 << 21) -> int | None:
    """A seed whose first draw (output position 0) picks different tokens from logits ``a`` and ``b``: the
    sampler's own draw (``inverse_cdf`` of softmax(logits / temperature) at ``sampler.uniform``)."""
    temp = torch.tensor([temperature], dtype=torch.float32)
    probs = [torch.softmax(x[None] / temp[:, None], dim=1) for x in (a, b)]
    chunk = 1 << 16
    for start in range(0, tries, chunk):
        seeds = torch.arange(start, start + chunk, dtype=torch.int64)
        u = sampler.uniform(seeds, torch.zeros_like(seeds), sampler.PLAIN)
        drawn = [inverse_cdf(p.expand(chunk, -1), u) for p in probs]
        differ = (drawn[0] != drawn[1]).nonzero()
        if differ.numel():
            return start + int(differ[0, 0])
    return None


def test_boundary_seed_flips_off_but_not_on():
    # A one-token prompt: alone, its prefill is a 1-row GEMM (a GEMV), in the batch a row of a 60-row one.
    target, temperature = "t", 0.8
    prompt = [17]
    others = [(f"o{j}", p) for j, p in enumerate(random_prompts(6, VOCAB, 8, 12, seed=11))]
    batch = [(target, prompt)] + others
    off_alone, off_batched = first_logits([(target, prompt)], target, "off"), first_logits(batch, target, "off")
    assert not torch.equal(off_alone, off_batched)  # "off": the row's logits change with its batch
    seed = boundary_seed(off_alone, off_batched, temperature)
    assert seed is not None

    def first_token(requests, invariant: str) -> int:
        params = SamplingParams(max_new_tokens=1, temperature=temperature, seed=seed)
        full = [(rid, p, params if rid == target else SamplingParams(max_new_tokens=1)) for rid, p in requests]
        return run(full, invariant)[target].output_token_ids[0]

    assert first_token([(target, prompt)], "off") != first_token(batch, "off")
    assert first_token([(target, prompt)], "on") == first_token(batch, "on")
    on_alone, on_batched = first_logits([(target, prompt)], target, "on"), first_logits(batch, target, "on")
    assert torch.equal(on_alone, on_batched)


def test_chunked_prefill_equals_one_chunk_and_decode():
    # "on": a prompt token's K/V and the logits do not depend on how the prefill was chunked.
    prompt = PROMPTS[3] + PROMPTS[4]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5, logprobs=3, ignore_eos=True)
    results = [tokens_and_bits(run([(0, prompt, params)], max_batch_tokens=b), [0])[0] for b in (64, 7, 1)]
    assert results[0] == results[1] == results[2]


@pytest.mark.parametrize(
    "setting,value,named",
    [
        ("model_impl", "transformers", "lean forward pass"),
        ("attention_backend", "torch", "C CPU kernel"),
        ("speculative", "ngram", "speculative"),
        ("linear_backend", "torch", "linear_backend"),
    ],
)
def test_on_refused_where_it_cannot_hold(setting, value, named):
    with pytest.raises(ValueError, match=f"batch_invariant.*{named}"):
        LLMEngine.from_pretrained(str(model_dir()), EngineConfig(**{**BASE, "batch_invariant": "on", setting: value}))


def test_bad_value_names_the_setting():
    with pytest.raises(ValueError, match="batch_invariant must be one of"):
        EngineConfig(batch_invariant="yes")


def test_converted_stories260k_rows_equal_alone_and_in_a_batch(stories260k_dir):
    # A trained model converted from llama2.c (head_dim 8, its real distributions), n = 2 per row, temperature 0.8.
    prompts = random_prompts(24, 512, 2, 40, seed=2)
    config = EngineConfig(page_size=16, num_blocks=256, max_batch_tokens=96, batch_invariant="on", num_threads=1)

    def params(row: int, sample: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=24, temperature=0.8, seed=100 * row + sample, logprobs=1, ignore_eos=True)

    targets = [((row, s), prompts[row], params(row, s)) for row in range(3) for s in range(2)]
    engine = LLMEngine.from_pretrained(str(stories260k_dir), config)
    want = {
        rid: tokens_and_bits({o.request_id: o for o in engine.generate([(rid, p, sp)])}, [rid])[rid]
        for rid, p, sp in targets
    }
    others = [(f"o{j}", prompts[j], params(j, 0)) for j in range(3, 24)]
    batch = targets + others
    random.Random(1).shuffle(batch)
    got = tokens_and_bits({o.request_id: o for o in engine.generate(batch)}, want)
    assert got == want


def test_rows_alone_sampler_draws_what_the_batched_one_draws(monkeypatch):
    # Off the CPU a batch-invariant engine samples each row in its own (1, V) call (StepSampler.rows_alone); on the
    # CPU, where the batched sampler is row-wise, both must give the same tokens and logprob bits.
    seeded = [
        SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=20, seed=3),
        SamplingParams(max_new_tokens=9, temperature=1.0, repetition_penalty=1.3, presence_penalty=0.2, seed=4),
        SamplingParams(max_new_tokens=6, temperature=0.9, min_p=0.05, logprobs=3, seed=5),
    ]
    requests = target_requests(0.8) + [(f"s{j}", PROMPTS[10 + j], seeded[j % 3]) for j in range(6)]
    from cbrun.engine.sample import step

    calls: list[int] = []  # rows per sampler call

    def counted(logits, *args, **kwargs):
        calls.append(logits.shape[0])
        return sample(logits, *args, **kwargs)

    sample = step.sample
    monkeypatch.setattr(step, "sample", counted)
    engine = LLMEngine.from_pretrained(str(model_dir()), EngineConfig(**{**BASE, "batch_invariant": "on"}))
    assert not engine.sampler.rows_alone  # the CPU keeps rows batched
    batched = tokens_and_bits({o.request_id: o for o in engine.generate(requests)}, [r[0] for r in requests])
    assert max(calls) > 1
    calls.clear()
    engine.sampler.rows_alone = True
    alone = tokens_and_bits({o.request_id: o for o in engine.generate(requests)}, [r[0] for r in requests])
    assert calls and max(calls) == 1
    assert alone == batched


def test_cuda_blockers_name_what_stops_the_invariant_kernels(monkeypatch):
    # No GPU here: the decision itself, with the Triton kernels' own check answered as on a capable part.
    from cbrun.engine.worker import backends
    from cbrun.kernels import batch_invariant

    on = dict(device="cuda", batch_invariant="on")
    assert "CUDA" in backends.batch_invariant_blocker(EngineConfig(**on), False, False, True, torch.bfloat16)
    monkeypatch.setattr(batch_invariant, "triton_invariant_unavailable_reason", lambda device, dtype: None)
    assert backends.batch_invariant_blocker(EngineConfig(**on), False, False, True, torch.bfloat16) is None
    reasons = {
        "attention": backends.batch_invariant_blocker(
            EngineConfig(**on, attention_backend="torch"), False, False, False, torch.bfloat16
        ),
        "graphs": backends.batch_invariant_blocker(EngineConfig(**on), False, True, True, torch.bfloat16),
        "speculative": backends.batch_invariant_blocker(
            EngineConfig(**on, speculative="ngram"), False, False, True, torch.bfloat16
        ),
    }
    assert "Triton kernels" in reasons["attention"] and "CUDA graphs" in reasons["graphs"]
    assert "speculative" in reasons["speculative"]
    # "auto" CUDA graphs give way to batch_invariant = on; "on" is refused by name.
    assert "batch_invariant" in backends.cuda_graphs_blocker(EngineConfig(**on), True)
    assert backends.cuda_graphs_blocker(EngineConfig(device="cuda"), True) is None


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_moe_seeded_rows_equal_alone_and_in_a_batch(model_type):
    # A MoE block under "on" runs each expert over its own rows through the invariant linear: how many tokens an
    # expert gets depends on the batch, a token's output must not.
    model = str(random_model_dir(model_type, **MODEL))
    config = EngineConfig(**{**BASE, "batch_invariant": "on"})
    targets = target_requests(0.9)[:4]
    engine = LLMEngine.from_pretrained(model, config)
    alone = {
        rid: tokens_and_bits({o.request_id: o for o in engine.generate([(rid, p, sp)])}, [rid])[rid]
        for rid, p, sp in targets
    }
    batch = fillers(8)[:4] + targets + fillers(8)[4:]
    assert tokens_and_bits({o.request_id: o for o in engine.generate(batch)}, alone) == alone
