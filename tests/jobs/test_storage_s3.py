"""Jobs whose input and output live on S3, against a real S3 server on this machine (moto's server mode).

Every row exactly once and equal to a local run: after SIGKILLs at random moments, a server restarted mid-job, and
5xx replies injected on PUTs; a second run into a leased output refuses; an expired lease is taken over.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.cli import main
from cbrun.jobs.output.commits import CommitRecord, add_span, new_attempt, read_records
from cbrun.jobs.output.lease import Lease, LeaseLost
from cbrun.jobs.output.object_parts import commit_span
from cbrun.jobs.output.output_dir import open_output, read_output
from cbrun.jobs.output.writer import OutputRow, rows_to_table
from cbrun.jobs.run.job import JobAborted, JobError, run_job
from cbrun.jobs.store import cache as storage_cache
from cbrun.jobs.store import files as storage
from cbrun.jobs.store.store import FsspecStore
from tests.jobs.cli_args import keyed_run_argv, kill_session, run_argv
from tests.jobs.s3_faults import FaultyProxy
from tests.jobs.test_resume import cbrun_command

ENGINE_CONFIG = EngineConfig(page_size=8, max_batch_tokens=64, max_requests_per_batch=2, num_blocks=64)
MANIFEST_DEFAULTS = {
    "sampling": SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True),
    "commit_every_rows": 2,
    "id_column": "id",
}
NUM_ROWS = 14


def input_table(num_rows: int = NUM_ROWS) -> pa.Table:
    return pa.table(
        {"id": [f"r{i}" for i in range(num_rows)], "prompt": [f"a prompt for row {i}" for i in range(num_rows)]}
    )


def upload_input(s3, table: pa.Table, key: str = "in/prompts.parquet", row_group_size: int = 4) -> str:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=row_group_size)
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=buffer.getvalue())
    return s3.uri(key)


def rows_once(output) -> dict[int, tuple]:
    """{row_index: (completion ids, finish reason)}, asserting that no row appears twice."""
    rows = read_output(output).to_pylist()
    by_index = {r["row_index"]: (r["completion_token_ids"], r["finish_reason"]) for r in rows}
    assert len(by_index) == len(rows), "a row was committed twice"
    return by_index


@pytest.fixture(scope="module")
def local_rows(tiny_model_dir, tiny_engine, tmp_path_factory, request):
    """The rows of an uninterrupted local run over the same input (the oracle)."""
    from tests.jobs.conftest import make_manifest as _  # noqa: F401 - documents where the factory lives

    tmp = tmp_path_factory.mktemp("local")
    pq.write_table(input_table(), tmp / "in.parquet", row_group_size=4)
    from cbrun.jobs.config.manifest import JobManifest
    from cbrun.jobs.config.settings import InputSettings, ModelSettings, OutputSettings

    manifest = JobManifest(
        model=ModelSettings(path=str(tiny_model_dir)),
        input=InputSettings(path=str(tmp / "in.parquet"), prompt_column="prompt", id_column="id"),
        sampling=MANIFEST_DEFAULTS["sampling"],
        engine=ENGINE_CONFIG,
        output=OutputSettings(path=str(tmp / "out"), commit_every_rows=2),
    )
    run_job(manifest, progress=False, engine=tiny_engine)
    rows = rows_once(tmp / "out")
    assert len(rows) == NUM_ROWS
    return rows


def test_s3_input_and_output_equal_a_local_run(s3, tiny_model_dir, tiny_engine, make_manifest, local_rows):
    source = upload_input(s3, input_table())
    out = s3.uri("out")
    summary = run_job(make_manifest(tiny_model_dir, source, out), progress=False, engine=tiny_engine)
    assert summary.exit_code == 0 and summary.num_rows == NUM_ROWS
    assert rows_once(out) == local_rows
    checkpoint = open_output(out)
    assert checkpoint.is_finished() and checkpoint.read_stats()["num_rows_in_output"] == NUM_ROWS
    assert checkpoint.read_job_file()["input"]["path"] == source
    # one commit record per part, and nothing else written beside the parts
    records = read_records(FsspecStore(out))
    names = {
        k["Key"].removeprefix("out/") for k in s3.client().list_objects_v2(Bucket=s3.bucket, Prefix="out/")["Contents"]
    }
    assert {r.part for r in records} == {n for n in names if n.startswith("part-")}
    assert sum(len(r.rows()) for r in records) == NUM_ROWS
    # a finished job is recognised as such, without loading the model
    again = run_job(make_manifest(tiny_model_dir, source, out), progress=False, engine=tiny_engine)
    assert again.already_finished
    # standard readers read the output as a data set (cbrun's own _cbrun/ and _SUCCESS are skipped)
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(
        endpoint_override=s3.endpoint, access_key="testing", secret_key="testing", region="us-east-1"
    )
    table = pq.read_table(f"{s3.bucket}/out", filesystem=fs)
    assert sorted(table.column("row_index").to_pylist()) == list(range(NUM_ROWS))


def test_the_jobs_endpoint_reaches_input_and_output_without_the_environment(
    s3, tiny_model_dir, tiny_engine, make_manifest, local_rows, monkeypatch
):
    """``[storage] endpoint_url`` alone (no AWS_ENDPOINT_URL): the input's listing and reads, the fingerprint, the
    lease, the parts, the records and the finish all talk to that endpoint, held by their stores and readers."""
    source = upload_input(s3, input_table(), key="in-held/prompts.parquet")
    out = s3.uri("out-held")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    manifest = make_manifest(tiny_model_dir, source, out)
    manifest.storage.endpoint_url = s3.endpoint
    assert run_job(manifest, progress=False, engine=tiny_engine).exit_code == 0
    output = open_output(out, endpoint_url=s3.endpoint)
    assert output.is_finished() and output.read_job_file()["input"]["files"]
    assert {
        r["row_index"]: (r["completion_token_ids"], r["finish_reason"]) for r in output.read_rows().to_pylist()
    } == (local_rows)


def test_status_reads_an_s3_output(s3, tiny_model_dir, tiny_engine, make_manifest, capsys):
    source = upload_input(s3, input_table(6))
    out = s3.uri("out")
    run_job(make_manifest(tiny_model_dir, source, out), progress=False, engine=tiny_engine)
    assert main(["status", out]) == 0
    text = capsys.readouterr().out
    assert "total: 6/6 rows done" in text and "job complete" in text


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume(s3, tiny_model_dir, local_rows):
    """Kill ``cbrun run`` (S3 in, S3 out) with SIGKILL at random moments, three times, then let it finish."""
    source = upload_input(s3, input_table())
    out = s3.uri("out")
    sets = (
        "engine.max_requests_per_batch=2",
        "engine.max_batch_tokens=64",
        "engine.num_blocks=64",
        "engine.page_size=8",
        "sampling.ignore_eos=true",
        "output.commit_every_rows=2",
    )
    args = keyed_run_argv(tiny_model_dir, source, out, 5, sets, "--temperature", "0")
    rng = random.Random(31)
    kills = 0
    for _ in range(3):
        process = subprocess.Popen(
            cbrun_command() + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            before = len(read_records(FsspecStore(out)))
            deadline = time.monotonic() + 120
            # NOTE: wait for this run's first commit, then kill it at a random moment within the next commits
            while len(read_records(FsspecStore(out))) == before and process.poll() is None:
                assert time.monotonic() < deadline, "no part was committed in time"
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.3))
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                kills += 1
            process.wait()
        finally:
            kill_session(process)
        if open_output(out).is_finished():
            break
        # NOTE: the killed run's lease stays, unexpired; the next run sees that its holder died on this host
    assert kills >= 1
    done = subprocess.run(cbrun_command() + args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert rows_once(out) == local_rows
    # no garbage is left: every part has its record
    names = [k["Key"] for k in s3.client().list_objects_v2(Bucket=s3.bucket, Prefix="out/part-")["Contents"]]
    assert len(names) == len(read_records(FsspecStore(out)))


def test_second_run_refuses_while_the_lease_is_live(s3, tiny_model_dir, tiny_engine, make_manifest, capsys):
    source = upload_input(s3, input_table(4))
    out = s3.uri("out")
    holder = Lease(FsspecStore(out))
    holder.acquire()
    try:
        with pytest.raises(JobError, match="in use by another cbrun run .*pid"):
            run_job(make_manifest(tiny_model_dir, source, out), progress=False, engine=tiny_engine)
        assert (
            main(
                [
                    *run_argv(str(tiny_model_dir), source, out),
                    "--prompt-column",
                    "prompt",
                    "--no-progress",
                ]
            )
            == 2
        )
        assert "in use by another cbrun run" in capsys.readouterr().err
    finally:
        holder.release()
    assert run_job(make_manifest(tiny_model_dir, source, out), progress=False, engine=tiny_engine).exit_code == 0


def test_an_expired_lease_is_taken_over(s3, tiny_model_dir, tiny_engine, make_manifest):
    source = upload_input(s3, input_table(4))
    out = s3.uri("out")
    stale = {"host": "gone", "pid": 1, "token": "old", "started": "then", "expires": time.time() - 1}
    s3.client().put_object(Bucket=s3.bucket, Key="out/_cbrun/lease-0-of-1.json", Body=json.dumps(stale))
    summary = run_job(make_manifest(tiny_model_dir, source, out), progress=False, engine=tiny_engine)
    assert summary.exit_code == 0 and len(rows_once(out)) == 4
    # the run deleted its own lease when it ended
    assert storage.read_file(s3.uri("out/_cbrun/lease-0-of-1.json")) is None


def test_uncommitted_parts_are_deleted_by_the_next_run(s3, tiny_model_dir, tiny_engine, make_manifest):
    source = upload_input(s3, input_table(6))
    out = s3.uri("out")
    run_job(make_manifest(tiny_model_dir, source, out, limit=4), progress=False, engine=tiny_engine)
    garbage = "out/part-t0000000000000x00000000-000000-r000000000004.parquet"  # a part whose record never came
    s3.client().put_object(Bucket=s3.bucket, Key=garbage, Body=b"half a job")
    run_job(make_manifest(tiny_model_dir, source, out), progress=False, engine=tiny_engine)
    assert storage.read_file(s3.uri(garbage)) is None
    assert sorted(rows_once(out)) == list(range(6))


def test_server_restarted_mid_job(s3, tiny_model_dir, tiny_engine, make_manifest, local_rows, monkeypatch):
    """The S3 server goes away for a moment after the first commit: the calls in flight are retried."""
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.1)
    source = upload_input(s3, input_table())
    out = s3.uri("out")
    restarted = threading.Event()

    def restart_after_first_commit():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if read_records(FsspecStore(out)):
                    break
            except storage.StorageError:
                pass
            time.sleep(0.02)
        s3.restart()
        restarted.set()

    thread = threading.Thread(target=restart_after_first_commit)
    thread.start()
    try:
        summary = run_job(make_manifest(tiny_model_dir, source, out), progress=False, engine=tiny_engine)
    finally:
        thread.join()
    assert restarted.is_set() and summary.exit_code == 0
    assert rows_once(out) == local_rows


def test_5xx_on_put_is_retried(s3, tiny_model_dir, tiny_engine, make_manifest, local_rows, monkeypatch):
    source = upload_input(s3, input_table())
    out = s3.uri("out")
    with FaultyProxy(s3.endpoint, fail_puts=lambda n, path: "/out/part-" in path and n % 2 == 0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        summary = run_job(make_manifest(tiny_model_dir, source, out), progress=False, engine=tiny_engine)
        assert proxy.num_failed >= 3
    assert summary.exit_code == 0
    assert rows_once(out) == local_rows


def test_a_store_that_keeps_failing_stops_the_job_with_exit_1(
    s3, tiny_model_dir, tiny_engine, make_manifest, local_rows, monkeypatch
):
    """PUTs of parts fail for good after the first two parts: the run stops (JobAborted, exit 1); the two parts
    stay committed, and a rerun against a healthy store completes the job with every row once."""
    monkeypatch.setattr(storage, "NUM_RETRIES", 1)
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.01)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries: none, to keep the test short
    source = upload_input(s3, input_table())
    out = s3.uri("out")
    with FaultyProxy(s3.endpoint, fail_puts=lambda n, path: "/out/part-" in path and n >= 2) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        with pytest.raises(JobAborted, match="committed"):
            run_job(make_manifest(tiny_model_dir, source, out), progress=False, engine=tiny_engine)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    assert len(rows_once(out)) == 4  # two parts of two rows
    s3.client().delete_object(Bucket=s3.bucket, Key="out/_cbrun/lease-0-of-1.json")  # as if it expired
    assert run_job(make_manifest(tiny_model_dir, source, out), progress=False, engine=tiny_engine).exit_code == 0
    assert rows_once(out) == local_rows


def test_commit_record_round_trip_holds_rows_and_error_rows():
    indices = np.array([7, 3, 3, 12, 9], dtype=np.int64)  # row 3 with two samples
    is_error = np.array([False, False, False, True, False])
    record = CommitRecord.of_rows("part-x.parquet", indices, is_error)
    again = CommitRecord.from_json(record.to_json())
    assert again == record and (again.first_row, again.end_row) == (3, 13)
    assert again.rows().tolist() == [3, 7, 9, 12] and again.error_rows().tolist() == [12]
    assert again.num_output_rows == 5 and again.num_error_rows == 1
    done = np.zeros(10, dtype=bool)
    add_span(done, again, again.done)  # rows past the job's 10 rows are left out
    assert np.flatnonzero(done).tolist() == [3, 7, 9]


def test_only_one_attempt_at_a_span_wins(s3):
    out = s3.uri("out")
    table = rows_to_table(
        [
            OutputRow(
                id=f"r{i}",
                row_index=i,
                completion="x",
                completion_token_ids=[1],
                num_prompt_tokens=1,
                num_completion_tokens=1,
                finish_reason="stop",
            )
            for i in range(4, 8)
        ]
    )
    assert commit_span(FsspecStore(out), table, new_attempt(), 0)
    assert (
        commit_span(FsspecStore(out), table, "t0000000000000x00000001", 0) is False
    )  # a retried batch: its part is deleted
    parts = [k["Key"] for k in s3.client().list_objects_v2(Bucket=s3.bucket, Prefix="out/part-")["Contents"]]
    records = read_records(FsspecStore(out))
    assert len(parts) == 1 and [r.name for r in records] == ["_cbrun/commits/span-r000000000004-000000000008.json"]
    winner = records[0].part
    attempt = winner.split("-")[1]
    assert commit_span(
        FsspecStore(out), table, attempt, 0
    )  # the winner's own retry (its reply lost) still counts as committed
    assert [r.part for r in read_records(FsspecStore(out))] == [winner]


def test_a_lease_is_renewed_and_a_lost_one_stops_the_writer(s3):
    out = s3.uri("out")
    lease = Lease(FsspecStore(out), ttl_s=0.9)
    lease.acquire()
    try:
        time.sleep(1.2)  # past the first expiry: renewed meanwhile
        lease.check()
        s3.client().put_object(Bucket=s3.bucket, Key="out/_cbrun/lease-0-of-1.json", Body=b'{"token": "thief"}')
        time.sleep(0.7)
        with pytest.raises(LeaseLost):
            lease.check()
    finally:
        lease.release()
    assert b"thief" in storage.read_file(s3.uri("out/_cbrun/lease-0-of-1.json"))  # not deleted: not ours


def test_retry_errors_and_overwrite_on_s3(s3, tiny_model_dir, tiny_engine, make_manifest):
    """--retry-errors takes the error rows out of their parts (rewritten under new names) and runs them again;
    --overwrite discards the output's results: either way every row is in the output once."""
    prompts = [f"a prompt for row {i}" if i != 2 else None for i in range(6)]
    source = upload_input(s3, pa.table({"id": [f"r{i}" for i in range(6)], "prompt": prompts}))
    out = s3.uri("out")
    first = run_job(make_manifest(tiny_model_dir, source, out), progress=False, engine=tiny_engine)
    assert first.num_errors == 1 and rows_once(out)[2][1] == "error"
    parts_before = {r.part for r in read_records(FsspecStore(out))}
    retried = run_job(make_manifest(tiny_model_dir, source, out), progress=False, engine=tiny_engine, retry_errors=True)
    assert retried.num_rows == 1 and retried.num_skipped == 5
    assert sorted(rows_once(out)) == list(range(6)) and rows_once(out)[2][1] == "error"
    assert {r.part for r in read_records(FsspecStore(out))} != parts_before  # the part that held row 2 was rewritten
    manifest = make_manifest(
        tiny_model_dir, source, out, sampling=SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    )
    manifest.output.overwrite = True
    summary = run_job(manifest, progress=False, engine=tiny_engine)
    assert summary.num_skipped == 0 and summary.num_rows == 6
    assert all(len(ids) == 2 for i, (ids, _) in rows_once(out).items() if i != 2)


def test_a_model_on_s3_is_downloaded_once_into_the_cache(
    s3, tiny_model_dir, make_manifest, local_rows, tmp_path, monkeypatch
):
    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path / "cache"))
    for path in tiny_model_dir.rglob("*"):
        if path.is_file():
            key = f"models/tiny/{path.relative_to(tiny_model_dir).as_posix()}"
            s3.client().put_object(Bucket=s3.bucket, Key=key, Body=path.read_bytes())
    source = upload_input(s3, input_table())
    summary = run_job(make_manifest(s3.uri("models/tiny"), source, s3.uri("out")), progress=False)
    assert summary.exit_code == 0 and rows_once(s3.uri("out")) == local_rows
    copies = list((tmp_path / "cache" / "models").iterdir())
    assert len(copies) == 1 and (copies[0] / "config.json").is_file()
    stamp = (copies[0] / "config.json").stat().st_mtime_ns
    assert storage_cache.local_model(s3.uri("models/tiny")) == str(copies[0])  # unchanged objects: no download
    assert (copies[0] / "config.json").stat().st_mtime_ns == stamp
