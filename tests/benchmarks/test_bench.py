"""`cbrun bench` end to end on tiny workloads: the table and JSON come out and every backend equals cbrun; the
few-shot workload, prefix sharing and repeats."""

import json
import tomllib
from pathlib import Path

from cbrun.bench import cli, report, workloads

FEWSHOT_MANIFEST = Path(__file__).resolve().parents[2] / "manifests" / "gsm8k-fewshot.toml"


def run_bench(args: list[str], model_dir: Path, tmp_path: Path, capsys) -> tuple[str, dict]:
    """``cbrun bench ARGS`` in this process on ``model_dir``; returns the printed table and the JSON report."""
    out = tmp_path / "bench.json"
    assert cli.main([*args, "--model-dir", str(model_dir), "--json", str(out), "--no-isolate"]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_bench_tiny_workload_writes_table_and_json(stories260k_dir, tmp_path, capsys):
    table, report = run_bench(
        [
            "--workload",
            "gsm8k-stories260k",
            "--rows",
            "8",
            "--max-new-tokens",
            "4:12",
            "--backends",
            "cbrun,cbrun-static,hf-generate",
            "--batch-sizes",
            "4",
        ],
        stories260k_dir,
        tmp_path,
        capsys,
    )
    assert "| backend |" in table and "outputs == cbrun" in table
    assert "yes (8/8)" in table and "NO:" not in table

    rows = report["results"]
    assert [(r["backend"], r["setting"]) for r in rows] == [
        ("cbrun", ""),
        ("cbrun-static", "batch 4"),
        ("hf-generate", "batch 4"),
    ]
    for row in rows:
        assert row["rows"] == 8 and row["generated_tokens"] > 0 and row["wall_s"] > 0
        assert row["ttft_s"] is not None and row["vs_cbrun"] > 0
        assert row["rss_peak_mib"] is None  # in-process: no per-backend peak memory
    assert rows[0]["rows_equal"] is None  # cbrun is the reference
    assert all(r["rows_equal"] == 8 and r["rows_differing"] == 0 for r in rows[1:])
    assert rows[1]["generated_tokens"] == rows[0]["generated_tokens"] == rows[2]["generated_tokens"]


def test_cut_output_keeps_stop_token_and_limit():
    assert workloads.cut_output([5, 6, 1, 7], 10, (1,)) == [5, 6, 1]
    assert workloads.cut_output([5, 6, 1, 7], 2, (1,)) == [5, 6]
    assert workloads.cut_output([5, 6, 0, 0], 4, (1,)) == [5, 6, 0, 0]


def test_too_many_rows_is_a_setup_error(stories260k_dir):
    assert cli.main(["--workload", "gsm8k-fewshot", "--rows", "5000", "--model-dir", str(stories260k_dir)]) == 2


def test_fewshot_workload_shares_the_exemplar_prefix_and_fits_the_context(stories260k_dir, tmp_path):
    from transformers import AutoTokenizer

    template = workloads.fewshot_template(workloads.gsm8k_exemplars(1))
    assert template == tomllib.loads(FEWSHOT_MANIFEST.read_text())["input"]["template"]
    workload = workloads.build_workload("gsm8k-fewshot", 1319, (16, 256), 0, stories260k_dir, tmp_path)

    # 27 of the 1,319 test prompts are too long for the 512-token context, as the manifest's comment counts.
    assert len(workload.prompts) == len(workload.max_new_tokens) == 1319 - 27
    assert "27 rows left out" in workload.description
    exemplar = template[: template.index("Question: {question}")]
    exemplar_ids = AutoTokenizer.from_pretrained(stories260k_dir)(exemplar)["input_ids"]
    assert len(exemplar_ids) > 200
    assert all(p[: len(exemplar_ids)] == exemplar_ids for p in workload.prompts)
    assert all(len(p) < 512 and 1 <= m <= 512 - len(p) for p, m in zip(workload.prompts, workload.max_new_tokens))


def test_median_run_is_chosen_by_wall_time_and_spread_kept():
    def run(backend, repeat, wall_s, rows_differing=0):
        return dict(
            backend=backend,
            setting="",
            repeat=repeat,
            wall_s=wall_s,
            generated_tok_s=100 / wall_s,
            rows_differing=rows_differing,
        )

    runs = [
        run("cbrun", 1, 3.0, None),
        run("hf-cb", 1, 4.0),
        run("cbrun", 2, 1.0),
        run("hf-cb", 2, 2.0, 5),
        run("cbrun", 3, 2.0),
        run("hf-cb", 3, 1.0),
        run("hf-cb", 4, 3.0),
    ]
    cbrun, hf_cb = report.median_runs(runs)
    assert (cbrun["repeat"], cbrun["repeats"], cbrun["generated_tok_s_range"]) == (3, 3, [100 / 3, 100.0])
    assert cbrun["repeats_differing"] == []
    assert (hf_cb["repeat"], hf_cb["repeats"]) == (2, 4)  # even count: the faster of the two middle runs
    assert hf_cb["repeats_differing"] == [{"repeat": 2, "rows_differing": 5}]
    assert report._outputs_cell({**hf_cb, "rows": 8}) == "NO: 5/8 rows differ in repeat 2"


def test_repeats_with_and_without_sharing_on_the_fewshot_workload(stories260k_dir, tmp_path, capsys):
    table, report = run_bench(
        [
            "--workload",
            "gsm8k-fewshot",
            "--rows",
            "6",
            "--max-new-tokens",
            "4:8",
            "--backends",
            "cbrun,cbrun-nosharing",
            "--repeats",
            "3",
        ],
        stories260k_dir,
        tmp_path,
        capsys,
    )
    assert "gen tok/s min-max" in table and "yes (6/6, all 3 repeats)" in table and "NO:" not in table
    assert "prefix sharing: cbrun served" in table

    runs, rows = report["runs"], report["results"]
    assert [(r["backend"], r["repeat"]) for r in runs] == [
        (b, k) for k in (1, 2, 3) for b in ("cbrun", "cbrun-nosharing")
    ]
    assert all(r["rows_differing"] == 0 for r in runs[1:])  # every run equals cbrun's first, token for token
    for row in rows:
        walls = sorted(r["wall_s"] for r in runs if r["backend"] == row["backend"])
        assert row["repeats"] == 3 and row["wall_s"] == walls[1]
    shared, unshared = rows
    assert unshared["vs_cbrun"] == unshared["generated_tok_s"] / shared["generated_tok_s"]
    assert shared["cached_prompt_tokens"] > 0 and unshared["cached_prompt_tokens"] == 0
    assert shared["computed_tokens"] < unshared["computed_tokens"]


def test_long_workload_beside_the_default_configuration(stories260k_dir, tmp_path, capsys):
    workload = workloads.build_workload("gsm8k-long", 4, (16, 256), 0, stories260k_dir, tmp_path)
    assert workload.max_new_tokens == [min(256, 512 - len(p)) for p in workload.prompts]
    assert workload.stop_token_ids == (1,) and len(workload.prompts) == 4

    table, report = run_bench(
        ["--workload", "gsm8k-long", "--rows", "4", "--backends", "cbrun,cbrun-defaults"],
        stories260k_dir,
        tmp_path,
        capsys,
    )
    assert "| cbrun-defaults |" in table and "yes (4/4)" in table
    tuned, defaults = report["results"]
    assert (tuned["backend"], defaults["backend"]) == ("cbrun", "cbrun-defaults")
    assert defaults["rows_differing"] == 0 and defaults["generated_tokens"] == tuned["generated_tokens"]


def test_command_summary_splits_the_whole_command_around_generation():
    command = {
        "backend": "cbrun-command",
        "setting": "",
        "generated_tokens": 4000,
        "generated_tok_s": 200.0,
        "wall_s": 20.0,
        "rss_peak_mib": 700.4,
        "info": {"generation_s": 12.0, "job_elapsed_s": 17.5},
    }
    generate = {"backend": "hf-generate", "setting": "batch 64", "generated_tok_s": 400.0, "info": {"threads": 2}}
    line = report.command_summary([command, generate])
    assert line == (
        "whole command (cbrun run, default settings, process start to exit): 200 generated tok/s, 333 "
        "over its generation phase = 0.50x hf-generate batch 64 at 2 thread(s) (400 tok/s, generation "
        "only); its 20.0 s: generation 12.0 s, job setup and finish 5.5 s, interpreter start, imports "
        "before the job and exit 2.5 s; peak RSS 700 MiB"
    )
    del command["info"]["job_elapsed_s"]  # a result file from before the split: the line without it
    assert report.command_summary([command, generate]).endswith("(400 tok/s, generation only)")


def test_a_run_whose_cpu_time_reads_zero_reports_no_cpu_rate():
    """A subprocess backend reads its CPU time from /proc in 10 ms ticks; a short run on a fast machine reads 0."""
    from cbrun.bench.measure import ModelCost, RunResult

    workload = workloads.Workload("w", Path("."), [[1, 2, 3]], [2], (), 512, "")
    cost = ModelCost(decoder_params=100, lm_head_params=10, attention_per_position=4, total_params=110)
    run = RunResult("vllm", "", [[5, 6]], wall_s=0.01, cpu_s=0.0, first_token_s=[0.005], finish_s=[0.01])
    row = report.summarize(run, workload, None, cost, matmul_gflops=100.0)
    assert row["generated_tok_per_cpu_s"] is None
    assert row["generated_tok_s"] == 2 / 0.01
    timed = report.summarize(RunResult("vllm", "", [[5, 6]], 0.01, 0.5, [0.005], [0.01]), workload, None, cost, 100.0)
    assert timed["generated_tok_per_cpu_s"] == 2 / 0.5


def test_host_bound_workload_defaults_are_the_issues_and_sampled_rows_make_every_token(tmp_path, capsys):
    args = cli._parse_args(["--workload", "host-bound"])
    assert (args.rows, args.new_tokens, args.max_requests, args.batch_sizes) == (512, (128, 128), 256, [256])
    assert args.backends == ["cbrun", "hf-generate", "vllm", "cbrun-sampled-llama3"]
    assert args.vllm_args == {"max_num_seqs": 256, "max_num_batched_tokens": 4096}
    assert cli._parse_args(["--workload", "host-bound", "--vllm-arg", "max_num_seqs=8"]).vllm_args["max_num_seqs"] == 8

    table, report = run_bench(
        ["--workload", "host-bound", "--rows", "6", "--max-new-tokens", "5:5", "--backends", "cbrun-sampled-llama3"],
        tmp_path / "model",
        tmp_path,
        capsys,
    )
    rows = {r["backend"]: r for r in report["results"]}
    assert set(rows) == {"cbrun", "cbrun-sampled-llama3"}
    # ignore_eos: greedy and Llama-3-sampled rows generate every token they may, so their tok/s compare.
    assert rows["cbrun"]["generated_tokens"] == rows["cbrun-sampled-llama3"]["generated_tokens"] == 30
    assert "vocab 512" in report["description"] and "host-cost" in report["description"]
