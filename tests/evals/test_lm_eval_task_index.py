"""The cached index of lm-eval's built-in tasks (``cbrun lm-eval``) is the index lm-eval builds, from a cache file
that any change under the directory invalidates."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.tasks._index import TaskIndex  # noqa: E402

from cbrun.jobs.integrations import lm_eval_task_index  # noqa: E402
from cbrun.jobs.integrations.lm_eval_task_index import cached_builtin_task_index  # noqa: E402


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """(a small "built-in" task directory, an include directory, the cache directory)."""
    builtin, include, cache = tmp_path / "builtin", tmp_path / "include", tmp_path / "cache"
    (builtin / "sub").mkdir(parents=True)
    (builtin / "sub" / "_template_yaml").write_text("output_type: multiple_choice\nmetadata:\n  version: 1.0\n")
    (builtin / "sub" / "alpha.yaml").write_text("include: _template_yaml\ntask: alpha\ntag: letters\n")
    (builtin / "beta.yaml").write_text("task: beta\noutput_type: generate_until\n")
    (builtin / "group.yaml").write_text("group: both\ntask:\n  - alpha\n  - beta\n")
    include.mkdir()
    (include / "beta.yaml").write_text("task: beta\noutput_type: loglikelihood\n")  # overrides the built-in one
    monkeypatch.setenv(lm_eval_task_index.CACHE_DIR_ENV, str(cache))
    monkeypatch.delenv(lm_eval_task_index.CACHE_ENV, raising=False)
    return builtin, include, cache


def count_builds(monkeypatch) -> list:
    """Record the paths of every call of lm-eval's own ``TaskIndex.build``."""
    calls = []
    original = TaskIndex.build

    def build(paths, *, resolve_includes=True):
        calls.append([str(p) for p in paths])
        return original(paths, resolve_includes=resolve_includes)

    monkeypatch.setattr(TaskIndex, "build", staticmethod(build))
    return calls


def cached_index(builtin, include) -> dict:
    with cached_builtin_task_index(builtin):
        return TaskIndex.build([builtin, include])


def test_cached_index_is_lm_evals_index(dirs, monkeypatch):
    builtin, include, cache = dirs
    expected = TaskIndex.build([builtin, include])
    calls = count_builds(monkeypatch)
    build = TaskIndex.__dict__["build"]
    first = cached_index(builtin, include)
    assert TaskIndex.__dict__["build"] is build  # restored on leaving the block
    assert calls == [[str(builtin)], [str(include)]] and len(list((cache / "lm_eval").iterdir())) == 1
    second = cached_index(builtin, include)
    assert calls[2:] == [[str(include)]]  # the built-in directory came from the cache; the include path is rebuilt
    for index in (first, second):
        assert index == expected
        assert index["beta"].cfg["output_type"] == "loglikelihood"  # the include path overrides, as in lm-eval
        assert index["alpha"].cfg["output_type"] == "multiple_choice" and index["letters"].tags == {"alpha"}


def test_task_manager_through_the_cache(dirs):
    builtin, include, _ = dirs
    plain = TaskManager(include_path=str(include), include_defaults=False)
    with cached_builtin_task_index(builtin):
        cached = TaskManager(include_path=[str(builtin), str(include)], include_defaults=False)
    assert (
        cached.task_index == TaskManager(include_path=[str(builtin), str(include)], include_defaults=False).task_index
    )
    assert cached.task_index != plain.task_index and "both" in cached.all_groups


def test_a_changed_file_under_the_directory_rebuilds(dirs, monkeypatch):
    builtin, include, _ = dirs
    cached_index(builtin, include)
    # An include without the .yaml suffix changes: every file counts in the key.
    (builtin / "sub" / "_template_yaml").write_text("output_type: generate_until\nmetadata:\n  version: 2.0\n")
    calls = count_builds(monkeypatch)
    index = cached_index(builtin, include)
    assert calls == [[str(builtin)], [str(include)]]
    assert index["alpha"].cfg["output_type"] == "generate_until"
    (builtin / "gamma.yaml").write_text("task: gamma\noutput_type: generate_until\n")
    assert "gamma" in cached_index(builtin, include)


def test_a_broken_cache_file_is_rebuilt(dirs, monkeypatch):
    builtin, include, cache = dirs
    expected = cached_index(builtin, include)
    (path,) = (cache / "lm_eval").iterdir()
    path.write_bytes(b"not a pickle")
    assert cached_index(builtin, include) == expected
    assert path.read_bytes() != b"not a pickle"


def test_off_switch_and_other_directories_build_as_lm_eval(dirs, monkeypatch):
    builtin, include, cache = dirs
    calls = count_builds(monkeypatch)
    with cached_builtin_task_index(builtin):
        TaskIndex.build([include])  # no built-in directory among the paths: lm-eval's build, unchanged
    assert calls == [[str(include)]] and not cache.exists()
    monkeypatch.setenv(lm_eval_task_index.CACHE_ENV, "off")
    cached_index(builtin, include)
    assert calls[1:] == [[str(builtin), str(include)]] and not cache.exists()
