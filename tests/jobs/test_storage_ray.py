"""A Ray run with 2 replicas reading its input from S3 and committing its own parts to S3 (moto's server)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.config.settings import ClusterSettings
from cbrun.jobs.output.commits import read_records
from cbrun.jobs.output.output_dir import open_output
from cbrun.jobs.output.status import status_report
from cbrun.jobs.run.job import run_job
from cbrun.jobs.store.store import FsspecStore
from tests.jobs.test_storage_s3 import rows_once, upload_input

ENGINE_CONFIG = EngineConfig(page_size=8, max_batch_tokens=64, max_requests_per_batch=4, num_blocks=64)
MANIFEST_DEFAULTS = {
    "sampling": SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
    "commit_every_rows": 4,
    "id_column": "id",
}
NUM_ROWS = 24


@pytest.mark.ray
@pytest.mark.slow
def test_two_replicas_commit_their_own_parts_to_s3(s3, tiny_model_dir, make_manifest, tmp_path):
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    table = pa.table(
        {"id": [f"r{i}" for i in range(NUM_ROWS)], "prompt": [f"a prompt for row {i}" for i in range(NUM_ROWS)]}
    )
    source = upload_input(s3, table, row_group_size=6)
    local = make_manifest(tiny_model_dir, source, tmp_path / "local")
    run_job(local, progress=False)
    env = {name: value for name, value in __import__("os").environ.items() if name.startswith("AWS_")}
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False, runtime_env={"env_vars": env}
    )
    try:
        out = s3.uri("ray-out")
        on_ray = make_manifest(tiny_model_dir, source, out)
        on_ray.cluster = ClusterSettings(executor="ray", num_replicas=2, num_cpus_per_replica=1, batch_size=6)
        summary = run_job(on_ray, progress=False)
    finally:
        ray.shutdown()
    assert summary.num_rows == NUM_ROWS and summary.num_errors == 0 and summary.exit_code == 0
    assert rows_once(out) == rows_once(tmp_path / "local")
    # the replicas committed span records (the driver wrote no part of its own), and the job finished
    records = read_records(FsspecStore(out))
    assert records and all(r.name.startswith("_cbrun/commits/span-") for r in records)
    assert open_output(out).is_finished()
    text, code = status_report(out)
    assert code == 0 and f"total: {NUM_ROWS}/{NUM_ROWS} rows done" in text
