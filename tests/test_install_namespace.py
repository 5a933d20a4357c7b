"""cbrun owns one import name, `cbrun`, so it can neither shadow nor be shadowed by another distribution (issue 38).

transformers 5.25 imports Hugging Face's `kernels` package; a top-level `kernels` of ours once shadowed it from the
repository root and, in a regular install, wrote its `__init__.py` into the same site-packages folder.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _top_level_names(paths: list[str]) -> set[str]:
    """The import names a set of installed file paths creates: each path's first part, less metadata and .pth."""
    names = set()
    for path in paths:
        first = path.split("/", 1)[0]
        if first.endswith((".dist-info", ".egg-info", ".data")) or first.endswith(".pth") or first == "..":
            continue
        if first.startswith("__editable__"):  # setuptools' editable finder: its own mapping says what it exposes
            continue
        names.add(first.removesuffix(".py"))
    return names


def test_installed_distribution_declares_only_cbrun() -> None:
    """The installed metadata's top_level names only `cbrun`, and so does the editable finder's mapping."""
    dist = importlib.metadata.distribution("cbrun")  # the venv's: the repository root holds no egg-info
    top_level = (dist.read_text("top_level.txt") or "").split()
    assert top_level == ["cbrun"], top_level
    finders = [Path(str(dist.locate_file(f))) for f in dist.files or [] if f.name.endswith("_finder.py")]
    for finder in finders:
        namespace: dict[str, object] = {}
        exec(compile(finder.read_text(), str(finder), "exec"), namespace)
        assert set(namespace["MAPPING"]) == {"cbrun"}, namespace["MAPPING"]  # type: ignore[call-overload]


@pytest.mark.slow
def test_built_wheel_holds_only_cbrun(tmp_path: Path) -> None:
    """A regular (non-editable) install's files: the wheel setuptools builds from this tree has one top-level name."""
    try:
        import setuptools  # noqa: F401
    except ImportError:
        pytest.fail("setuptools is needed to build the wheel (it is cbrun's build backend)")
    source = tmp_path / "src"  # a copy: building writes build/ and cbrun.egg-info/ beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "cbrun", source / "cbrun", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=source,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("cbrun-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = _top_level_names(archive.namelist())
        top_level = next(n for n in archive.namelist() if n.endswith(".dist-info/top_level.txt"))
        assert archive.read(top_level).decode().split() == ["cbrun"]
    assert names == {"cbrun"}, names


def test_transformers_model_module_imports_from_the_repository_root() -> None:
    """A Python started in the repository root imports a transformers model module beside Hugging Face's kernels."""
    script = (
        "import kernels, transformers.models.gemma3.modeling_gemma3 as m; "
        "assert 'site-packages' in kernels.__file__, kernels.__file__; print(m.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "transformers.models.gemma3.modeling_gemma3"
