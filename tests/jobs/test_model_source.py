"""Models by Hub id: read from a real Hugging Face cache layout on disk (blobs, refs, snapshots with relative
symlinks, as huggingface_hub writes it), offline, equal to the same model run from a folder; a resume or a later
shard after ``refs/main`` moved runs the commit the job started at; what cannot be found exits 2 naming why."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.jobs.cli import main
from cbrun.jobs.model.source import (
    HUB_PATTERNS,
    ModelSource,
    ModelSourceError,
    hub_cache_dir,
    is_hub_id,
    resolve_model,
    worker_model_path,
)
from cbrun.jobs.output.writer import committed_parts

REPO = "acme/tiny-llama"
C1 = hashlib.sha1(b"first commit").hexdigest()
C2 = hashlib.sha1(b"second commit").hexdigest()
TOKEN = "hf_do_not_log_this_token"


def add_to_hub_cache(cache: Path, repo_id: str, model_dir: Path, commit: str, ref: str | None = "main") -> Path:
    """Lay ``model_dir``'s files into ``cache`` as huggingface_hub does: each file's bytes once under ``blobs/``
    (named by its etag: sha256 for LFS files, the git blob sha1 otherwise), ``snapshots/<commit>/<file>`` a
    relative symlink to its blob, ``refs/<ref>`` the commit (no newline). Returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.suffix == ".safetensors":
            etag = hashlib.sha256(data).hexdigest()
        else:
            etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        blob = repo / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        move_ref(cache, repo_id, ref, commit)
    return snapshot


def move_ref(cache: Path, repo_id: str, ref: str, commit: str) -> None:
    path = cache / ("models--" + repo_id.replace("/", "--")) / "refs" / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(commit)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny random Llamas (byte tokenizer) of other seeds, and the first saved again as sharded safetensors."""
    from transformers import LlamaForCausalLM

    from cbrun.jobs.cli.demo import build_demo_model

    root = tmp_path_factory.mktemp("hub_models")
    first, second = build_demo_model(root / "first", seed=0), build_demo_model(root / "second", seed=1)
    sharded = root / "sharded"
    LlamaForCausalLM.from_pretrained(first).save_pretrained(sharded, max_shard_size="100KB")
    for path in first.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, sharded / path.name)
    return {"first": first, "second": second, "sharded": sharded}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache under ``HF_HOME``, offline, a token set (it must never be written anywhere)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "hf" / "hub"


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": [f"prompt number {i}" for i in range(6)]}), path, row_group_size=2)
    return path


def run(model, prompts, output, *extra) -> int:
    return main(
        [
            "run",
            "--model",
            str(model),
            "--input",
            str(prompts),
            "--prompt-column",
            "prompt",
            "--output",
            str(output),
            "--max-new-tokens",
            "6",
            "--temperature",
            "0",
            "--set",
            "sampling.ignore_eos=true",
            "--set",
            "engine.max_batch_tokens=64",
            "--set",
            "output.commit_every_rows=2",
            "--no-progress",
            *extra,
        ]
    )


def completions(output) -> dict[int, tuple]:
    rows = [row for part in committed_parts(output) for row in pq.read_table(part).to_pylist()]
    return {row["row_index"]: (row["completion"], tuple(row["completion_token_ids"])) for row in rows}


def recorded_model(output) -> dict:
    return json.loads((Path(output) / "_cbrun" / "job.json").read_text())["model"]


@pytest.mark.parametrize("kind", ["first", "sharded"])
def test_a_hub_id_runs_offline_from_the_cache_equal_to_the_folder(models, hub_cache, prompts, tmp_path, kind, capsys):
    snapshot = add_to_hub_cache(hub_cache, REPO, models[kind], C1)
    weights = sorted(p.name for p in snapshot.glob("*.safetensors"))
    assert len(weights) == (1 if kind == "first" else len(list(models[kind].glob("*.safetensors"))))
    if kind == "sharded":
        assert len(weights) > 1 and (snapshot / "model.safetensors.index.json").is_symlink()
    assert run(models[kind], prompts, tmp_path / "folder") == 0
    assert run(REPO, prompts, tmp_path / "hub") == 0
    logged = capsys.readouterr()
    assert completions(tmp_path / "hub") == completions(tmp_path / "folder") and len(completions(tmp_path / "hub")) == 6
    model = recorded_model(tmp_path / "hub")
    assert (model["path"], model["revision"], model["commit"]) == (REPO, "main", C1)
    assert model["weights"] == recorded_model(tmp_path / "folder")["weights"]
    for path in (tmp_path / "hub").rglob("*"):
        assert not path.is_file() or TOKEN.encode() not in path.read_bytes(), path
    assert TOKEN not in logged.out + logged.err


def test_a_resume_after_main_moved_runs_the_pinned_commit(models, hub_cache, prompts, tmp_path, capsys):
    assert run(models["first"], prompts, tmp_path / "first") == 0
    assert run(models["second"], prompts, tmp_path / "second") == 0
    first, second = completions(tmp_path / "first"), completions(tmp_path / "second")
    assert all(first[i] != second[i] for i in range(6)), "the two revisions must differ for this test to mean much"
    add_to_hub_cache(hub_cache, REPO, models["first"], C1)
    out = tmp_path / "hub"
    assert run(REPO, prompts, out, "--limit", "2") == 0
    add_to_hub_cache(hub_cache, REPO, models["second"], C2)  # main moves on between the run and its resume

    assert run(REPO, prompts, out, "--limit", "4") == 0
    assert completions(out) == {i: first[i] for i in range(4)}
    assert recorded_model(out)["commit"] == C1

    capsys.readouterr()
    assert run(REPO, prompts, out, "--revision", C2) == 2  # asking for another revision is another job
    err = capsys.readouterr().err
    assert "model.commit" in err and "model.revision" in err and "--overwrite" in err, err

    shutil.rmtree(hub_cache / "models--acme--tiny-llama" / "snapshots" / C1)
    assert run(REPO, prompts, out) == 2  # the pinned commit is gone from the cache: refused, not switched
    err = capsys.readouterr().err
    assert f"at commit {C1} (pinned when the job started at revision 'main')" in err, err
    assert "HF_HUB_OFFLINE" in err and "--overwrite" in err, err
    assert completions(out) == {i: first[i] for i in range(4)}

    assert run(REPO, prompts, out, "--overwrite") == 0  # starts over at main's commit now
    assert completions(out) == second and recorded_model(out)["commit"] == C2


def test_a_later_shard_runs_the_commit_the_first_shard_started_at(models, hub_cache, prompts, tmp_path):
    assert run(models["first"], prompts, tmp_path / "first") == 0
    add_to_hub_cache(hub_cache, REPO, models["first"], C1)
    out = tmp_path / "hub"
    assert run(REPO, prompts, out, "--shard", "0/2") == 0
    add_to_hub_cache(hub_cache, REPO, models["second"], C2)
    assert run(REPO, prompts, out, "--shard", "1/2") == 0
    assert completions(out) == completions(tmp_path / "first") and (out / "_SUCCESS").is_file()
    assert recorded_model(out)["commit"] == C1


def test_offline_with_a_cold_cache_exits_2_naming_HF_HUB_OFFLINE_and_the_cache(hub_cache, prompts, tmp_path, capsys):
    assert run(REPO, prompts, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"model {REPO!r} at revision 'main' is not in the Hugging Face cache at {hub_cache}" in err, err
    assert "HF_HUB_OFFLINE=1" in err and "unset HF_HUB_OFFLINE" in err and "HF_HOME" in err, err
    assert f"there is no local directory {REPO!r}" in err, err  # a mistyped relative folder is named as one
    assert not (tmp_path / "out").exists()


def test_a_cold_cache_with_no_hub_reachable_names_the_cache_and_how_to_fill_it(
    hub_cache, prompts, tmp_path, monkeypatch, capsys
):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    # No network: a port nothing listens on stands for the Hub (huggingface_hub reads its endpoint at each call).
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    assert run(REPO, prompts, tmp_path / "out") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"is not in the Hugging Face cache at {hub_cache}" in err, err
    assert "could not be reached (HF_HUB_OFFLINE is not set)" in err, err
    assert f"hf download {REPO} --revision main --cache-dir {hub_cache}" in err, err
    assert "unset HF_HUB_OFFLINE" not in err, err  # it is not set: nothing to unset
    assert not (tmp_path / "out").exists()


def test_the_cache_layout_is_the_one_huggingface_hub_reads(models, hub_cache):
    """The tests' cache is huggingface_hub's own layout: its cache scanner sees one repo at two commits with their
    refs, its file lookup finds each revision's files, and each revision resolves to its own commit."""
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    first = add_to_hub_cache(hub_cache, REPO, models["first"], C1)
    move_ref(hub_cache, REPO, "v1", C1)
    second = add_to_hub_cache(hub_cache, REPO, models["second"], C2)
    info = scan_cache_dir(hub_cache)
    assert not info.warnings and [r.repo_id for r in info.repos] == [REPO]
    revisions = {r.commit_hash: set(r.refs) for r in next(iter(info.repos)).revisions}
    assert revisions == {C1: {"v1"}, C2: {"main"}}
    for revision, snapshot in (("v1", first), ("main", second), (C1, first)):
        found = try_to_load_from_cache(REPO, "model.safetensors", cache_dir=hub_cache, revision=revision)
        assert found == str(snapshot / "model.safetensors"), revision
    assert (resolve_model(REPO, "v1").commit, resolve_model(REPO).commit) == (C1, C2)
    assert (first / "model.safetensors").read_bytes() != (second / "model.safetensors").read_bytes()


def test_a_revision_the_cache_does_not_hold_exits_2_naming_it(models, hub_cache, prompts, tmp_path, capsys):
    add_to_hub_cache(hub_cache, REPO, models["first"], C1)
    move_ref(hub_cache, REPO, "v1", C1)
    assert run(REPO, prompts, tmp_path / "out", "--revision", "v9") == 2
    err = capsys.readouterr().err
    assert f"model {REPO!r} at revision 'v9' is not in the Hugging Face cache" in err, err
    assert f"refs main, v1; commits {C1}" in err, err
    assert run(REPO, prompts, tmp_path / "out", "--revision", C2) == 2
    assert f"at revision {C2!r} is not in the Hugging Face cache" in capsys.readouterr().err
    assert run(models["first"], prompts, tmp_path / "out", "--revision", "v1") == 2
    assert "is a local directory; drop --revision" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_tag_and_a_commit_resolve_from_the_cache(models, hub_cache):
    first = add_to_hub_cache(hub_cache, REPO, models["first"], C1)
    second = add_to_hub_cache(hub_cache, REPO, models["second"], C2)
    move_ref(hub_cache, REPO, "v1", C1)
    assert resolve_model(REPO) == ModelSource(REPO, str(second), REPO, "main", C2)
    assert resolve_model(REPO, "v1") == ModelSource(REPO, str(first), REPO, "v1", C1)
    assert resolve_model(REPO, C1).local_path == str(first)
    assert resolve_model(REPO, pinned_commit=C1) == ModelSource(REPO, str(first), REPO, "main", C1)


def hub_error(kind: str, status: int):
    import httpx2
    from huggingface_hub import errors

    response = httpx2.Response(status, request=httpx2.Request("GET", f"https://huggingface.co/api/models/{REPO}"))
    return getattr(errors, kind)(f"{kind} from the Hub", response=response)


@pytest.mark.parametrize(
    "error, message",
    [
        (("GatedRepoError", 403), f"model {REPO!r} is gated .* set HF_TOKEN"),
        (("RepositoryNotFoundError", 404), f"no model repository {REPO!r} on the Hugging Face Hub .*HF_TOKEN"),
        (("RevisionNotFoundError", 404), f"model {REPO!r} has no revision 'v9'"),
    ],
)
def test_hub_errors_online_are_said_in_the_users_terms(hub_cache, monkeypatch, error, message):
    import huggingface_hub

    def refuse(repo_id, **kwargs):
        raise hub_error(*error)

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(ModelSourceError, match=message) as caught:
        resolve_model(REPO, "v9")
    assert TOKEN not in str(caught.value)


def test_online_a_branch_is_asked_of_the_hub_and_a_commit_is_read_from_the_cache_first(models, hub_cache, monkeypatch):
    import huggingface_hub

    snapshot = add_to_hub_cache(hub_cache, REPO, models["first"], C1)
    real, calls = huggingface_hub.snapshot_download, []

    def download(repo_id, **kwargs):  # stands for the Hub: "downloads" by reading the cache
        calls.append(kwargs)
        return real(repo_id, **{**kwargs, "local_files_only": True})

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    assert resolve_model(REPO).commit == C1
    assert calls[-1]["local_files_only"] is False and calls[-1]["revision"] == "main"
    assert Path(calls[-1]["cache_dir"]) == hub_cache and calls[-1]["allow_patterns"] == list(HUB_PATTERNS)
    assert calls[-1]["ignore_patterns"] == ["*/*.safetensors"]
    calls.clear()
    assert resolve_model(REPO, C1).local_path == str(snapshot)
    assert [c["local_files_only"] for c in calls] == [True]  # an immutable commit: no network call


def test_a_replica_without_the_drivers_folder_resolves_the_drivers_commit(models, hub_cache, monkeypatch):
    first = add_to_hub_cache(hub_cache, REPO, models["first"], C1)
    add_to_hub_cache(hub_cache, REPO, models["second"], C2)
    driver = ModelSource(REPO, "/elsewhere/snapshots/" + C1, REPO, "main", C1)
    assert worker_model_path(driver, driver.local_path) == str(first)
    assert worker_model_path(None, "/a/folder") == "/a/folder"
    monkeypatch.setattr(
        "cbrun.jobs.model.source.local_model", lambda uri, endpoint_url=None: f"/this/machine/copy/of/{uri}"
    )
    uri = ModelSource("s3://models/m", "/driver/cache/models/ab12")
    assert worker_model_path(uri, uri.local_path) == "/this/machine/copy/of/s3://models/m"
    assert worker_model_path(ModelSource("s3://models/m", str(first)), str(first)) == str(first)


def test_a_replica_on_a_machine_without_the_drivers_folder_runs_the_drivers_commit(
    models, hub_cache, prompts, tmp_path
):
    import asyncio

    from cbrun.jobs.config.manifest import load_manifest
    from cbrun.jobs.run.replica import Replica

    assert run(models["first"], prompts, tmp_path / "first") == 0
    add_to_hub_cache(hub_cache, REPO, models["first"], C1)
    add_to_hub_cache(hub_cache, REPO, models["second"], C2)  # main moved on after the driver resolved it
    driver_folder = "/driver/hf/hub/models--acme--tiny-llama/snapshots/" + C1
    manifest = load_manifest(
        None,
        ["sampling.ignore_eos=true", "engine.device=cpu"],
        {
            "model": {"path": driver_folder},
            "input": {"path": str(prompts), "prompt_column": "prompt"},
            "sampling": {"max_new_tokens": 6, "temperature": 0.0},
            "output": {"path": str(tmp_path / "ray")},
        },
    )
    driver = ModelSource(REPO, driver_folder, REPO, "main", C1)
    replica = Replica(manifest, manifest.engine, num_threads=1, max_concurrent_batches=1, model_source=driver)
    table = asyncio.run(replica(pa.Table.from_batches(list(replica.reader.read_span(0, 6)))))
    got = {r["row_index"]: (r["completion"], tuple(r["completion_token_ids"])) for r in table.to_pylist()}
    assert got == completions(tmp_path / "first")


def test_which_names_are_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "local").mkdir(parents=True)
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not is_hub_id("models/local")  # an existing folder is a folder
    for name in ("./a/b", "/a/b", "~/a", "../a", "s3://bucket/model", "gpt2", "a/b/c", "a--b/c", "a/..b"):
        assert not is_hub_id(name), name


def test_the_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert hub_cache_dir() == Path("~/.cache/huggingface/hub").expanduser()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"
