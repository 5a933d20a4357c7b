"""`cbrun bench`'s vllm and cbrun-command backends without vLLM installed: the runner's JSON contract through a fake
``vllm`` package (transformers' greedy ``generate`` behind vLLM's ``LLM`` names), skipped-when-absent, setup
errors, the vllm-random-llama workload, and the whole ``cbrun run`` command on gsm8k-long."""

import json
import sys
import textwrap

import pytest

from cbrun.bench import cli, vllm_backend, workloads

#: A stand-in for vLLM with the names the runner uses: ``LLM(model, dtype, seed, skip_tokenizer_init, **kwargs)``,
#: ``LLM.generate(prompts, params, use_tqdm)``, ``SamplingParams``, ``llm.llm_engine.vllm_config.scheduler_config``.
#: Greedy ``generate`` per row, so its outputs equal cbrun's; ``FAKE_VLLM_SHIFT`` set: every token + 1 (wrong).
FAKE_VLLM = """
import os
from types import SimpleNamespace

import torch

__version__ = "0.0.fake"


class SamplingParams:
    def __init__(self, **fields):
        self.__dict__.update(fields)


class LLM:
    def __init__(self, model, dtype, seed, skip_tokenizer_init, **kwargs):
        from transformers import AutoModelForCausalLM

        assert dtype == "float32" and skip_tokenizer_init
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        scheduler = SimpleNamespace(max_num_seqs=kwargs.get("max_num_seqs", 256), max_num_batched_tokens=4096)
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=scheduler))

    def generate(self, prompts, params, use_tqdm=True):
        shift = int(os.environ.get("FAKE_VLLM_SHIFT", "0"))
        outputs = []
        for prompt, p in zip(prompts, params):
            ids = torch.tensor([prompt["prompt_token_ids"]])
            assert p.temperature == 0.0 and not p.detokenize
            eos = [] if p.ignore_eos else list(p.stop_token_ids or [])
            with torch.inference_mode():
                out = self.model.generate(ids, do_sample=False, max_new_tokens=p.max_tokens, eos_token_id=eos,
                                          pad_token_id=0)
            tokens = [t + shift for t in out[0, ids.shape[1]:].tolist()]
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens)], metrics=None))
        return outputs
"""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A directory holding the fake ``vllm`` package, put on the children's PYTHONPATH; returns its python."""
    package = tmp_path / "fake-vllm" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    monkeypatch.setenv("PYTHONPATH", str(package.parent))
    return sys.executable


def bench(args, model_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    markdown = tmp_path / "bench.md"
    code = cli.main(
        [*args, "--model-dir", str(model_dir), "--json", str(out), "--markdown", str(markdown), "--no-isolate"]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert markdown.read_text() == table  # --markdown writes what was printed
    return table, json.loads(out.read_text())


def test_vllm_backend_runs_the_runner_and_checks_outputs(stories260k_dir, tmp_path, capsys, fake_vllm):
    table, report = bench(
        [
            "--workload",
            "gsm8k-stories260k",
            "--rows",
            "3",
            "--max-new-tokens",
            "3:6",
            "--backends",
            "cbrun,vllm",
            "--vllm-python",
            fake_vllm,
            "--vllm-kvcache-gib",
            "3",
            "--vllm-arg",
            "max_num_seqs=7",
        ],
        stories260k_dir,
        tmp_path,
        capsys,
    )
    cbrun, vllm = report["results"]
    assert (cbrun["backend"], vllm["backend"]) == ("cbrun", "vllm")
    assert vllm["rows_equal"] == 3 and vllm["generated_tokens"] == cbrun["generated_tokens"]
    assert "yes (3/3)" in table and "rows equal to cbrun's: 3/3" in table
    assert report["skipped"] == []
    info = vllm["info"]
    assert info["versions"]["vllm"] == "0.0.fake" and info["max_num_seqs"] == 7  # --vllm-arg reached vllm.LLM
    assert info["env"] == {
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_CPU_KVCACHE_SPACE": "3",  # --threads 1
        "VLLM_USE_AOT_COMPILE": "0",
    }
    assert info["init_s"] > 0 and info["process_s"] > vllm["wall_s"] > 0
    assert vllm["rss_peak_mib"] > 0 and vllm["ttft_s"] is None  # no per-request metrics: "n/a", not made up


def test_vllm_outputs_that_differ_are_reported(stories260k_dir, tmp_path, capsys, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_SHIFT", "1")
    table, report = bench(
        [
            "--workload",
            "gsm8k-stories260k",
            "--rows",
            "1",
            "--max-new-tokens",
            "3:3",
            "--backends",
            "cbrun,vllm",
            "--vllm-python",
            fake_vllm,
            "--threads",
            "2",
        ],
        stories260k_dir,
        tmp_path,
        capsys,
    )
    vllm = report["results"][1]
    assert vllm["rows_differing"] == 1 and "NO: 1/1 rows differ" in table
    assert vllm["info"]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_vllm_without_its_python_is_skipped_not_faked(stories260k_dir, tmp_path, capsys):
    table, report = bench(
        ["--workload", "gsm8k-stories260k", "--rows", "2", "--max-new-tokens", "2:2", "--backends", "cbrun,vllm"],
        stories260k_dir,
        tmp_path,
        capsys,
    )
    assert [r["backend"] for r in report["results"]] == ["cbrun"]
    assert report["skipped"] == [{"backend": "vllm", "reason": vllm_backend.SKIPPED_REASON}]
    assert "- vllm: skipped: no --vllm-python PATH given" in table


def test_a_python_without_vllm_is_a_setup_error(stories260k_dir, capsys):
    # This interpreter has no vllm package (the suite never needs one).
    assert (
        cli.main(
            [
                "--workload",
                "gsm8k-stories260k",
                "--rows",
                "2",
                "--backends",
                "cbrun,vllm",
                "--vllm-python",
                sys.executable,
                "--model-dir",
                str(stories260k_dir),
            ]
        )
        == 2
    )
    assert "cannot import vllm" in capsys.readouterr().err


def test_runner_contract_breach_is_an_error(tmp_path):
    workload = workloads.Workload("w", tmp_path, [[1, 2], [3]], [2, 2], (), 64, "two rows", ignore_eos=True)
    with pytest.raises(RuntimeError, match="missing keys"):
        vllm_backend.result_to_run({"outputs": [[5, 6], [7, 8]]}, workload, 1.0, (0.0, 0.0))
    good = dict(
        outputs=[[5, 6, 9], [7]],
        wall_s=1.0,
        cpu_s=1.0,
        init_s=2.0,
        first_token_s=[None, None],
        finish_s=[None, None],
        rss_base_mib=1.0,
        rss_peak_mib=2.0,
        versions={},
        config={"env": {}},
    )
    run = vllm_backend.result_to_run(good, workload, 3.0, (0.0, 0.0))
    assert run.outputs == [[5, 6], [7]] and run.info["process_s"] == 3.0  # cut at each row's limit, as cbrun's
    with pytest.raises(RuntimeError, match="1 output rows for 2 prompts"):
        vllm_backend.result_to_run({**good, "outputs": [[5]]}, workload, 1.0, (0.0, 0.0))
    assert vllm_backend.parse_vllm_arg("max_num_seqs=128") == ("max_num_seqs", 128)
    assert vllm_backend.parse_vllm_arg("block_size=x") == ("block_size", "x")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        vllm_backend.parse_vllm_arg("novalue")


def test_vllm_random_llama_workload_is_seeded_and_ignores_eos(tmp_path):
    model_dir = tmp_path / "model"
    first = workloads.build_workload("vllm-random-llama", 6, (16, 256), 3, model_dir, tmp_path)
    again = workloads.build_workload("vllm-random-llama", 6, (16, 256), 3, model_dir, tmp_path)
    assert (first.prompts, first.max_new_tokens) == (again.prompts, again.max_new_tokens)
    assert first.ignore_eos and first.stop_token_ids == ()
    assert all(40 <= len(p) <= 300 and all(0 <= t < 512 for t in p) for p in first.prompts)
    assert all(16 <= m <= 256 for m in first.max_new_tokens)
    config = json.loads((model_dir / "config.json").read_text())
    assert (
        config["hidden_size"],
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["vocab_size"],
    ) == (512, 8, 8, 4, 512)
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # head_dim vLLM's CPU attention supports
    args = cli._parse_args(["--workload", "vllm-random-llama"])
    assert args.backends == ["cbrun", "cbrun-defaults", "cbrun-budgets", "vllm"] and args.budgets == [(256, 2048)]
    assert (args.max_requests, args.max_batch_tokens, args.rows) == (64, 256, 128)


@pytest.mark.slow  # three rows of up to 256 tokens through cbrun, the whole command and generate
def test_whole_command_beside_generate_on_the_long_workload(stories260k_dir, tmp_path, capsys):
    args = cli._parse_args(["--workload", "gsm8k-long"])
    assert args.backends == ["cbrun", "cbrun-defaults", "cbrun-command", "hf-generate"]
    assert (args.batch_sizes, args.hf_threads) == ([64], None)  # generate at batch 64, torch's default threads

    table, report = bench(
        [
            "--workload",
            "gsm8k-long",
            "--rows",
            "3",
            "--backends",
            "cbrun,cbrun-command,hf-generate",
            "--batch-sizes",
            "3",
        ],
        stories260k_dir,
        tmp_path,
        capsys,
    )
    cbrun, command, generate = report["results"]
    assert command["backend"] == "cbrun-command" and command["rows_equal"] == 3
    assert generate["rows_equal"] == 3 and command["generated_tokens"] == cbrun["generated_tokens"]
    assert command["info"]["generation_s"] > 0 and command["rss_peak_mib"] > 0
    assert command["wall_s"] > command["info"]["generation_s"]  # the whole command: start, load, write too
    assert "whole command (cbrun run, default settings" in table


def test_whole_command_is_skipped_where_rows_have_their_own_limits(stories260k_dir, tmp_path, capsys):
    table, report = bench(
        [
            "--workload",
            "gsm8k-stories260k",
            "--rows",
            "4",
            "--max-new-tokens",
            "2:9",
            "--backends",
            "cbrun,cbrun-command",
        ],
        stories260k_dir,
        tmp_path,
        capsys,
    )
    assert [r["backend"] for r in report["results"]] == ["cbrun"]
    assert report["skipped"][0]["backend"] == "cbrun-command" and "- cbrun-command: skipped:" in table
