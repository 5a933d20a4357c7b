"""The ``Store`` contract, the same on a local directory and on S3 (moto's server): atomic writes, one winner of
``put_if_absent``, listing by prefix, delete, append; the S3 endpoint held by the store, not by the process."""

from __future__ import annotations

import pytest

from cbrun.jobs.store import files as storage
from cbrun.jobs.store.store import FsspecStore, LocalStore, open_store, read_json, write_json


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "out")
    s3 = request.getfixturevalue("s3")
    return open_store(s3.uri("out"))


def test_read_write_and_replace(store):
    assert store.read("_cbrun/job.json") is None
    store.write_atomic("_cbrun/job.json", b"one")
    store.write_atomic("_cbrun/job.json", b"two")
    assert store.read("_cbrun/job.json") == b"two"
    write_json(store, "_cbrun/stats.json", {"b": 1, "a": [2]})
    assert read_json(store, "_cbrun/stats.json") == {"a": [2], "b": 1}
    assert read_json(store, "_cbrun/missing.json") is None


def test_put_if_absent_has_one_winner(store):
    assert store.put_if_absent("records/span-0.json", b"first")
    assert not store.put_if_absent("records/span-0.json", b"second")
    assert store.read("records/span-0.json") == b"first"


def test_list_delete_append(store):
    assert store.list() == [] and store.list("_cbrun") == []
    for name in ("part-1.parquet", "_cbrun/b.json", "_cbrun/a.json", "_cbrun/deep/c.json"):
        store.write_atomic(name, b"x")
    assert store.list("_cbrun") == ["_cbrun/a.json", "_cbrun/b.json", "_cbrun/deep/c.json"]
    assert store.list() == ["_cbrun/a.json", "_cbrun/b.json", "_cbrun/deep/c.json", "part-1.parquet"]
    store.delete("_cbrun/b.json")
    store.delete("_cbrun/never-there.json")  # no error
    assert store.list("_cbrun") == ["_cbrun/a.json", "_cbrun/deep/c.json"]
    store.append("_cbrun/timeline.jsonl", b"1\n")
    store.append("_cbrun/timeline.jsonl", b"2\n")
    assert store.read("_cbrun/timeline.jsonl") == b"1\n2\n"


def test_local_put_if_absent_leaves_no_temporary_file(tmp_path):
    store = LocalStore(tmp_path)
    store.put_if_absent("a", b"1")
    store.put_if_absent("a", b"2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_open_store_classifies_the_path_once(tmp_path):
    assert isinstance(open_store(tmp_path), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    assert open_store(f"file://{tmp_path}").root == str(tmp_path)


def test_the_endpoint_is_the_stores(s3, monkeypatch):
    """With no endpoint in the environment, a store given the server's endpoint reaches it (there is no process-wide
    endpoint setting left to fall back on)."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    assert not hasattr(storage, "configure") and not hasattr(storage, "_endpoint_url")
    store = FsspecStore(s3.uri("held"), endpoint_url=s3.endpoint)
    store.write_atomic("x.json", b"{}")
    assert s3.client().get_object(Bucket=s3.bucket, Key="held/x.json")["Body"].read() == b"{}"
    assert store.endpoint_url == s3.endpoint
