"""The backends of ``cbrun bench``, each run in a process of its own.

Backends (all greedy but the ``cbrun-sampled*`` ones, all on the same rows):

- ``cbrun``: ``LLMEngine.generate``, continuous batching. The reference: every other backend's outputs are compared
  with its outputs, token for token, per row.
- ``cbrun-nosharing``: the same with ``allow_block_sharing=False``: every prompt token is computed. Beside cbrun it
  shows what prefix sharing buys (the report adds a line on it).
- ``cbrun-static``: the same engine fed static batches: N requests are added together and stepped until all
  finish, then the next N. Isolates what continuous admission buys.
- ``hf-generate``: transformers ``generate`` on static left-padded batches of N rows. A per-row length criterion
  finishes each row at its own ``max_new_tokens`` (and the model's EOS criterion at the stop token), so a batch ends
  when its slowest row does.
- ``hf-cb``: transformers' continuous batching (``continuous_batching_context_manager`` + ``add_request``, the loop
  inside ``generate_batch``, which cannot take a per-row ``max_new_tokens``), with cbrun's page size, token and
  request budgets, block count and block sharing (on).
- ``cbrun-defaults``: ``LLMEngine.generate`` with ``EngineConfig()`` as it comes (its own thread count, budgets and
  cache size; ``--threads`` is not applied): what a user gets without tuning, beside the tuned ``cbrun``.
- ``cbrun-budgets``: ``cbrun`` again at each ``--budgets R/T`` (``max_requests_per_batch`` R, ``max_batch_tokens``
  T), one row per budget: the tuned settings beside the reference's.
- ``cbrun-command``: the whole flags-only ``cbrun run`` command, defaults, from process start to exit
  (``command_backend``).
- ``cbrun-sampled``: ``cbrun`` with temperature 0.8 and top_p 0.95, row i seeded i (``SAMPLED``);
  ``cbrun-sampled-full``: the same plus repetition_penalty 1.1 and logprobs 5 (``SAMPLED_FULL``). With
  ``ignore_eos`` (``random-llama-100m``) every row generates the same tokens as greedy, so the tok/s compare the
  samplers alone; their outputs differ from cbrun's greedy ones by design. ``cbrun-sampled-llama3``: Llama-3's
  ``generation_config.json`` defaults, temperature 0.6 and top_p 0.9 (``SAMPLED_LLAMA3``), the setting most jobs
  adopt from their model.
- ``vllm``: vLLM's CPU backend in its own virtual environment and process (``--vllm-python``; ``vllm_backend``);
  skipped, and said so, without it.
"""

from __future__ import annotations

import gc
import resource
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from cbrun.bench.command_backend import run_command
from cbrun.bench.measure import RunResult, current_rss_mib, git_commit, peak_rss_mib, reset_peak_rss, timed
from cbrun.bench.vllm_backend import VllmOptions, run_vllm
from cbrun.bench.workloads import Workload, cut_output

BACKENDS = (
    "cbrun",
    "cbrun-defaults",
    "cbrun-budgets",
    "cbrun-command",
    "cbrun-nosharing",
    "cbrun-static",
    "hf-generate",
    "hf-cb",
    "vllm",
    "cbrun-sampled",
    "cbrun-sampled-full",
    "cbrun-sampled-llama3",
)
#: The sampling settings of ``cbrun-sampled`` and ``cbrun-sampled-full`` (each row also gets seed = its index).
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
SAMPLED_FULL = {**SAMPLED, "repetition_penalty": 1.1, "logprobs": 5}
#: Llama-3's generation defaults (its ``generation_config.json``), which jobs adopt when the manifest sets none.
SAMPLED_LLAMA3 = {"temperature": 0.6, "top_p": 0.9}
SAMPLING_BACKENDS = {
    "cbrun-sampled": SAMPLED,
    "cbrun-sampled-full": SAMPLED_FULL,
    "cbrun-sampled-llama3": SAMPLED_LLAMA3,
}


def run_cbrun(
    workload: Workload, engine_config, backend: str = "cbrun", setting: str = "", sampling: dict | None = None
) -> RunResult:
    """Continuous batching: every row handed to ``LLMEngine.generate`` at once.

    Args:
        workload: the rows.
        engine_config: the ``EngineConfig`` (``cbrun-nosharing`` passes one with ``allow_block_sharing=False``).
        backend: the name the result carries.
        setting: the setting the result carries (``cbrun-budgets``: its budget).
        sampling: ``SamplingParams`` fields every row takes (with seed = its index); None: greedy.
    """
    from cbrun.engine import LLMEngine

    engine = LLMEngine.from_pretrained(str(workload.model_dir), engine_config)
    n = len(workload.prompts)
    requests = [
        (i, p, _sampling_params(workload, m, sampling, seed=i))
        for i, (p, m) in enumerate(zip(workload.prompts, workload.max_new_tokens))
    ]
    result = timed(
        backend,
        setting,
        lambda: _collect_cbrun(engine.generate(requests, max_in_flight=n), n),
        lambda: engine.stats.num_computed_tokens,
    )
    result.info = _engine_info(engine)
    return result


def _sampling_params(workload: Workload, max_new_tokens: int, sampling: dict | None = None, seed: int = 0):
    """``SamplingParams`` of one row: its limit, the workload's stop ids and ``ignore_eos``; greedy unless
    ``sampling`` gives more fields (the row's ``seed`` then applies)."""
    from cbrun.engine import SamplingParams

    extra = {**sampling, "seed": seed} if sampling else {}
    return SamplingParams(
        max_new_tokens=max_new_tokens, stop_token_ids=workload.stop_token_ids, ignore_eos=workload.ignore_eos, **extra
    )


def run_cbrun_static(workload: Workload, engine_config, batch_size: int) -> RunResult:
    """Static batching on cbrun's engine: admit ``batch_size`` rows, step until all finish, then the next rows."""
    from cbrun.engine import LLMEngine

    engine = LLMEngine.from_pretrained(
        str(workload.model_dir), replace(engine_config, max_requests_per_batch=batch_size)
    )

    def run():
        results = []
        for start in range(0, len(workload.prompts), batch_size):
            stop = min(start + batch_size, len(workload.prompts))
            for i in range(start, stop):
                engine.add_request(i, workload.prompts[i], _sampling_params(workload, workload.max_new_tokens[i]))
            while engine.has_unfinished_requests():
                results.extend(engine.step())
        return _collect_cbrun(results, len(workload.prompts))

    result = timed("cbrun-static", f"batch {batch_size}", run, lambda: engine.stats.num_computed_tokens)
    result.info = _engine_info(engine)
    return result


def _engine_info(engine) -> dict:
    """Block count and the engine's counters (prefix-cache hits among them) after a run, for the JSON."""
    return {"num_blocks": engine.num_blocks, **engine.stats.as_dict()}


def _collect_cbrun(outputs, n: int):
    """RequestOutputs -> (per-row ids, absolute first-token times, absolute finish times)."""
    ids, first, finish = [None] * n, [None] * n, [None] * n
    for o in outputs:
        if o.error:
            raise RuntimeError(f"cbrun request {o.request_id} failed: {o.error}")
        ids[o.request_id] = o.output_token_ids
        first[o.request_id] = o.arrival_time + o.ttft_s if o.ttft_s is not None else None
        finish[o.request_id] = o.finish_time
    return ids, first, finish


def run_hf_generate(workload: Workload, batch_size: int) -> RunResult:
    """transformers ``generate`` over static, left-padded batches of ``batch_size`` rows in input order."""
    model = _load_hf_model(workload.model_dir)
    computed = [0]

    def run():
        ids, first, finish = [], [], []
        for start in range(0, len(workload.prompts), batch_size):
            rows = slice(start, start + batch_size)
            out, step_times, tokens = _hf_generate_batch(
                model, workload.prompts[rows], workload.max_new_tokens[rows], workload.stop_token_ids
            )
            computed[0] += tokens
            for generated, limit in zip(out, workload.max_new_tokens[rows]):
                kept = cut_output(generated, limit, workload.stop_token_ids)
                ids.append(kept)
                first.append(step_times[0] if kept else None)
                finish.append(step_times[len(kept) - 1] if kept else None)
        return ids, first, finish

    return timed("hf-generate", f"batch {batch_size}", run, lambda: computed[0])


class _StepClock:
    """A transformers stopping criterion that timestamps each decoding step and ends each row at its own limit."""

    def __init__(self, limits: list[int], prompt_width: int) -> None:
        self.limits = torch.tensor(limits)
        self.prompt_width = prompt_width
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return (input_ids.shape[1] - self.prompt_width) >= self.limits.to(input_ids.device)


def _hf_generate_batch(model, prompts: list[list[int]], limits: list[int], stop_token_ids: tuple[int, ...]):
    """One left-padded greedy ``generate`` call.

    Returns:
        Per row its generated ids (padding after its end included), the timestamp of each step, and the tokens
        run through the model (batch x (prompt width + steps - 1)).
    """
    from transformers import GenerationConfig, StoppingCriteriaList

    pad = 0
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = _StepClock(limits, width)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max(limits), eos_token_id=list(stop_token_ids), pad_token_id=pad
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    steps = out.shape[1] - width
    return out[:, width:].tolist(), clock.times, len(prompts) * (width + steps - 1)


def run_hf_cb(workload: Workload, engine_config, num_blocks: int) -> RunResult:
    """transformers continuous batching with cbrun's page size, budgets and block count; one request per row."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = _load_hf_model(workload.model_dir)
    generation_config = GenerationConfig(
        do_sample=False, eos_token_id=list(workload.stop_token_ids), max_new_tokens=max(workload.max_new_tokens)
    )
    cb_config = ContinuousBatchingConfig(
        page_size=engine_config.page_size,
        num_blocks=num_blocks,
        max_batch_tokens=engine_config.max_batch_tokens,
        max_requests_per_batch=engine_config.max_requests_per_batch,
        allow_block_sharing=engine_config.allow_block_sharing,
        scheduler_type=engine_config.scheduler_type,
    )
    with model.continuous_batching_context_manager(
        generation_config=generation_config, continuous_batching_config=cb_config, block=True
    ) as manager:
        return timed("hf-cb", "", lambda: _hf_cb_run(manager, workload), lambda: None)


def _hf_cb_run(manager, workload: Workload):
    n = len(workload.prompts)
    for i, (prompt, limit) in enumerate(zip(workload.prompts, workload.max_new_tokens)):
        manager.add_request(prompt, request_id=f"row-{i}", max_new_tokens=limit, record_timestamps=True)
    ids, first, finish, done = [None] * n, [None] * n, [None] * n, 0
    while done < n:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped before all rows finished")
            continue
        if not result.is_finished():
            continue
        if result.error:
            raise RuntimeError(f"hf-cb request {result.request_id} failed: {result.error}")
        i = int(result.request_id.removeprefix("row-"))
        ids[i] = cut_output(result.generated_tokens, workload.max_new_tokens[i], workload.stop_token_ids)
        stamps = result.timestamps or []
        first[i], finish[i] = (stamps[0], stamps[len(ids[i]) - 1]) if ids[i] and stamps else (None, None)
        done += 1
    return ids, first, finish


def _load_hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    ).eval()


@dataclass
class BackendSpec:
    """One backend run: which backend, its static batch size (or None), and the settings it needs."""

    backend: str
    batch_size: int | None
    engine_config: object
    threads: int | None  # None: torch's default (cbrun-defaults: the engine picks its own)
    num_blocks: int | None = None  # hf-cb: cbrun's block count
    setting: str = ""  # cbrun-budgets: the budget, shown in the table
    vllm: VllmOptions | None = None  # vllm: its interpreter and settings


def run_backend(spec: BackendSpec, workload: Workload) -> RunResult:
    """Run one backend on the workload in this process (after ``warm_up``); ``cbrun-command`` and ``vllm`` start
    their own child process."""
    if spec.backend in ("cbrun", "cbrun-defaults", "cbrun-nosharing", "cbrun-budgets"):
        return run_cbrun(workload, spec.engine_config, spec.backend, spec.setting)
    if spec.backend in SAMPLING_BACKENDS:
        return run_cbrun(workload, spec.engine_config, spec.backend, spec.setting, SAMPLING_BACKENDS[spec.backend])
    if spec.backend == "cbrun-command":
        return run_command(workload)
    if spec.backend == "vllm":
        return run_vllm(workload, spec.vllm)
    if spec.backend == "cbrun-static":
        return run_cbrun_static(workload, spec.engine_config, spec.batch_size)
    if spec.backend == "hf-generate":
        return run_hf_generate(workload, spec.batch_size)
    return run_hf_cb(workload, spec.engine_config, spec.num_blocks)


def run_isolated(spec: BackendSpec, workload: Workload) -> RunResult:
    """Run one backend in a fresh spawned process; its peak RSS is then the backend's own."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_child, (spec, workload))


def _child(spec: BackendSpec, workload: Workload) -> RunResult:
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    quiet_transformers()
    warm_up()
    reset = reset_peak_rss()
    base = current_rss_mib()
    result = run_backend(spec, workload)
    result.rss_base_mib = base
    result.rss_peak_mib = peak_rss_mib() if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result.info["peak_rss_method"] = "VmHWM after clear_refs" if reset else "ru_maxrss (includes warm-up)"
    result.info["commit"] = git_commit()  # the engine may change under a long run; this is the code this run used
    result.info["threads"] = torch.get_num_threads()
    return result


def warm_up() -> None:
    """Load a tiny Llama through both loading paths and generate with it (transformers ``generate`` and cbrun's
    engine), so no backend pays one-time costs (imports, lazy initialisation, first kernel calls) in its time or
    memory."""
    import transformers.generation.continuous_batching  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM

    from cbrun.engine import EngineConfig, LLMEngine, SamplingParams

    with tempfile.TemporaryDirectory(prefix="cbrun-bench-warmup-") as tmp:
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=64,
                eos_token_id=0,
            )
        ).save_pretrained(tmp)
        _hf_generate_batch(_load_hf_model(Path(tmp)), [[1, 2, 3], [4, 5]], [2, 2], (0,))
        # num_threads=None: the warm-up leaves the process's thread count as the backend set it.
        engine = LLMEngine.from_pretrained(tmp, EngineConfig(max_requests_per_batch=2, num_threads=None))
        list(engine.generate([(0, [1, 2, 3], SamplingParams(max_new_tokens=2))]))
    del engine
    gc.collect()


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
