"""Prefix-aware ordering changes the order of work, never a row's output; its window bounds the look-ahead; a
SIGKILLed ordered job with several samples per row resumes exactly."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import cbrun.jobs.output.local_parts
import cbrun.jobs.run.resolve
from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.cli import main
from cbrun.jobs.config.manifest import load_manifest
from cbrun.jobs.input.reader import template_fields
from cbrun.jobs.modes.ordering import order_by_prefix, prompt_sort_key
from cbrun.jobs.output.writer import committed_parts
from cbrun.jobs.run.job import run_job
from tests.jobs.cli_args import keyed_run_argv
from tests.jobs.test_resume import kill_after_first_commit

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE_CONFIG = EngineConfig(page_size=4, max_batch_tokens=64, max_requests_per_batch=2, num_blocks=128)
MANIFEST_DEFAULTS = {
    "sampling": SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True),
    "seed": 7,
    "commit_every_rows": 3,
    "id_column": "id",
}
PREFIXES = ["The quick brown fox jumps over the dog. ", "Once upon a time there was a cat. ", "Q: 2 + 2 = ? A: "]


def write_shared_prefix_input(path, num_rows: int, seed: int = 0, **extra) -> list[str]:
    """Rows whose prompts are one of three shared prefixes plus a short tail, in shuffled order."""
    rng = random.Random(seed)
    prompts = [rng.choice(PREFIXES) + f"row {i}" for i in range(num_rows)]
    pq.write_table(
        pa.table({"id": [f"r{i}" for i in range(num_rows)], "prompt": prompts, **extra}), path, row_group_size=8
    )
    return prompts


def output_rows(output_dir) -> dict[tuple[int, int], dict]:
    rows = [r for p in committed_parts(output_dir) for r in pq.read_table(p).to_pylist()]
    by_key = {(r["row_index"], r["sample_index"]): r for r in rows}
    assert len(by_key) == len(rows), "a (row_index, sample_index) was written twice"
    return by_key


def test_sort_key_orders_like_the_token_id_lists():
    lists = [[3, 1], [3], [300, 2], [2, 70000], [3, 1, 0], [], [256], [255, 1]]
    assert sorted(lists, key=prompt_sort_key) == sorted(lists)


def test_windows_are_sorted_ties_keep_input_order_and_window_zero_passes_through():
    items = [("b", 0), ("a", 1), ("b", 2), ("c", 3), ("a", 4), ("a", 5), ("b", 6)]
    key = {"a": [1, 2], "b": [1, 3], "c": [0]}
    ordered = list(order_by_prefix(items, key=lambda it: key[it[0]], window=4))
    assert ordered == [("c", 3), ("a", 1), ("b", 0), ("b", 2), ("a", 4), ("a", 5), ("b", 6)]
    assert list(order_by_prefix(items, key=lambda it: key[it[0]], window=0)) == items
    assert sorted(ordered) == sorted(items)  # a permutation: nothing lost, nothing repeated


def test_window_bounds_the_items_pulled_ahead():
    pulled = []

    def source():
        for i in range(20):
            pulled.append(i)
            yield i

    out = []
    for item in order_by_prefix(source(), key=lambda i: [100 - i], window=6):
        out.append(item)
        assert len(pulled) - len(out) < 6
    assert out == [5, 4, 3, 2, 1, 0, 11, 10, 9, 8, 7, 6, 17, 16, 15, 14, 13, 12, 19, 18]


def test_ordering_changes_the_order_of_work_never_a_row(
    tiny_model_dir, tiny_engine, tmp_path, monkeypatch, make_manifest
):
    prompts = write_shared_prefix_input(tmp_path / "in.parquet", 24)
    submitted = []
    generate = tiny_engine.generate

    def recording_generate(requests, **kwargs):
        def tap():
            for request in requests:
                submitted.append(request)
                yield request

        return generate(tap(), **kwargs)

    monkeypatch.setattr(tiny_engine, "generate", recording_generate)
    outputs = {}
    for window in (0, 10):
        submitted.clear()
        manifest = make_manifest(
            tiny_model_dir, tmp_path / "in.parquet", tmp_path / f"w{window}", order_window=window, n=2
        )
        summary = run_job(manifest, progress=False, engine=tiny_engine)
        assert (summary.num_rows, summary.num_output_rows, summary.num_errors) == (24, 48, 0)
        outputs[window] = output_rows(tmp_path / f"w{window}")
        rows_in_order = [request_id[0] for request_id, _, _ in submitted[::2]]
        assert [request_id for request_id, _, _ in submitted] == [(r, s) for r in rows_in_order for s in (0, 1)]
        if window == 0:
            assert rows_in_order == list(range(24))
        else:  # windows of 10 rows, each sorted by prompt; different from the input order
            assert sorted(rows_in_order) == list(range(24)) and rows_in_order != list(range(24))
            prompt_ids = [ids for _, ids, _ in submitted[::2]]
            for start in (0, 10, 20):
                assert set(rows_in_order[start : start + 10]) == set(range(start, min(start + 10, 24)))
                assert prompt_ids[start : start + 10] == sorted(prompt_ids[start : start + 10])
            # rows sharing a prefix now run back to back within each window
            firsts = [PREFIXES.index(next(p for p in PREFIXES if prompts[r].startswith(p))) for r in rows_in_order]
            assert sum(a != b for a, b in zip(firsts, firsts[1:])) <= 3 * 3 - 1
    assert outputs[0] == outputs[10]
    assert sorted(outputs[10]) == [(r, s) for r in range(24) for s in (0, 1)]


class _CountingReader:
    """Stands in for the job's reader: counts the rows pulled ahead of those handed to the writer."""

    def __init__(self, reader, written: list[int]):
        self.reader = reader
        self.written = written
        self.max_ahead = 0

    def __getattr__(self, name):
        return getattr(self.reader, name)

    def iter_rows(self, done=None):
        pulled = 0
        for row in self.reader.iter_rows(done):
            pulled += 1
            self.max_ahead = max(self.max_ahead, pulled - len(self.written))
            yield row


@pytest.mark.parametrize("window", [0, 8])
def test_the_window_bounds_rows_read_ahead_of_the_writer(
    tiny_model_dir, tiny_engine, tmp_path, monkeypatch, window, make_manifest
):
    write_shared_prefix_input(tmp_path / "in.parquet", 40)
    written: list[int] = []
    readers = []

    class CountingWriter(cbrun.jobs.output.local_parts.PartWriter):
        def add_group(self, rows):
            written.append(rows[0].row_index)
            super().add_group(rows)

    open_reader = cbrun.jobs.run.resolve.open_reader
    monkeypatch.setattr(
        cbrun.jobs.run.resolve,
        "open_reader",
        lambda m, model=None: readers.append(_CountingReader(open_reader(m, model), written)) or readers[-1],
    )
    monkeypatch.setattr(cbrun.jobs.output.local_parts, "PartWriter", CountingWriter)
    manifest = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", order_window=window)
    run_job(manifest, progress=False, engine=tiny_engine)
    assert sorted(written) == list(range(40))
    max_in_flight = 4 * ENGINE_CONFIG.max_requests_per_batch  # the job's look-ahead into the engine
    assert readers[-1].max_ahead <= window + max_in_flight
    if window:
        assert readers[-1].max_ahead > window  # the job did read a whole window ahead


def test_killed_ordered_run_with_samples_resumes_exactly(tiny_model_dir, tmp_path, capsys, make_manifest):
    num_rows = 12
    write_shared_prefix_input(
        tmp_path / "in.parquet", num_rows, n=pa.array([1, 3, None, 2] * (num_rows // 4), pa.int64())
    )
    expected_samples = {i: [1, 3, 2, 2][i % 4] for i in range(num_rows)}  # null: the job's n = 2
    out = tmp_path / "out"
    sets = [
        "input.order_window=5",
        "sampling.n=2",
        "sampling.seed=7",
        "sampling.temperature=1.0",
        "sampling.ignore_eos=true",
        "output.commit_every_rows=2",
        *[
            f"engine.{k}={v}"
            for k, v in (("page_size", 4), ("max_batch_tokens", 64), ("max_requests_per_batch", 2), ("num_blocks", 128))
        ],
    ]
    args = keyed_run_argv(tiny_model_dir, tmp_path / "in.parquet", out, 6, sets)

    kill_after_first_commit(args, out)
    killed = output_rows(out)
    killed_rows = {r for r, _ in killed}
    assert 0 < len(killed_rows) < num_rows
    for r in killed_rows:  # a committed row has all of its samples
        assert sorted(s for rr, s in killed if rr == r) == list(range(expected_samples[r]))

    assert main(args) == 0  # resumed in this process (the killed one was a subprocess)
    assert f"(0 errors, {len(killed_rows)} skipped)" in capsys.readouterr().out

    reference = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "reference", order_window=0, n=2)
    run_job(reference, progress=False)  # input order, one uninterrupted run
    expected = output_rows(tmp_path / "reference")
    got = output_rows(out)
    assert sorted(got) == sorted((r, s) for r, n in expected_samples.items() for s in range(n))
    assert got == expected
    assert {key: got[key] for key in killed} == killed  # committed rows were kept, not recomputed


def test_fewshot_manifest_puts_the_first_exemplar_before_each_question(shared_dir):
    manifest = load_manifest(REPO_ROOT / "manifests" / "gsm8k-fewshot.toml")
    template = manifest.input.template
    assert template_fields(template) == ["question"] and template.endswith("Question: {question}\nAnswer:")
    first = pq.read_table(shared_dir / "data" / "gsm8k_train.parquet").slice(0, 1).to_pylist()[0]
    assert template.format(question="Q?") == (
        f"Question: {first['question']}\nAnswer: {first['answer']}\n\nQuestion: Q?\nAnswer:"
    )
    assert manifest.input.order_window > 0 and manifest.engine.allow_block_sharing
