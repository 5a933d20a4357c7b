"""How often a step makes the host wait for the device, per kind of row: one read-back is the design.

On a GPU each host read of a device value (``.tolist()``, ``.item()``, ``bool(t)``, ``nonzero``) and each upload
from pageable memory (``torch.tensor(values, device=cuda)``) waits for the work queued before it, the forward pass
included, so async batching loses its overlap. The CPU stands in for the device: ``waits_for_device`` is patched
on (the sampler takes its device paths), a dispatch mode counts the ops that read a value back (the same hook the
graph emulation uses to refuse a host read at capture), and ``Tensor.tolist`` / ``Tensor.item`` / ``torch.tensor``
are counted by the function that called them. The step's one read-back of its sampled ids
(``StepHandle.token_ids``) is counted apart; the forward pass is not counted (its graph capture is checked apart).
"""

from __future__ import annotations

import sys
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.sample import sampler, step
from cbrun.engine.structured_output.params import StructuredOutputsParams
from tests.model_utils import random_llama_dir, random_prompts

VOCAB = 128
#: Ops whose result's shape or value the host must know: each waits for the device.
READS_BACK = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.nonzero_numpy.default",
    "aten.is_nonzero.default",
    "aten.masked_select.default",
    "aten.unique_consecutive.default",
    "aten._unique2.default",
}


def reads_back(func, args) -> bool:
    """Whether a dispatched op waits for the device: a read-back op, or indexing by a boolean mask (its result's
    shape is the mask's count)."""
    if str(func) in READS_BACK:
        return True
    if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
    return False


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class StepSyncs(TorchDispatchMode):
    """Counts, while active and outside the forward pass, the host reads of device values and the uploads that
    would wait on a device, each named by the function that made it; ``readbacks`` counts the step's own
    read-back (``StepHandle.token_ids``).

    "Device values" are told apart on the CPU as the graph emulation tells a region's own tensors: by storage, a
    tensor is on the device when an op made it from one that is, starting from the forward pass's logits (host
    tensors, such as the grammar bitmask the host fills, are not counted when read).
    """

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.readbacks = 0
        self.paused = False
        #: storage -> a weak reference to a device tensor in it (alive: the storage is not freed and reused)
        self.on_device: dict[int, weakref.ref] = {}

    def is_on_device(self, t: torch.Tensor) -> bool:
        ref = self.on_device.get(_storage(t))
        return ref is not None and ref() is not None

    def mark(self, t: torch.Tensor) -> None:
        self.on_device[_storage(t)] = weakref.ref(t)

    def record(self, what: str, depth: int) -> None:
        if self.paused:
            return
        frame = sys._getframe(depth)
        while frame is not None and not frame.f_globals.get("__name__", "").startswith("cbrun"):
            frame = frame.f_back
        where = f"{frame.f_globals['__name__']}.{frame.f_code.co_name}" if frame is not None else "?"
        if where == "cbrun.engine.sample.step.token_ids":
            self.readbacks += 1
        elif where != "cbrun.engine.worker.device.to_device":  # the pinned, non-blocking upload
            self.syncs.append(f"{what} in {where}")

    def read(self, what: str, tensor: torch.Tensor, depth: int) -> None:
        # NOTE: the step's read-back is of a device tensor even when the CPU made it without the logits (zeros)
        if self.is_on_device(tensor) or sys._getframe(depth).f_code.co_name == "token_ids":
            self.record(what, depth + 1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        from_device = any(self.is_on_device(t) for t in inputs)
        if from_device and reads_back(func, args):
            self.record(str(func).split(".")[1], 2)
        result = func(*args, **(kwargs or {}))
        if from_device:
            for t in tree_flatten(result)[0]:
                if isinstance(t, torch.Tensor):
                    self.mark(t)
        return result


@pytest.fixture
def counter(monkeypatch):
    return install_counter(monkeypatch)


def install_counter(monkeypatch: pytest.MonkeyPatch) -> StepSyncs:
    """A ``StepSyncs`` whose counting hooks ``monkeypatch`` installs (``benchmarks.step_syncs`` uses it too)."""
    for module in (sampler, step):
        monkeypatch.setattr(module, "waits_for_device", lambda device: True)
    syncs = StepSyncs()
    tolist, item, tensor = torch.Tensor.tolist, torch.Tensor.item, torch.tensor

    def counted_tolist(self):
        syncs.read("tolist", self, 2)
        return tolist(self)

    def counted_item(self):
        syncs.read("item", self, 2)
        return item(self)

    def counted_tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            syncs.record("upload", 2)
        return tensor(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    monkeypatch.setattr(torch.Tensor, "item", counted_item)
    monkeypatch.setattr(torch, "tensor", counted_tensor)
    return syncs


def engine_for(config: EngineConfig, syncs: StepSyncs, model_dir=None) -> LLMEngine:
    engine = LLMEngine.from_pretrained(str(model_dir or random_llama_dir(VOCAB)), config)
    forward = engine.model_runner._forward

    def uncounted_forward(*args):
        syncs.paused = True
        try:
            logits = forward(*args)
        finally:
            syncs.paused = False
        syncs.mark(logits)  # the device's values, from here on
        return logits

    engine.model_runner._forward = uncounted_forward
    return engine


def count_steps(config: EngineConfig, params: SamplingParams, syncs: StepSyncs, num_rows: int = 4, model_dir=None):
    """(read-backs per step, other syncs per step, the engine's stats) over the steady steps of ``num_rows`` rows (the first step,
    which builds per-engine state, is not counted)."""
    engine = engine_for(config, syncs, model_dir)
    prompts = random_prompts(num_rows, min(VOCAB, engine.model.config.vocab_size), 6, 12, seed=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt * 2, params)
    while not engine.scheduler.running:  # a constrained row waits for its grammar
        engine.step()
    steps, readbacks, found = 0, [], []
    with syncs:
        while engine.has_unfinished_requests() and steps < 6:
            syncs.syncs, syncs.readbacks = [], 0
            engine.step()
            steps += 1
            readbacks.append(syncs.readbacks)
            found.append(list(syncs.syncs))
    return readbacks, found, engine.stats


CONFIG = EngineConfig(page_size=4, num_blocks=200, max_batch_tokens=64, max_requests_per_batch=8)
SCORING = EngineConfig(page_size=4, num_blocks=200, max_batch_tokens=16, max_requests_per_batch=8)
NGRAM = EngineConfig(
    page_size=4, num_blocks=200, max_batch_tokens=64, max_requests_per_batch=8, speculative="ngram", ngram_min=1
)
STRUCTURED = EngineConfig(page_size=16, max_batch_tokens=512, max_requests_per_batch=32)
REGEX = r"[a-c]{2,5}-\d{2}"


def _params(**fields) -> SamplingParams:
    return SamplingParams(max_new_tokens=8, **fields)


#: Per row kind: its params, its engine settings, whether it needs a tokenizer (a grammar), and the host waits a
#: step makes besides its one read-back, as measured (lowering one is a fix; raising one fails here):
#: (log-probabilities and prompt log-probabilities ride in the ids' read-back as float64 bit patterns: none more)
#: (a sampled verify step is verified at launch and its accept flags and tokens ride in the read-back too)
#: (a constrained step's bitmask is filled before its launch, which applies it: its rows ride in the read-back)
KINDS = {
    "greedy": (_params(), CONFIG, False, 0),
    "sampled": (_params(temperature=0.8, seed=1), CONFIG, False, 0),
    "top_p": (_params(temperature=0.6, top_p=0.9, seed=1), CONFIG, False, 0),
    "top_k": (_params(temperature=0.6, top_k=20, seed=1), CONFIG, False, 0),
    "min_p": (_params(temperature=0.6, min_p=0.05, seed=1), CONFIG, False, 0),
    "all_filters": (_params(temperature=0.7, top_k=30, top_p=0.8, min_p=0.01, seed=1), CONFIG, False, 0),
    "min_new_tokens": (_params(temperature=0.8, min_new_tokens=4, seed=1), CONFIG, False, 0),
    "penalised": (_params(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5, seed=1), CONFIG, False, 0),
    "penalised_greedy": (_params(presence_penalty=0.4), CONFIG, False, 0),
    "logprobs": (_params(temperature=0.8, logprobs=3, seed=1), CONFIG, False, 0),
    "greedy_logprobs": (_params(logprobs=2), CONFIG, False, 0),
    "scoring": (SamplingParams(max_new_tokens=4, prompt_logprobs_from=1), SCORING, False, 0),
    "scoring_sampled": (
        SamplingParams(max_new_tokens=4, prompt_logprobs_from=1, temperature=0.7, logprobs=1, seed=5),
        SCORING,
        False,
        0,
    ),
    "ngram_greedy": (SamplingParams(max_new_tokens=16), NGRAM, False, 0),
    "ngram_sampled": (SamplingParams(max_new_tokens=16, temperature=0.3, seed=2), NGRAM, False, 0),
    "ngram_sampled_logprobs": (
        SamplingParams(max_new_tokens=16, temperature=0.3, top_p=0.9, logprobs=2, seed=2),
        NGRAM,
        False,
        0,
    ),
    "constrained": (_params(structured_outputs=StructuredOutputsParams(regex=REGEX)), STRUCTURED, True, 0),
    "constrained_sampled": (
        _params(temperature=0.9, seed=3, structured_outputs=StructuredOutputsParams(regex=REGEX)),
        STRUCTURED,
        True,
        0,
    ),
}


@pytest.fixture(scope="module")
def demo_model_dir(tmp_path_factory):
    from cbrun.jobs.cli.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("syncs") / "model", max_position_embeddings=512)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_step_reads_back_once_and_waits_no_more_than_measured(counter, demo_model_dir, kind):
    params, config, structured, most = KINDS[kind]
    readbacks, syncs, stats = count_steps(config, params, counter, model_dir=demo_model_dir if structured else None)
    if config.speculative != "off":
        assert stats.num_verify_steps > 0  # the verify steps were counted
    ran = [n for n in readbacks if n]
    assert ran and all(n == 1 for n in ran), readbacks  # a step without a plan (grammars compiling) reads nothing
    assert max(len(s) for s in syncs) <= most, syncs
    if most == 0:
        assert syncs == [[] for _ in syncs]
