"""Where the CPU time of one lm-eval run goes, per phase, for ``--model cbrun`` or ``--model hf``.

Usage (from the repo root, eval extra installed, stories260K converted to ``models/stories260K``)::

    OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false python benchmarks/lm_eval_profile.py --backend cbrun
        [--task cbrun_gsm8k_mc] [--limit N] [--no-index-cache] [--model models/stories260K]

One process runs what ``cbrun lm-eval run --model X --tasks TASK`` runs (lm-eval's ``TaskManager`` with
``--include_path tests/evals/tasks``, the backend, ``simple_evaluate``), in process, one thread, with CPU-second
timers (``time.process_time``) around lm-eval's and the backend's functions. Phases:

- imports: lm-eval's evaluator and task modules, this repo's backend module (torch, transformers' base);
- task index: ``TaskManager`` (lm-eval indexing its built-in task configs, from the cache as ``cbrun lm-eval``
  reads it unless ``--no-index-cache``);
- model load: the backend's constructor (transformers' model modules imported, weights, tokenizer, engine);
- lm-eval, building requests: ``ConfigurableTask.build_all_requests`` (templating every document);
- tokenization: the backend's ``loglikelihood`` before ``_loglikelihood_tokens`` (lm-eval's ``TemplateLM``
  loop; cbrun's batch encode);
- scoring: ``_loglikelihood_tokens``; for cbrun split into the C attention kernel, the linear layers (lm head
  included), the rest of the forward pass (RoPE, norms, activations, embedding, K/V writes), the engine's host
  work (scheduling, step inputs, prompt log-probabilities, requests and outputs) and the backend's own (request
  windows, order, results);
- lm-eval, process_results: ``ConfigurableTask.process_results`` (per-document metrics);
- lm-eval, other: the rest of ``simple_evaluate`` (task loading, dataset, aggregation, bookkeeping).

Timers add a few microseconds per call (about 5,000 calls of the attention kernel and linear layers on the
multiple-choice task); on a machine shared with other work every phase is inflated, roughly alike.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Timers:
    """CPU seconds per label, from wrappers around functions (inclusive: a label nested in another counts in
    both)."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()

    def wrap(self, owner, name: str, label: str) -> None:
        """Replace ``owner.name`` (a function or method) by one that adds its CPU seconds to ``label``."""
        function = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] += time.process_time() - start

        setattr(owner, name, timed)

    @contextlib.contextmanager
    def phase(self, label: str):
        """A block whose CPU seconds add to ``label``."""
        start = time.process_time()
        try:
            yield
        finally:
            self.seconds[label] += time.process_time() - start


def load_backend(backend: str, model: str, timers: Timers):
    """The backend's model object, with its scoring timed."""
    if backend == "hf":
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=model, dtype="float32", device="cpu")
        timers.wrap(HFLM, "_loglikelihood_tokens", "scoring")
        return lm
    import cbrun.engine.model.models.llama as llama_family
    import cbrun.jobs.integrations.lm_eval_backend as backend_module
    import cbrun.kernels.cpu_attention

    lm = backend_module.CbrunLM(pretrained=model, num_threads=1)
    engine = lm.engine
    timers.wrap(backend_module.CbrunLM, "_loglikelihood_tokens", "scoring")
    timers.wrap(engine, "step", "engine step")
    timers.wrap(engine.model_runner, "_forward", "forward")
    timers.wrap(cbrun.kernels.cpu_attention.StepKernels, "attention", "attention kernel")
    timers.wrap(llama_family, "apply_linear", "linear layers")
    timers.wrap(engine, "add_request", "add_request")
    return lm


def split(backend: str, timers: Timers, total: float) -> list[tuple[str, float]]:
    """(phase, CPU seconds) rows, exclusive, in run order, summing to ``total``."""
    s = timers.seconds
    tokenization = s["loglikelihood"] - s["scoring"]
    rows = [
        ("imports", s["imports"]),
        ("task index (TaskManager)", s["task index"]),
        ("model load", s["model load"]),
        ("lm-eval: building requests", s["build_all_requests"]),
        ("tokenization", tokenization),
    ]
    if backend == "cbrun":
        rows += [
            ("scoring: attention kernel", s["attention kernel"]),
            ("scoring: linear layers", s["linear layers"]),
            ("scoring: rest of the forward pass", s["forward"] - s["attention kernel"] - s["linear layers"]),
            ("scoring: engine host work", s["engine step"] - s["forward"] + s["add_request"]),
            ("scoring: backend bookkeeping", s["scoring"] - s["engine step"] - s["add_request"]),
        ]
    else:
        rows.append(("scoring (hf _loglikelihood_tokens)", s["scoring"]))
    rows.append(("lm-eval: process_results", s["process_results"]))
    rows.append(("lm-eval: other", total - sum(seconds for _, seconds in rows)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("cbrun", "hf"), default="cbrun")
    parser.add_argument("--task", default="cbrun_gsm8k_mc")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--model", default="models/stories260K")
    parser.add_argument("--no-index-cache", action="store_true", help="index lm-eval's tasks as plain lm_eval")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.chdir(REPO_ROOT)  # the task YAMLs name their data relative to the repo root
    sys.path.insert(0, REPO_ROOT)
    timers = Timers()
    start = time.process_time()
    with timers.phase("imports"):
        import lm_eval.evaluator
        from lm_eval.api.model import TemplateLM
        from lm_eval.api.task import ConfigurableTask
        from lm_eval.tasks import TaskManager

        import cbrun.jobs.integrations.lm_eval_backend  # noqa: F401
        from cbrun.jobs.integrations.lm_eval_task_index import cached_builtin_task_index
    with timers.phase("task index"):
        with contextlib.nullcontext() if args.no_index_cache else cached_builtin_task_index():
            task_manager = TaskManager(include_path="tests/evals/tasks")
    with timers.phase("model load"):
        lm = load_backend(args.backend, args.model, timers)
    timers.wrap(ConfigurableTask, "build_all_requests", "build_all_requests")
    timers.wrap(ConfigurableTask, "process_results", "process_results")
    timers.wrap(type(lm) if args.backend == "cbrun" else TemplateLM, "loglikelihood", "loglikelihood")
    results = lm_eval.evaluator.simple_evaluate(
        model=lm, tasks=[args.task], task_manager=task_manager, limit=args.limit
    )
    total = time.process_time() - start
    metrics = {
        k: round(v, 4)
        for k, v in results["results"][args.task].items()
        if "," in k and "stderr" not in k and isinstance(v, float)
    }
    print(
        f"{args.backend} on {args.task} ({args.limit or 'all'} rows), {metrics}; load average "
        f"{os.getloadavg()[0]:.1f}\n"
    )
    print("| phase | CPU s | share |\n| --- | --- | --- |")
    for phase, seconds in split(args.backend, timers, total):
        print(f"| {phase} | {seconds:.2f} | {100 * seconds / total:.0f}% |")
    print(f"| total | {total:.2f} | 100% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
