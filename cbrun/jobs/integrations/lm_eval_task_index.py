"""A cache of lm-eval's index of its built-in task configs, for ``cbrun lm-eval``.

lm-eval's ``TaskManager`` (``lm_eval/tasks/manager.py``, lm-eval 0.4.13) indexes every task config it knows at
construction: ``TaskIndex.build`` parses each of the ~14,000 YAML files under ``lm_eval/tasks/`` with its includes,
whichever tasks a run asks for. That is most of lm-eval's fixed cost per run (about 7 of the 14 s of a
stories260K run on a 2-core machine, any model backend), and its result changes only when those files do.

``cached_builtin_task_index`` makes ``TaskIndex.build`` take the built-in directory's entries from a cache file
keyed by lm-eval's version, the directory and the path, size and mtime of every file under it (includes such as
``_template_yaml`` have no .yaml suffix, so every file counts). Any other directory (``--include_path``) is
indexed as lm-eval does, every run, and the directories are merged by lm-eval's own rule (later ones override
earlier ones, with a warning). The index is thus the one lm-eval builds; only the time differs. It applies to
every backend run through ``cbrun lm-eval`` (``--model hf`` as well as ``--model cbrun``). An unreadable cache is
rebuilt; one that cannot be written is skipped (logged). ``CBRUN_LM_EVAL_INDEX_CACHE=off`` turns it off.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import os
import pickle
import sys
from pathlib import Path
from typing import Iterator

from cbrun.jobs.store.files import write_file

logger = logging.getLogger("cbrun.lm_eval")

CACHE_ENV = "CBRUN_LM_EVAL_INDEX_CACHE"
CACHE_DIR_ENV = "CBRUN_CACHE_DIR"


@contextlib.contextmanager
def cached_builtin_task_index(builtin_dir: str | Path | None = None) -> Iterator[None]:
    """Within the block, lm-eval's ``TaskIndex.build`` reads the built-in tasks' entries from the cache.

    Args:
        builtin_dir: the directory whose index is cached; default lm-eval's ``lm_eval/tasks/`` (the tests give
            a small one).
    """
    import lm_eval.tasks
    from lm_eval.tasks._index import TaskIndex

    if os.environ.get(CACHE_ENV, "").lower() in ("0", "off", "false", "no"):
        yield
        return
    original = TaskIndex.__dict__["build"]
    build = original.__func__
    builtin = Path(builtin_dir) if builtin_dir is not None else Path(lm_eval.tasks.__file__).parent

    def cached_build(paths, *, resolve_includes=True):
        paths = list(paths)
        if not resolve_includes or not any(_same_dir(p, builtin) for p in paths):
            return build(paths, resolve_includes=resolve_includes)
        index = {}
        for root in paths:
            entries = _builtin_entries(root, build) if _same_dir(root, builtin) else build([root])
            _merge(index, entries, root)
        return index

    TaskIndex.build = staticmethod(cached_build)
    try:
        yield
    finally:
        TaskIndex.build = original


def _merge(index: dict, entries: dict, root: Path) -> None:
    """lm-eval's merge of one directory's entries into the index (``TaskIndex.build``): later paths win."""
    for name, entry in entries.items():
        if name in index:
            logger.warning(
                "Task '%s' from %s overrides existing task from %s", name, entry.yaml_path, index[name].yaml_path
            )
        index[name] = entry


def _same_dir(a, b: Path) -> bool:
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False


def _builtin_entries(root: Path, build) -> dict:
    """The built-in directory's entries, from the cache when its key matches, else built (and cached)."""
    path = _cache_dir() / f"task-index-{_key(root)}.pickle"
    try:
        with open(path, "rb") as f:
            with _gc_paused():  # unpickling ~15k entries with the collector off: a third faster
                return pickle.load(f)
    except FileNotFoundError:
        pass
    except Exception as error:  # a truncated or foreign file: rebuild it
        logger.info("cbrun: rebuilding lm-eval's task index cache %s (%s)", path, error)
    entries = build([root])
    _write(path, entries)
    return entries


def _key(root: Path) -> str:
    """Hash of lm-eval's version, the Python version (pickle's objects), the directory and every file's stat."""
    import lm_eval

    digest = hashlib.sha256(f"{lm_eval.__version__}\0{sys.version}\0{root.resolve()}\0".encode())
    digest.update("\n".join(_file_stats(str(root), "")).encode())
    return digest.hexdigest()[:24]


def _file_stats(directory: str, relative: str) -> Iterator[str]:
    """ "path size mtime" of every file under ``directory``, in sorted order, paths relative to the root."""
    with os.scandir(directory) as scan:
        entries = sorted(scan, key=lambda e: e.name)
    for entry in entries:
        name = relative + entry.name
        if entry.is_dir(follow_symlinks=False):  # a linked directory counts as one entry (no cycles)
            yield from _file_stats(entry.path, name + "/")
        else:
            stat = entry.stat()
            yield f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}"


def _write(path: Path, entries: dict) -> None:
    """Write atomically (``cbrun.jobs.store.files.write_file``): a concurrent run never reads half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, lambda f: pickle.dump(entries, f, protocol=pickle.HIGHEST_PROTOCOL))
    except (OSError, pickle.PicklingError) as error:
        logger.info("cbrun: lm-eval's task index is not cached (%s)", error)


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "cbrun"
    return Path(root) / "lm_eval"


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
