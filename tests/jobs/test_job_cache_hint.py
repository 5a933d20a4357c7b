"""The job tells the engine how many requests it will add, so the default KV cache is sized to the job."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.config.manifest import JobManifest
from cbrun.jobs.config.settings import InputSettings, ModelSettings, OutputSettings
from cbrun.jobs.run.locked_run import expected_requests
from cbrun.jobs.run.resources import open_reader


def manifest(tmp_path, columns: dict, n: int = 1, mode: str = "generate") -> JobManifest:
    pq.write_table(pa.table(columns), tmp_path / "in.parquet")
    extra = {"candidates_column": "candidates"} if mode == "score" else {}
    return JobManifest(
        model=ModelSettings(path=str(tmp_path)),
        input=InputSettings(path=str(tmp_path / "in.parquet"), prompt_column="prompt", mode=mode, **extra),
        sampling=SamplingParams(max_new_tokens=4),
        n=n,
        output=OutputSettings(path=str(tmp_path / "o")),
    )


def test_rows_to_do_times_n(tmp_path):
    job = manifest(tmp_path, {"prompt": ["a", "b", "c", "d"]}, n=3)
    done = np.array([True, False, False, True])
    assert expected_requests(job, open_reader(job), done) == 2 * 3


def test_unknown_when_a_row_can_add_more(tmp_path):
    per_row_n = manifest(tmp_path, {"prompt": ["a", "b"], "n": [1, 5]})
    assert expected_requests(per_row_n, open_reader(per_row_n), np.zeros(2, dtype=bool)) is None
    score = manifest(tmp_path, {"prompt": ["a", "b"], "candidates": [["x", "y"], ["z"]]}, mode="score")
    assert expected_requests(score, open_reader(score), np.zeros(2, dtype=bool)) is None
