"""Building our plain-C CPU kernels: one compile per source, compiler, flags and CPU, cached on disk.

The kernels (``cpu_paged_attention.c``, ``cpu_token_mask.c``, ``cpu_sampler.c``, ``cpu_dequant.c``,
``cpu_moe.c``) have no torch headers; they build with ``$CC`` (default ``gcc``) into ``$CBRUN_KERNEL_CACHE``
(default ``~/.cache/cbrun/kernels``) and are loaded with ``ctypes``, each through one ``KernelLibrary``: built at
first use, or the reason it cannot be.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

logger = logging.getLogger("cbrun.engine")

CACHE_ENV = "CBRUN_KERNEL_CACHE"
# -ffp-contract=off: no fused multiply-adds. The attention kernel's 8-lane loops and its generic loops must give the
# same floats, and RoPE the floats of PyTorch's separate ops, on any CPU; -std=c11 already implies it, spelled out so
# a change of dialect (gnu11 contracts by default) cannot bring contraction back on FMA targets.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fno-trapping-math", "-std=c11", "-shared", "-fPIC")


def build_library(source: Path, what: str, expected: str) -> Path:
    """The compiled library of ``source``: compiled first unless the cache holds it for this source, compiler, CPU.

    Args:
        source: the C file.
        what: the kernel's name in the log line announcing a first compile ("the CPU attention kernel").
        expected: how long that compile takes, in the same line ("about 20 to 35 s").

    Raises:
        RuntimeError: when no compiler is found or the compile fails (naming the compiler and its exit code).
    """
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'gcc')!r} not found)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(source.read_bytes() + version.encode() + " ".join(FLAGS).encode() + _cpu_flags())
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "cbrun" / "kernels")
    target = cache / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: concurrent first uses never load a half-written library.
    logger.info("compiling %s (first use, %s) into %s", what, expected, cache)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(source), "-o", str(built), "-lm"], capture_output=True, text=True, timeout=300
        )
        if result.returncode:
            output = (result.stderr.strip() or result.stdout.strip())[-2000:] or "no output"
            raise RuntimeError(
                f"compiling {source.name} with {compiler} failed (exit code {result.returncode}): {output}"
            )
        os.replace(built, target)
    return target


class KernelLibrary:
    """One of our C kernel libraries, built (``build_library``) and loaded at first use with its functions' ctypes
    signatures bound; where it cannot be built or loaded, the reason, logged once and kept (never retried), and
    the callers run their PyTorch path instead.

    Args:
        source: the C file.
        what: its name in messages ("the CPU sampler kernel").
        expected: how long its first compile takes ("about 1 s").
        bind: sets the argument and return types of the library's functions.
        fallback: what runs without it, for the log line ("the PyTorch draw").
    """

    def __init__(
        self, source: Path, what: str, expected: str, bind: Callable[[ctypes.CDLL], None], fallback: str
    ) -> None:
        self.source, self.what, self.expected, self._bind, self.fallback = source, what, expected, bind, fallback
        self.library: ctypes.CDLL | None = None
        self.failure: str | None = None

    def load(self) -> ctypes.CDLL | None:
        """The library (built and loaded on the first call), or None where it is unavailable."""
        if self.library is None and self.failure is None:
            try:
                library = ctypes.CDLL(str(build_library(self.source, self.what, self.expected)))
                self._bind(library)
                self.library = library
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                self.failure = str(e)
                logger.info("%s is unavailable, %s runs instead: %s", self.what, self.fallback, e)
        return self.library

    def unavailable_reason(self) -> str | None:
        """Why the library cannot run here (building it on the first call), or None when it can."""
        self.load()
        return self.failure

    def loaded(self) -> ctypes.CDLL:
        """The library; RuntimeError (saying why) where it is unavailable."""
        library = self.load()
        if library is None:
            raise RuntimeError(f"{self.what} is unavailable: {self.failure}")
        return library


def _cpu_flags() -> bytes:
    """The CPU's feature flags (``-march=native`` code is only valid on a CPU that has them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    import platform

    return platform.processor().encode()
