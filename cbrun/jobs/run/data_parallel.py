"""Data parallelism on one node without Ray: ``cluster.data_parallel_size = D`` (``--data-parallel-size D``, vLLM's
name) runs D replicas of the engine, each a shard of the job (``cbrun.jobs.run.sharding``), from one command.

This process starts D ``cbrun run`` processes, replica i with ``--shard i/D`` and everything else as given, all
writing into the one output directory (each shard its own parts and lock, so every row is written once and a
rerun resumes each shard on its own), and waits for them::

    cbrun run ... --data-parallel-size 2
      ├── cbrun run ... --shard 0/2   (cuda:0, or the first half of this process's CPU cores)
      └── cbrun run ... --shard 1/2   (cuda:N, or the second half)

Devices: on CUDA, replica i runs on ``cuda:(k + i * tensor_parallel_size)`` from the engine's ``cuda:k`` (a replica
of N tensor-parallel ranks takes N devices). On the CPU, replica i is pinned to its own share of this process's
physical cores (``sched_setaffinity``), so ``num_threads = "auto"`` in each counts its own cores, not the host's.

Faults and signals: a replica that fails does not stop the others (their shards are whole jobs); the command exits
with the first replica's non-zero code, naming it, and a rerun of the same command resumes only what is missing.
SIGINT / SIGTERM are passed on to every replica (each commits its finished rows), and a replica dies with this
process (``PR_SET_PDEATHSIG``), so none is left behind.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from cbrun.jobs.run.resources import JobError, resolve_device

logger = logging.getLogger("cbrun")

#: Exit codes of a replica that finished its shard (0, or 3: more error rows than output.max_error_fraction).
_FINISHED_CODES = (0, 3)


def check_data_parallel(manifest) -> str:
    """Refuse what data parallelism does not combine with; returns the engine's resolved device.

    Raises:
        JobError: naming ``data_parallel_size`` and why: with ``--shard`` (the replicas are the shards), with
            ``--executor ray`` (whose replicas are ``cluster.num_replicas``), or more CUDA devices than there are.
    """
    size = manifest.cluster.data_parallel_size
    if manifest.input.shard is not None:
        raise JobError(
            f"cluster.data_parallel_size = {size} runs shards 0..{size - 1} itself; it does not run with "
            f"--shard {manifest.input.shard} (run one or the other)"
        )
    if manifest.cluster.executor == "ray":
        raise JobError(
            f"cluster.data_parallel_size = {size} runs local replicas; with --executor ray set cluster.num_replicas "
            "(--replicas) instead"
        )
    device = resolve_device(manifest.engine.device)
    if device.startswith("cuda"):
        import torch

        first, needed = torch.device(device).index or 0, size * manifest.engine.tensor_parallel_size
        if first + needed > torch.cuda.device_count():
            raise JobError(
                f"cluster.data_parallel_size = {size} x tensor_parallel_size = "
                f"{manifest.engine.tensor_parallel_size} needs {needed} CUDA devices from {device} on; this machine "
                f"has {torch.cuda.device_count()}"
            )
    return device


def replica_device(device: str, index: int, tensor_parallel_size: int) -> str:
    """Replica ``index``'s engine device: the CPU, or ``cuda:(k + index * tensor_parallel_size)`` for ``cuda:k``."""
    if not device.startswith("cuda"):
        return device
    first = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{first + index * tensor_parallel_size}"


def cpu_groups(cores: list[list[int]], count: int) -> list[set[int]]:
    """Split physical cores (each a list of its logical CPUs) into ``count`` contiguous, disjoint groups of
    logical CPUs, as even as can be; with fewer cores than groups, groups share cores round-robin.

    Args:
        cores: the logical CPUs of each physical core, in core order (``physical_core_cpus``).
        count: the number of groups (replicas).
    """
    if len(cores) < count:
        return [set(cores[i % len(cores)]) for i in range(count)]
    bounds = [i * len(cores) // count for i in range(count + 1)]
    return [{cpu for core in cores[bounds[i] : bounds[i + 1]] for cpu in core} for i in range(count)]


def physical_core_cpus() -> list[list[int]]:
    """The logical CPUs this process may run on, grouped by physical core (hyperthread siblings together), from
    ``/sys/devices/system/cpu``; each CPU its own core where that is unreadable."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    by_core: dict[tuple[str, str], list[int]] = {}
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topology / "physical_package_id").read_text(), (topology / "core_id").read_text())
        except OSError:
            return [[cpu] for cpu in cpus]
        by_core.setdefault(key, []).append(cpu)
    return list(by_core.values())


def replica_argv(argv: list[str], index: int, size: int, device: str) -> list[str]:
    """The ``cbrun`` arguments of replica ``index``: this command's, then its shard and device (the last flag of a
    kind wins), data parallelism off, and no progress bar but replica 0's."""
    extra = ["--shard", f"{index}/{size}", "--data-parallel-size", "1", "--set", f'engine.device="{device}"']
    if index > 0:
        extra.append("--no-progress")
    return [*argv, *extra]


def run_data_parallel(argv: list[str], manifest) -> int:
    """Run the job as ``cluster.data_parallel_size`` replica processes (``replica_argv``) and wait for them.

    Args:
        argv: this ``cbrun`` command's arguments, ``run`` first.
        manifest: the job's ``JobManifest`` (checked by ``check_data_parallel`` here, before any replica starts).

    Returns:
        0 when every replica finished its shard with 0; else the first replica's code that is not 0 (3 only when
        no replica failed otherwise).

    Raises:
        JobError: as ``check_data_parallel``.
        KeyboardInterrupt: ``cbrun.jobs.run.signals.Interrupted``, after passing the signal on and waiting for every
            replica to commit and exit.
    """
    size = manifest.cluster.data_parallel_size
    device = check_data_parallel(manifest)
    groups = cpu_groups(physical_core_cpus(), size) if device == "cpu" else [None] * size
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the same cbrun in each replica
    replicas = []
    for index in range(size):
        target = replica_device(device, index, manifest.engine.tensor_parallel_size)
        command = [sys.executable, "-m", "cbrun.jobs.cli", *replica_argv(argv, index, size, target)]
        replicas.append(
            subprocess.Popen(
                command,
                env=env,
                start_new_session=True,  # a terminal's Ctrl-C reaches this process only; it passes the signal on
                preexec_fn=_replica_setup(os.getpid(), groups[index]),
            )
        )
    logger.info(
        "data parallel: %d replicas (shards 0..%d of %d) on %s, pids %s",
        size,
        size - 1,
        size,
        device,
        [p.pid for p in replicas],
    )
    try:
        codes = [_shell_code(p.wait()) for p in replicas]
    except KeyboardInterrupt as exc:
        for replica in replicas:
            if replica.poll() is None:
                replica.send_signal(getattr(exc, "signum", signal.SIGINT))
        for replica in replicas:
            replica.wait()
        raise
    return _exit_code(codes)


def _shell_code(returncode: int) -> int:
    """A replica's exit status as a shell reports it: 128 + N for a process signal N ended (``Popen`` gives -N)."""
    return 128 - returncode if returncode < 0 else returncode


def _exit_code(codes: list[int]) -> int:
    """The command's exit code from its replicas' (``run_data_parallel``), each non-zero one named on stderr."""
    size = len(codes)
    for index, code in enumerate(codes):
        if code != 0:
            print(
                f"cbrun: data parallel: replica {index} (shard {index}/{size}) exited with code {code}; rerun the "
                "same command to resume",
                file=sys.stderr,
            )
    failed = [code for code in codes if code not in _FINISHED_CODES]
    return failed[0] if failed else max(codes)


def _replica_setup(parent_pid: int, cpus: set[int] | None):
    """What a replica's process runs before ``cbrun``: die with this process, and keep to its CPU group."""

    def setup() -> None:
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        except OSError:
            pass
        if os.getppid() != parent_pid:  # the parent exited before the call
            os._exit(1)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup
