"""`cbrun bench`: one workload through several backends in one command, side by side with transformers.

Workloads (rows are the first ``--rows`` GSM8K test questions; per-row ``max_new_tokens`` drawn uniformly from
``--max-new-tokens`` with ``--seed``, capped so prompt plus completion fit the model's context):

- ``gsm8k-stories260k``: each question as the prompt of stories260K (512-token context).
- ``random-llama-30m``: a random-init Llama of about 40M parameters on random ids, one prompt per question with the
  length stories260K's tokenizer gives it.
- ``gsm8k-fewshot``: stories260K, each question after the same 1-shot exemplar (GSM8K train row 0, question and
  answer), the prompt of manifests/gsm8k-fewshot.toml: every row shares a prefix of about 217 tokens, which
  cbrun's prefix cache serves. Questions whose prompt leaves no room to generate (>= 512 tokens) are left out; the
  workload description says how many.

Backends (all greedy, all on the same rows):

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

Measurement (the same for every backend):

- Wall time runs from the first request handed to the backend to the last output; model loading, engine/cache
  construction and transformers' CB warm-up are excluded. Every request counts as arriving at that start (an
  offline job queues all its rows at once), so TTFT includes queueing.
- TTFT: first token time minus the run start. cbrun: ``arrival_time + ttft_s``; hf-cb: its per-token timestamps
  (``record_timestamps``); hf-generate: a stopping criterion timestamps every decoding step of the batch.
- ITL: per request, (finish time - first token time) / (tokens - 1), requests with >= 2 tokens; the table gives
  the median and p99 over requests.
- CPU time: ``time.process_time`` over the run (all threads). On a shared machine it is steadier than wall time;
  wall time is what the throughput columns use.
- Peak memory: each backend run (each setting of a sweep too) happens in a fresh process (multiprocessing, spawn).
  After imports and a warm-up on a tiny model, the process's peak-RSS mark is reset (``/proc/self/clear_refs``,
  Linux) and its RSS read as the base; at the end the peak (``VmHWM``) is read. The table gives the peak and, in
  "+", peak minus base: what the workload's model, KV cache and activations add. Where the mark cannot be reset,
  the peak is ``ru_maxrss`` (which then includes the warm-up). ``--no-isolate`` runs everything in this process
  instead (faster; memory then reads "n/a").
- Useful FLOP/s: 2 x (non-embedding decoder parameters) per prompt-or-generated token fed to the model, plus
  2 x (LM head) per sampled token, plus causal attention (4 x heads x head_dim per attended position per layer),
  divided by wall time. Padding and recomputation are not counted: it is the work the rows need. Prompt tokens
  served from a prefix cache are counted (the same numerator for every backend), so on ``gsm8k-fewshot`` sharing
  shows as more useful FLOP/s than the model ran. The ceiling is the best of a few fp32 ``torch.matmul`` of
  2048 x 2048 at the same thread count.
- Cached prompt tokens (hit rate): the cbrun backends' ``engine.stats.num_cached_prompt_tokens`` and its share of
  ``num_prompt_tokens``; "n/a" for transformers.

Repeats: the machine's speed drifts over minutes and backends run one after another, so ``--repeats N`` runs the
whole list of backend runs N times round-robin (b1, b2, ..., b1, b2, ...), each run in a process of its own (unless
``--no-isolate``). A table row is the backend's (and setting's) median run by wall time, with all its numbers from
that one run; of an even N, the faster of the two middle runs. "vs cbrun" divides those median runs' generated
tok/s; with N > 1 a column gives the min-max of generated tok/s over the repeats. The JSON keeps every run
(``runs``) beside the table's rows (``results``). hf-cb takes its block count from the first cbrun run.

Outputs are compared after cutting each row as cbrun does: at the first stop token (kept), and at the row's
``max_new_tokens`` (which the workload already caps at the model's maximum length). Every run, every repeat of
cbrun included, is compared with cbrun's first run (greedy decoding is deterministic); a row of the table names
each repeat that differs and in how many rows.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

#: Paths of the shared data, beside the repo root.
SHARED = Path(__file__).resolve().parents[2] / "shared"
GSM8K_TEST = SHARED / "data" / "gsm8k_test.parquet"
GSM8K_TRAIN = SHARED / "data" / "gsm8k_train.parquet"
STORIES260K = SHARED / "models" / "stories260K"
#: stories260K's context: prompt plus completion tokens.
STORIES_CONTEXT = 512
#: Train exemplars before each test question in ``gsm8k-fewshot``, as in manifests/gsm8k-fewshot.toml (k = 2 would
#: push most prompts past stories260K's context).
FEWSHOT_EXEMPLARS = 1

WORKLOADS = ("gsm8k-stories260k", "random-llama-30m", "gsm8k-fewshot")
BACKENDS = ("cbrun", "cbrun-nosharing", "cbrun-static", "hf-generate", "hf-cb")
#: Rows per workload when --rows is not given, chosen so every backend ends in a few minutes on 2 CPU cores.
DEFAULT_ROWS = {"gsm8k-stories260k": 512, "random-llama-30m": 64, "gsm8k-fewshot": 512}

#: Shape of the random Llama of the ``random-llama-30m`` workload (about 40M parameters with tied embeddings).
RANDOM_LLAMA = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                    intermediate_size=1408, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=True,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)


# ---- workloads --------------------------------------------------------------------------------------------------
@dataclass
class Workload:
    """The rows every backend runs.

    Attributes:
        name: the workload name.
        model_dir: transformers model directory.
        prompts: per row, prompt token ids.
        max_new_tokens: per row, most tokens to generate (prompt + completion <= ``max_model_len``).
        stop_token_ids: ids that end a row (kept in its output).
        max_model_len: the model's maximum total length.
        description: one line for the report.
    """

    name: str
    model_dir: Path
    prompts: list[list[int]]
    max_new_tokens: list[int]
    stop_token_ids: tuple[int, ...]
    max_model_len: int
    description: str

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def build_workload(name: str, rows: int, new_tokens: tuple[int, int], seed: int, model_dir: Path | None,
                   scratch: Path) -> Workload:
    """Build a workload by name.

    Args:
        name: one of ``WORKLOADS``.
        rows: number of GSM8K test questions, from the first (``gsm8k-fewshot`` leaves out those too long).
        new_tokens: (low, high) bounds of the uniform per-row ``max_new_tokens`` draw.
        seed: seed of that draw and of random prompt ids.
        model_dir: a model directory to reuse (built there when it has no config.json); None builds in ``scratch``.
        scratch: a temporary directory for models built on the fly.

    Raises:
        ValueError: for an unknown workload, more rows than GSM8K's test split holds, or no row that fits.
    """
    if name == "gsm8k-stories260k":
        return _stories_workload(rows, new_tokens, seed, model_dir or scratch / "stories260k")
    if name == "random-llama-30m":
        return _random_llama_workload(rows, new_tokens, seed, model_dir or scratch / "random-llama-30m")
    if name == "gsm8k-fewshot":
        return _fewshot_workload(rows, new_tokens, seed, model_dir or scratch / "stories260k")
    raise ValueError(f"unknown workload {name!r}; choose one of {WORKLOADS}")


def gsm8k_questions(rows: int) -> list[str]:
    """The first ``rows`` questions of the GSM8K test split."""
    import pyarrow.parquet as pq

    questions = pq.read_table(GSM8K_TEST, columns=["question"]).column("question").to_pylist()
    if rows > len(questions):
        raise ValueError(f"--rows {rows} exceeds the {len(questions)} GSM8K test questions")
    return questions[:rows]


def draw_max_new_tokens(prompts: list[list[int]], new_tokens: tuple[int, int], max_model_len: int,
                        seed: int) -> list[int]:
    """Per row, uniform in ``new_tokens`` (inclusive) from ``seed``, capped so prompt + completion fit the model."""
    rng = random.Random(seed)
    low, high = new_tokens
    return [min(rng.randint(low, high), max_model_len - len(p)) for p in prompts]


def gsm8k_exemplars(k: int) -> list[dict]:
    """The first ``k`` rows of the GSM8K train split as ``{"question", "answer"}`` dicts (few-shot exemplars)."""
    import pyarrow.parquet as pq

    return pq.read_table(GSM8K_TRAIN, columns=["question", "answer"]).slice(0, k).to_pylist()


def fewshot_template(exemplars: list[dict]) -> str:
    """A ``str.format`` template: each exemplar's question and answer, then ``{question}``.

    Braces in the exemplar text are doubled so that only ``{question}`` is a field. With GSM8K train row 0 it is
    manifests/gsm8k-fewshot.toml's ``input.template``.
    """
    def escape(text: str) -> str:
        return text.replace("{", "{{").replace("}", "}}")

    shots = "".join(f"Question: {escape(e['question'])}\nAnswer: {escape(e['answer'])}\n\n" for e in exemplars)
    return shots + "Question: {question}\nAnswer:"


def _stories_workload(rows: int, new_tokens: tuple[int, int], seed: int, model_dir: Path) -> Workload:
    tokenizer = _stories_model(model_dir)
    prompts = tokenizer(gsm8k_questions(rows))["input_ids"]
    return Workload("gsm8k-stories260k", model_dir, prompts,
                    draw_max_new_tokens(prompts, new_tokens, STORIES_CONTEXT, seed), (1,), STORIES_CONTEXT,
                    f"stories260K on the first {rows} GSM8K test questions, {_stories_limits(new_tokens, seed)}")


def _fewshot_workload(rows: int, new_tokens: tuple[int, int], seed: int, model_dir: Path) -> Workload:
    tokenizer = _stories_model(model_dir)
    template = fewshot_template(gsm8k_exemplars(FEWSHOT_EXEMPLARS))
    # verbose=False: prompts longer than the context are expected here and dropped just below.
    encoded = tokenizer([template.format(question=q) for q in gsm8k_questions(rows)], verbose=False)["input_ids"]
    prompts = [p for p in encoded if len(p) < STORIES_CONTEXT]  # a full-context prompt leaves no room to generate
    if not prompts:
        raise ValueError(f"no gsm8k-fewshot prompt of the first {rows} questions fits the {STORIES_CONTEXT}-token "
                         f"context; raise --rows")
    shared = len(os.path.commonprefix(prompts))
    return Workload("gsm8k-fewshot", model_dir, prompts,
                    draw_max_new_tokens(prompts, new_tokens, STORIES_CONTEXT, seed), (1,), STORIES_CONTEXT,
                    f"stories260K on the first {rows} GSM8K test questions, each after the same 1-shot exemplar "
                    f"(GSM8K train row 0, as manifests/gsm8k-fewshot.toml): {shared} shared prompt tokens; "
                    f"{rows - len(prompts)} rows left out (prompt of >= {STORIES_CONTEXT} tokens, no room to "
                    f"generate), {len(prompts)} run; {_stories_limits(new_tokens, seed)}")


def _stories_model(model_dir: Path):
    """stories260K's tokenizer, after converting the llama2.c checkpoint to ``model_dir`` unless already there."""
    from transformers import AutoTokenizer

    if not (model_dir / "config.json").is_file():
        from jobs.convert_llama2c import convert_llama2c

        convert_llama2c(STORIES260K / "stories260K.bin", STORIES260K / "tok512.bin", model_dir)
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def _stories_limits(new_tokens: tuple[int, int], seed: int) -> str:
    return (f"stop token 1, max_new_tokens uniform {new_tokens[0]}..{new_tokens[1]} (seed {seed}), capped by the "
            f"{STORIES_CONTEXT}-token context")


def _random_llama_workload(rows: int, new_tokens: tuple[int, int], seed: int, model_dir: Path) -> Workload:
    if not (model_dir / "config.json").is_file():
        build_random_llama(model_dir, seed)
    lengths = [len(ids) for ids in _stories_tokenizer()(gsm8k_questions(rows))["input_ids"]]
    g = torch.Generator().manual_seed(seed)
    vocab = RANDOM_LLAMA["vocab_size"]
    prompts = [[1] + torch.randint(3, vocab, (n - 1,), generator=g).tolist() for n in lengths]
    max_len = RANDOM_LLAMA["max_position_embeddings"]
    return Workload("random-llama-30m", model_dir, prompts, draw_max_new_tokens(prompts, new_tokens, max_len, seed),
                    (RANDOM_LLAMA["eos_token_id"],), max_len,
                    f"random-init Llama ({_shape_text()}) on {rows} prompts of random ids with the stories260K "
                    f"token lengths of the first {rows} GSM8K test questions, stop token 2, max_new_tokens uniform "
                    f"{new_tokens[0]}..{new_tokens[1]} (seed {seed})")


def _shape_text() -> str:
    c = RANDOM_LLAMA
    return (f"hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_attention_heads']} heads, "
            f"{c['num_key_value_heads']} kv heads, intermediate {c['intermediate_size']}, vocab {c['vocab_size']}, "
            f"tied embeddings")


def _stories_tokenizer():
    from jobs.convert_llama2c import build_tokenizer, read_tokenizer

    return build_tokenizer(*read_tokenizer(STORIES260K / "tok512.bin", 512), 512)


def build_random_llama(out_dir: Path, seed: int = 0) -> Path:
    """Save a random-initialised Llama of shape ``RANDOM_LLAMA`` (float32, no tokenizer) to ``out_dir``."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**RANDOM_LLAMA)).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=RANDOM_LLAMA["eos_token_id"],
                                               pad_token_id=0)
    model.save_pretrained(out_dir)
    return out_dir


def cut_output(tokens: list[int], max_new_tokens: int, stop_token_ids: tuple[int, ...]) -> list[int]:
    """Cut generated ids as cbrun does: through the first stop token (kept), at most ``max_new_tokens``."""
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in stop_token_ids:
            return tokens[:i + 1]
    return tokens


# ---- measuring ----------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    """One backend's run of a workload.

    Attributes:
        backend: backend name.
        setting: e.g. "batch 32" for static backends, "" otherwise.
        outputs: per row, generated ids cut as cbrun cuts them.
        wall_s: seconds from the first request to the last output.
        cpu_s: process CPU seconds (all threads) over the same span.
        first_token_s: per row, seconds from the run start to its first token (None without one).
        finish_s: per row, seconds from the run start to its last token.
        computed_tokens: tokens run through the model, padding and recomputation included (None when unknown).
        rss_base_mib: RSS of the backend's process after imports and warm-up, before its model (None in-process).
        rss_peak_mib: peak resident set size of the backend's process (``ru_maxrss``; None in-process).
        load_avg: 1-minute load average before and after the run.
        info: backend facts for the JSON (cbrun backends: engine stats and KV blocks).
        repeat: which round of ``--repeats`` this run belongs to, from 1.
    """

    backend: str
    setting: str
    outputs: list[list[int]]
    wall_s: float
    cpu_s: float
    first_token_s: list[float | None]
    finish_s: list[float | None]
    computed_tokens: int | None = None
    rss_base_mib: float | None = None
    rss_peak_mib: float | None = None
    load_avg: tuple[float, float] = (0.0, 0.0)
    info: dict = field(default_factory=dict)
    repeat: int = 1


def current_rss_mib() -> float:
    """Resident set size of this process in MiB, from ``/proc/self/statm`` (0 where it is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark (``VmHWM``) to its current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """Peak resident set size (``VmHWM``) since the last reset, in MiB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def measure_matmul_gflops(n: int = 2048, repeats: int = 10) -> float:
    """Best fp32 ``torch.matmul`` throughput of two n x n matrices over ``repeats`` runs, in GFLOP/s."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


# ---- backends -------------------------------------------------------------------------------------------------------
def run_cbrun(workload: Workload, engine_config, backend: str = "cbrun") -> RunResult:
    """Continuous batching: every row handed to ``LLMEngine.generate`` at once.

    Args:
        workload: the rows.
        engine_config: the ``EngineConfig`` (``cbrun-nosharing`` passes one with ``allow_block_sharing=False``).
        backend: the name the result carries.
    """
    from engine import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(str(workload.model_dir), engine_config)
    n = len(workload.prompts)
    requests = [(i, p, SamplingParams(max_new_tokens=m, stop_token_ids=workload.stop_token_ids))
                for i, (p, m) in enumerate(zip(workload.prompts, workload.max_new_tokens))]
    result = _timed(backend, "", lambda: _collect_cbrun(engine.generate(requests, max_in_flight=n), n),
                    lambda: engine.stats.num_computed_tokens)
    result.info = _engine_info(engine)
    return result


def run_cbrun_static(workload: Workload, engine_config, batch_size: int) -> RunResult:
    """Static batching on cbrun's engine: admit ``batch_size`` rows, step until all finish, then the next rows."""
    from engine import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(str(workload.model_dir), replace(engine_config,
                                                                        max_requests_per_batch=batch_size))

    def run():
        results = []
        for start in range(0, len(workload.prompts), batch_size):
            stop = min(start + batch_size, len(workload.prompts))
            for i in range(start, stop):
                engine.add_request(i, workload.prompts[i], SamplingParams(
                    max_new_tokens=workload.max_new_tokens[i], stop_token_ids=workload.stop_token_ids))
            while engine.has_unfinished_requests():
                results.extend(engine.step())
        return _collect_cbrun(results, len(workload.prompts))

    result = _timed("cbrun-static", f"batch {batch_size}", run, lambda: engine.stats.num_computed_tokens)
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
            out, step_times, tokens = _hf_generate_batch(model, workload.prompts[rows], workload.max_new_tokens[rows],
                                                         workload.stop_token_ids)
            computed[0] += tokens
            for generated, limit in zip(out, workload.max_new_tokens[rows]):
                kept = cut_output(generated, limit, workload.stop_token_ids)
                ids.append(kept)
                first.append(step_times[0] if kept else None)
                finish.append(step_times[len(kept) - 1] if kept else None)
        return ids, first, finish

    return _timed("hf-generate", f"batch {batch_size}", run, lambda: computed[0])


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
    config = GenerationConfig(do_sample=False, max_new_tokens=max(limits), eos_token_id=list(stop_token_ids),
                              pad_token_id=pad)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config,
                             stopping_criteria=StoppingCriteriaList([clock]))
    steps = out.shape[1] - width
    return out[:, width:].tolist(), clock.times, len(prompts) * (width + steps - 1)


def run_hf_cb(workload: Workload, engine_config, num_blocks: int) -> RunResult:
    """transformers continuous batching with cbrun's page size, budgets and block count; one request per row."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = _load_hf_model(workload.model_dir)
    generation_config = GenerationConfig(do_sample=False, eos_token_id=list(workload.stop_token_ids),
                                         max_new_tokens=max(workload.max_new_tokens))
    cb_config = ContinuousBatchingConfig(
        page_size=engine_config.page_size, num_blocks=num_blocks, max_batch_tokens=engine_config.max_batch_tokens,
        max_requests_per_batch=engine_config.max_requests_per_batch,
        allow_block_sharing=engine_config.allow_block_sharing, scheduler_type=engine_config.scheduler_type)
    with model.continuous_batching_context_manager(generation_config=generation_config,
                                                   continuous_batching_config=cb_config, block=True) as manager:
        return _timed("hf-cb", "", lambda: _hf_cb_run(manager, workload), lambda: None)


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

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                local_files_only=True).eval()


def _timed(backend: str, setting: str, run, computed_tokens) -> RunResult:
    """Run ``run() -> (ids, absolute first times, absolute finish times)`` under the wall and CPU clocks."""
    load_before = os.getloadavg()[0]
    cpu_start, start = time.process_time(), time.perf_counter()
    ids, first, finish = run()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    rel = lambda times: [t - start if t is not None else None for t in times]  # noqa: E731
    return RunResult(backend, setting, ids, wall, cpu, rel(first), rel(finish), computed_tokens(),
                     load_avg=(load_before, os.getloadavg()[0]))


# ---- reporting ------------------------------------------------------------------------------------------------------
@dataclass
class ModelCost:
    """FLOPs per token of a decoder: linear layers, LM head, and attention per attended position."""

    decoder_params: int
    lm_head_params: int
    attention_per_position: int
    total_params: int

    @classmethod
    def of(cls, model_dir: Path) -> "ModelCost":
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv = c.num_key_value_heads * head_dim
        q = c.num_attention_heads * head_dim
        per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
        lm_head = c.vocab_size * c.hidden_size
        total = c.num_hidden_layers * per_layer + lm_head * (1 if c.tie_word_embeddings else 2) + c.hidden_size
        return cls(c.num_hidden_layers * per_layer, lm_head, 4 * q * c.num_hidden_layers, total)

    def useful_flops(self, prompts: list[list[int]], outputs: list[list[int]]) -> float:
        flops = 0.0
        for prompt, out in zip(prompts, outputs):
            fed = len(prompt) + max(len(out) - 1, 0)  # the last generated token is never fed back
            flops += 2 * self.decoder_params * fed + 2 * self.lm_head_params * len(out)
            flops += self.attention_per_position * fed * (fed + 1) / 2
        return flops


def summarize(result: RunResult, workload: Workload, reference: RunResult | None, cost: ModelCost,
              matmul_gflops: float) -> dict:
    """The JSON record of one run (a table row when it is its backend's median run)."""
    generated = sum(len(o) for o in result.outputs)
    total = generated + workload.num_prompt_tokens
    ttft = [t for t in result.first_token_s if t is not None]
    itl = [(f - s) / (len(o) - 1) for s, f, o in zip(result.first_token_s, result.finish_s, result.outputs)
           if s is not None and f is not None and len(o) >= 2]
    flops = cost.useful_flops(workload.prompts, result.outputs) / result.wall_s
    row = dict(backend=result.backend, setting=result.setting, repeat=result.repeat, rows=len(result.outputs),
               prompt_tokens=workload.num_prompt_tokens, generated_tokens=generated, wall_s=result.wall_s,
               cpu_s=result.cpu_s, generated_tok_s=generated / result.wall_s, total_tok_s=total / result.wall_s,
               generated_tok_per_cpu_s=generated / result.cpu_s,
               computed_tokens=result.computed_tokens,
               cached_prompt_tokens=result.info.get("num_cached_prompt_tokens"),
               prefix_hit_rate=result.info.get("prefix_hit_rate"),
               ttft_s=_percentiles(ttft), itl_s=_percentiles(itl),
               rss_peak_mib=result.rss_peak_mib, rss_base_mib=result.rss_base_mib,
               useful_gflop_s=flops / 1e9, fraction_of_matmul_ceiling=flops / 1e9 / matmul_gflops,
               load_avg_before=result.load_avg[0], load_avg_after=result.load_avg[1], info=result.info)
    row.update(compare_outputs(result.outputs, reference.outputs if reference else None))
    return row


def _percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"p50": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def compare_outputs(outputs: list[list[int]], reference: list[list[int]] | None) -> dict:
    """How many rows equal the reference token for token; the first differing rows with their first bad index."""
    if reference is None:
        return {"rows_equal": None, "rows_differing": None, "first_differences": []}
    differing = [i for i, (a, b) in enumerate(zip(outputs, reference)) if a != b]
    first = [{"row": i, "token": next((k for k, (a, b) in enumerate(zip(outputs[i], reference[i])) if a != b),
                                      min(len(outputs[i]), len(reference[i])))} for i in differing[:10]]
    return {"rows_equal": len(outputs) - len(differing), "rows_differing": len(differing), "first_differences": first}


def median_runs(runs: list[dict]) -> list[dict]:
    """Per backend and setting (in first-run order), its median run by wall time: the table's rows.

    With an even number of repeats the faster of the two middle runs is taken, so every number of a row comes from
    one real run. Each row also gets ``repeats`` (its number of runs), ``generated_tok_s_range`` ([min, max] over
    them) and ``repeats_differing`` (per run whose outputs differ from the reference: its repeat and rows differing).
    """
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["backend"], run["setting"]), []).append(run)
    rows = []
    for group in groups.values():
        by_wall = sorted(group, key=lambda run: run["wall_s"])
        speeds = [run["generated_tok_s"] for run in group]
        rows.append({**by_wall[(len(group) - 1) // 2], "repeats": len(group),
                     "generated_tok_s_range": [min(speeds), max(speeds)],
                     "repeats_differing": [{"repeat": run["repeat"], "rows_differing": run["rows_differing"]}
                                           for run in group if run["rows_differing"]]})
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Set each row's generated tokens/s relative to cbrun's (``vs_cbrun``)."""
    base = next((r["generated_tok_s"] for r in rows if r["backend"] == "cbrun"), None)
    for row in rows:
        row["vs_cbrun"] = row["generated_tok_s"] / base if base else None


TABLE_COLUMNS = ("backend", "rows", "prompt tok", "cached prompt tok (hit rate)", "gen tok", "wall s", "CPU s",
                 "gen tok/s", "total tok/s", "vs cbrun", "TTFT p50/p99 s", "ITL p50/p99 ms",
                 "peak RSS MiB (+ over base)", "useful GFLOP/s (% ceiling)", "outputs == cbrun")
#: The extra column when backends ran more than once, after "gen tok/s".
SPREAD_COLUMN = "gen tok/s min-max"


def format_table(rows: list[dict]) -> str:
    """A Markdown table with one row per backend and setting (its median run; see ``median_runs``)."""
    repeated = any(r["repeats"] > 1 for r in rows)
    columns = list(TABLE_COLUMNS)
    if repeated:
        columns.insert(columns.index("gen tok/s") + 1, SPREAD_COLUMN)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        name = f"{r['backend']} ({r['setting']})" if r["setting"] else r["backend"]
        ttft = f"{r['ttft_s']['p50']:.2f} / {r['ttft_s']['p99']:.2f}" if r["ttft_s"] else "n/a"
        itl = f"{r['itl_s']['p50'] * 1e3:.1f} / {r['itl_s']['p99'] * 1e3:.1f}" if r["itl_s"] else "n/a"
        cells = [name, r["rows"], r["prompt_tokens"], _cached_cell(r), r["generated_tokens"], f"{r['wall_s']:.1f}",
                 f"{r['cpu_s']:.1f}", f"{r['generated_tok_s']:.0f}", f"{r['total_tok_s']:.0f}",
                 f"{r['vs_cbrun']:.2f}x" if r["vs_cbrun"] else "n/a", ttft, itl, _memory_cell(r),
                 f"{r['useful_gflop_s']:.2f} ({100 * r['fraction_of_matmul_ceiling']:.1f}%)", _outputs_cell(r)]
        if repeated:
            low, high = r["generated_tok_s_range"]
            cells.insert(columns.index(SPREAD_COLUMN), f"{low:.0f}-{high:.0f}")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _cached_cell(row: dict) -> str:
    if row["cached_prompt_tokens"] is None:
        return "n/a"
    return f"{row['cached_prompt_tokens']} ({100 * row['prefix_hit_rate']:.1f}%)"


def _outputs_cell(row: dict) -> str:
    """The "outputs == cbrun" cell: "reference", "yes (rows/rows)", or each repeat that differs and in how many rows."""
    if row["repeats_differing"]:
        differences = []
        for d in row["repeats_differing"]:
            where = f" in repeat {d['repeat']}" if row["repeats"] > 1 else ""
            differences.append(f"{d['rows_differing']}/{row['rows']} rows differ{where}")
        return "NO: " + "; ".join(differences)
    if row["backend"] == "cbrun":
        return f"reference (all {row['repeats']} repeats agree)" if row["repeats"] > 1 else "reference"
    every = f", all {row['repeats']} repeats" if row["repeats"] > 1 else ""
    return f"yes ({row['rows']}/{row['rows']}{every})"


def sharing_summary(rows: list[dict]) -> str | None:
    """One line on what prefix sharing buys: cbrun's cache hits and its speed against ``cbrun-nosharing``.

    Returns None unless both ran.
    """
    by_backend = {r["backend"]: r for r in rows if not r["setting"]}
    shared, unshared = by_backend.get("cbrun"), by_backend.get("cbrun-nosharing")
    if shared is None or unshared is None:
        return None
    return (f"prefix sharing: cbrun served {shared['cached_prompt_tokens']} of {shared['prompt_tokens']} prompt "
            f"tokens from its prefix cache ({100 * shared['prefix_hit_rate']:.1f}%) and ran "
            f"{shared['computed_tokens']} tokens through the model against {unshared['computed_tokens']} without "
            f"sharing; generated tok/s {shared['generated_tok_s'] / unshared['generated_tok_s']:.2f}x of "
            f"cbrun-nosharing's")


def _memory_cell(row: dict) -> str:
    if row["rss_peak_mib"] is None:
        return "n/a"
    return f"{row['rss_peak_mib']:.0f} (+{row['rss_peak_mib'] - row['rss_base_mib']:.0f})"


def machine_info(threads: int) -> dict:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    import transformers

    return dict(cpu=model, cores=os.cpu_count(), torch_threads=threads, torch=torch.__version__,
                transformers=transformers.__version__, python=platform.python_version(), commit=_git_commit(),
                date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"))


def _git_commit() -> str | None:
    """The repo's HEAD commit, with "+dirty" when tracked files changed (None outside a git checkout)."""
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


# ---- command --------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="cbrun bench", description=(
        "Run one workload through several backends (" + ", ".join(BACKENDS) + "), each run in its own process, "
        "and print a side-by-side table: throughput, prefix-cache hits, TTFT/ITL, peak memory, and whether each "
        "backend's greedy outputs equal cbrun's. With --repeats N each row is the backend's median run by wall "
        "time."))
    p.add_argument("--workload", choices=WORKLOADS, default="gsm8k-stories260k",
                   help="gsm8k-stories260k: GSM8K test questions on stories260K; random-llama-30m: random ids of "
                   "the same lengths on a random 40M Llama; gsm8k-fewshot: the questions after a shared 1-shot "
                   "GSM8K exemplar on stories260K (prefix sharing)")
    p.add_argument("--rows", type=int, help=f"GSM8K test questions to take, from the first (gsm8k-fewshot leaves "
                   f"out those too long for the context) (default {DEFAULT_ROWS})")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help="comma-separated, from " + ", ".join(BACKENDS) + "; cbrun always runs (the reference)")
    p.add_argument("--batch-sizes", default="8,32,64", help="static batch sizes of hf-generate and cbrun-static")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run the whole backend list N times round-robin (b1, b2, ..., b1, b2, ...), each run in its "
                   "own process; the table shows each backend's median run by wall time (of an even N, the faster "
                   "middle one) and the min-max of its generated tok/s; the JSON keeps every run")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, the same for every backend")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="cbrun and hf-cb token budget per step")
    p.add_argument("--max-requests", type=int, default=128, help="cbrun and hf-cb requests per step")
    p.add_argument("--page-size", type=int, default=16, help="cbrun and hf-cb tokens per KV block")
    p.add_argument("--max-new-tokens", default="16:256", metavar="LOW:HIGH",
                   help="per-row max_new_tokens drawn uniformly in [LOW, HIGH]")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-row lengths and of random prompts")
    p.add_argument("--model-dir", type=Path, help="model directory to reuse (built there when empty)")
    p.add_argument("--json", type=Path, help="also write the results as JSON to this path")
    p.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help="run all backends in this process (faster start; no per-backend peak memory)")
    return p


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(args.backends) - set(BACKENDS)
    if unknown:
        parser.error(f"unknown backend(s) {sorted(unknown)}; choose from {BACKENDS}")
    args.backends = ["cbrun"] + [b for b in BACKENDS[1:] if b in args.backends]
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        low, high = (int(x) for x in args.max_new_tokens.split(":"))
    except ValueError:
        parser.error("--batch-sizes takes integers like 8,32,64 and --max-new-tokens LOW:HIGH like 16:256")
    if min(args.batch_sizes) < 1 or not 1 <= low <= high or args.threads < 1 or args.repeats < 1:
        parser.error("batch sizes, threads, repeats and max-new-tokens bounds must be positive, with LOW <= HIGH")
    args.new_tokens = (low, high)
    args.rows = args.rows or DEFAULT_ROWS[args.workload]
    return args


@dataclass
class BackendSpec:
    """One backend run: which backend, its static batch size (or None), and the settings it needs."""

    backend: str
    batch_size: int | None
    engine_config: object
    threads: int
    num_blocks: int | None = None  # hf-cb: cbrun's block count


def run_backend(spec: BackendSpec, workload: Workload) -> RunResult:
    """Run one backend on the workload in this process (after ``warm_up``)."""
    if spec.backend in ("cbrun", "cbrun-nosharing"):
        return run_cbrun(workload, spec.engine_config, spec.backend)
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
    torch.set_num_threads(spec.threads)
    _quiet_transformers()
    warm_up()
    reset = reset_peak_rss()
    base = current_rss_mib()
    result = run_backend(spec, workload)
    result.rss_base_mib = base
    result.rss_peak_mib = peak_rss_mib() if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result.info["peak_rss_method"] = "VmHWM after clear_refs" if reset else "ru_maxrss (includes warm-up)"
    result.info["commit"] = _git_commit()  # the engine may change under a long run; this is the code this run used
    return result


def backend_specs(args) -> list[BackendSpec]:
    """The backend runs of one round: cbrun first (the reference), then the others, each sweep setting its own."""
    from engine import EngineConfig

    config = EngineConfig(page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
                          max_requests_per_batch=args.max_requests)
    specs = [BackendSpec("cbrun", None, config, args.threads)]
    for backend in args.backends[1:]:
        if backend == "cbrun-nosharing":
            specs.append(BackendSpec(backend, None, replace(config, allow_block_sharing=False), args.threads))
        elif backend == "hf-cb":
            specs.append(BackendSpec(backend, None, config, args.threads))
        else:
            specs.extend(BackendSpec(backend, size, config, args.threads) for size in args.batch_sizes)
    return specs


def run_backends(args, workload: Workload) -> list[RunResult]:
    """Run the round of ``backend_specs`` ``args.repeats`` times, round-robin; log each run.

    NOTE: round-robin rather than each backend's repeats back to back, so a slow spell of the machine falls on
    every backend alike instead of on one.

    Returns:
        Every run in the order run; the first is round 1's cbrun, the outputs' reference.
    """
    specs = backend_specs(args)
    if not args.isolate:
        warm_up()
    results: list[RunResult] = []
    for repeat in range(1, args.repeats + 1):
        for spec in specs:
            if spec.backend == "hf-cb":
                spec.num_blocks = results[0].info["num_blocks"]
            result = run_isolated(spec, workload) if args.isolate else run_backend(spec, workload)
            result.repeat = repeat
            results.append(result)
            _log(result, args.repeats)
            gc.collect()
    return results


def warm_up() -> None:
    """Load a tiny Llama through both loading paths and generate with it (transformers ``generate`` and cbrun's
    engine), so no backend pays one-time costs (imports, lazy initialisation, first kernel calls) in its time or
    memory."""
    import transformers.generation.continuous_batching  # noqa: F401
    from engine import EngineConfig, LLMEngine, SamplingParams
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="cbrun-bench-warmup-") as tmp:
        LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                     eos_token_id=0)).save_pretrained(tmp)
        _hf_generate_batch(_load_hf_model(Path(tmp)), [[1, 2, 3], [4, 5]], [2, 2], (0,))
        engine = LLMEngine.from_pretrained(tmp, EngineConfig(max_requests_per_batch=2))
        list(engine.generate([(0, [1, 2, 3], SamplingParams(max_new_tokens=2))]))
    del engine
    gc.collect()


def _log(result: RunResult, repeats: int) -> None:
    generated = sum(len(o) for o in result.outputs)
    label = f"{result.backend} {result.setting}".strip()
    which = f" (repeat {result.repeat}/{repeats})" if repeats > 1 else ""
    print(f"[bench] {label}{which}: {generated} tokens in {result.wall_s:.1f} s "
          f"({generated / result.wall_s:.0f} tok/s), load {result.load_avg[0]:.2f} -> {result.load_avg[1]:.2f}",
          file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; write JSON when asked. Returns 0, or 2 for a bad workload."""
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    _quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="cbrun-bench-") as scratch:
        try:
            workload = build_workload(args.workload, args.rows, args.new_tokens, args.seed, args.model_dir,
                                      Path(scratch))
        except ValueError as e:
            print(f"cbrun bench: {e}", file=sys.stderr)
            return 2
        machine = machine_info(args.threads)
        matmul_gflops = measure_matmul_gflops()
        cost = ModelCost.of(workload.model_dir)
        load_start = os.getloadavg()
        results = run_backends(args, workload)
    runs = [summarize(r, workload, results[0] if i else None, cost, matmul_gflops) for i, r in enumerate(results)]
    rows = median_runs(runs)
    add_ratios(rows)
    report = dict(workload=args.workload, description=workload.description, command=_command(argv),
                  machine=machine, settings=_settings(args), model_params=cost.total_params,
                  matmul_ceiling_gflop_s=matmul_gflops, load_avg_start=load_start, load_avg_end=os.getloadavg(),
                  repeats=args.repeats, results=rows, runs=runs)
    print(format_report(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def format_report(report: dict) -> str:
    """The header lines, the table, and what prefix sharing bought when cbrun-nosharing ran."""
    m = report["machine"]
    lines = [
        f"workload: {report['workload']}: {report['description']}",
        f"model parameters: {report['model_params'] / 1e6:.2f}M; fp32 matmul ceiling "
        f"{report['matmul_ceiling_gflop_s']:.1f} GFLOP/s at {m['torch_threads']} thread(s)",
        f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, transformers {m['transformers']}, "
        f"commit {m['commit']}, {m['date']}; "
        f"load average (1/5/15 min) at start {_load(report['load_avg_start'])}, end {_load(report['load_avg_end'])}",
        *_repeats_note(report["repeats"]), "", format_table(report["results"])]
    sharing = sharing_summary(report["results"])
    if sharing:
        lines += ["", sharing]
    return "\n".join(lines)


def _repeats_note(repeats: int) -> list[str]:
    if repeats == 1:
        return []
    even = " (of an even count, the faster middle run)" if repeats % 2 == 0 else ""
    return [f"each row: the backend's median run by wall time of {repeats} round-robin repeats{even}; ratios use "
            f"those runs; min-max: generated tok/s over the repeats; outputs compared with cbrun's first run"]


def _load(values) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def _command(argv: list[str] | None) -> str:
    return "cbrun bench " + shlex.join(sys.argv[1:] if argv is None else argv)


def _settings(args) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


if __name__ == "__main__":
    from jobs.bench import main as _main  # so spawned backend processes find their functions in jobs.bench

    sys.exit(_main())
