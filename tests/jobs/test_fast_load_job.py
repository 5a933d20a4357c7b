"""A job on the transformers-free load path (``engine.loader = "auto"``) writes the same output parts as on
transformers' (``engine.loader = "transformers"``), with the same fingerprint, so each resumes the other's output;
and the whole ``cbrun run`` command on stories260K never imports transformers, unless the job needs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.config import EngineConfig
from cbrun.engine.core.tokenizer import FastTokenizer, load_tokenizer
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.output.fingerprint import job_fingerprint
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.run.job import run_job
from tests.conftest import REPO_ROOT

ENGINE_CONFIG = EngineConfig(
    page_size=16, max_batch_tokens=256, max_requests_per_batch=16, num_blocks=256, num_threads=1
)
PROMPTS = [
    "Once upon a time",
    "The little dog ran to the park and",
    "Lily had 3 apples and 12 pears.",
    "<s> a prompt that begins with the BOS text",
    "日本語 🙂 byte fallback",
    'Tom said, "Hello!"',
    "  spaces  ",
    "One day, a girl named Sue found a big red ball.",
] * 3


def _write_prompts(path) -> str:
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(len(PROMPTS))], "prompt": PROMPTS}), path, row_group_size=5)
    return str(path)


def _run(make_manifest, model_dir, input_path, out, loader: str, **settings):
    manifest = make_manifest(model_dir, input_path, out, id_column="id", **settings)
    manifest.engine = replace(ENGINE_CONFIG, loader=loader)
    summary = run_job(manifest, progress=False)
    return manifest, summary


@pytest.mark.parametrize("model", ["stories260K", "demo"])
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_new_tokens=24, temperature=0.0, stop=["."]),
        SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, logprobs=2),
    ],
    ids=["greedy-stop", "sampled-logprobs"],
)
def test_job_outputs_are_equal_between_the_two_loaders(
    model, sampling, stories260k_dir, tiny_model_dir, tmp_path, make_manifest, caplog
):
    model_dir = stories260k_dir if model == "stories260K" else tiny_model_dir
    input_path = _write_prompts(tmp_path / "in.parquet")
    with caplog.at_level("INFO", logger="cbrun"):
        fast_manifest, _ = _run(make_manifest, model_dir, input_path, tmp_path / "fast", "auto", sampling=sampling)
    assert "model loader: safetensors, without transformers" in caplog.text
    assert isinstance(load_tokenizer(model_dir), FastTokenizer)
    slow_manifest, _ = _run(make_manifest, model_dir, input_path, tmp_path / "slow", "transformers", sampling=sampling)
    fast, slow = (read_output(tmp_path / d).sort_by("row_index") for d in ("fast", "slow"))
    assert fast.num_rows == len(PROMPTS) and fast.equals(slow)
    assert job_fingerprint(fast_manifest, len(PROMPTS)) == job_fingerprint(slow_manifest, len(PROMPTS))


def test_each_loader_resumes_the_others_output(stories260k_dir, tmp_path, make_manifest):
    input_path = _write_prompts(tmp_path / "in.parquet")
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0)
    _run(make_manifest, stories260k_dir, input_path, tmp_path / "out", "transformers", sampling=sampling, limit=10)
    _, summary = _run(make_manifest, stories260k_dir, input_path, tmp_path / "out", "auto", sampling=sampling)
    assert (summary.num_skipped, summary.num_rows) == (10, len(PROMPTS) - 10)
    _run(make_manifest, stories260k_dir, input_path, tmp_path / "whole", "transformers", sampling=sampling)
    assert (
        read_output(tmp_path / "out").sort_by("row_index").equals(read_output(tmp_path / "whole").sort_by("row_index"))
    )


def _imported_modules(args: list[str], tmp_path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime -m jobs.cli ARGS`` as ``cbrun`` would run; return it and every module imported."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "cbrun.jobs.cli", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    modules = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return done, modules


def test_cbrun_run_on_stories260k_never_imports_transformers(stories260k_dir, tmp_path):
    input_path = _write_prompts(tmp_path / "in.parquet")
    args = [
        "run",
        "--model",
        str(stories260k_dir),
        "--input",
        input_path,
        "--prompt-column",
        "prompt",
        "--output",
        str(tmp_path / "out"),
        "--max-new-tokens",
        "8",
        "--no-progress",
    ]
    done, modules = _imported_modules(args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{len(PROMPTS)} rows (0 errors" in done.stdout
    assert {"torch", "tokenizers", "safetensors", "cbrun.engine.model.models.llama"} <= modules
    assert not {m for m in modules if m.split(".")[0] in ("transformers", "huggingface_hub")}
    # ... and one that needs transformers' modules loads them, lazily, only then
    done, modules = _imported_modules(
        args[:7]
        + [
            "--output",
            str(tmp_path / "out2"),
            "--max-new-tokens",
            "8",
            "--no-progress",
            "--set",
            "engine.model_impl=transformers",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert {"transformers", "transformers.models.auto.auto_factory"} <= modules
    assert "model loader: transformers (model_impl = transformers" in done.stderr
    assert json.loads((tmp_path / "out" / "_cbrun" / "job.json").read_text()) == json.loads(
        (tmp_path / "out2" / "_cbrun" / "job.json").read_text()
    )
