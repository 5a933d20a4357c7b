"""Building our plain-C CPU kernels: one compile per source, compiler, flags and CPU, cached on disk.

The kernels (``cpu_paged_attention.c``, ``cpu_token_mask.c``, ``cpu_sampler.c``, ``cpu_dequant.c``) have no torch
headers; they build with ``$CC`` (default ``gcc``) into ``$CBRUN_KERNEL_CACHE`` (default ``~/.cache/cbrun/kernels``)
and are loaded with ``ctypes``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

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
        expected: how long that compile takes, in the same line ("about 20 s").

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
