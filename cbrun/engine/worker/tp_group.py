"""A tensor-parallel replica's processes: rank 0 (the engine's own process) and ranks 1..N-1, which it starts.

Rank 0 starts the other ranks itself, each ``python -m cbrun.engine.worker.tp_worker`` in torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``; a fresh interpreter,
so nothing of the caller's main module is re-run), and the group runs on ``torch.distributed``:
gloo on the CPU, NCCL on CUDA, rank r on device ``cuda:(i + r)`` for an engine device ``cuda:i``. Every rank loads
only its slices of the weights (``cbrun.engine.model.layers.parallel``) and holds its slice of the KV cache (its KV
heads); only rank 0 has a scheduler, a block manager and a sampler::

    rank 0 (LLMEngine)                               rank r > 0 (serve)
    schedule() -> plan
    send_step(plan, pages)  -- TCP store ------->    recv_step() -> plan, pages
    runner.launch(plan)     <-- all-reduce ----->    runner.launch(plan)   (its logits are dropped)
    sample, resolve, write output

Startup (weights loaded, KV-cache blocks agreed) goes through the group's TCP store, which rank 0 polls while it
watches the other ranks' processes, so a rank that fails or dies while loading is reported at once, with its
error. The KV cache takes the fewest blocks any rank's memory allows (on the CPU, where the ranks share the host's
memory, each rank counts the whole group's bytes per block).

Faults: the forward pass's collectives run on a group with a timeout of ``STEP_TIMEOUT_S``, and a dead rank's
closed connections fail them at once, so a rank that dies or hangs makes rank 0's step raise
``TensorParallelError`` (naming the rank, its exit code or that it stopped answering) instead of hanging; the job
then stops as on any engine fault, its committed rows kept. A rank > 0 dies with rank 0 (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from cbrun.engine.config import EngineConfig
from cbrun.engine.core.cache_spec import CacheSpec
from cbrun.engine.core.kv_layout import ModelConfig
from cbrun.engine.core.plan import SchedulerOutput
from cbrun.engine.model.layers.parallel import ShardLayout, TensorParallelWeights

logger = logging.getLogger("cbrun.engine")

#: Longest a forward pass's collective waits for the other ranks (they do the same work between two collectives,
#: so a healthy rank answers within a layer's compute).
STEP_TIMEOUT_S = 60.0
#: Longest rank 0 waits for the other ranks to load the model and report their memory, polling their processes.
STARTUP_TIMEOUT_S = 3600.0
#: The ranks > 0 wait on rank 0 for the next plan for as long as the job takes between steps (reading input,
#: committing parts, an idle engine); they end with rank 0's process instead.
_IDLE_TIMEOUT = timedelta(days=7)
_POLL_S = 0.05
#: What a rank > 0 runs (``python -m``): ``cbrun.engine.worker.tp_worker.rank_main``.
RANK_MODULE = "cbrun.engine.worker.tp_worker"


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel replica failed, died or stopped answering; the replica cannot go on."""


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: the CPU for every rank, else ``cuda:(i + rank)`` for ``cuda`` / ``cuda:i``."""
    target = torch.device(device)
    if target.type != "cuda":
        return device
    return f"cuda:{(target.index or 0) + rank}"


class GroupCommunicator:
    """The forward pass's collectives over ``torch.distributed`` (``cbrun.engine.model.layers.parallel.Communicator``).

    A failed or timed-out collective raises ``TensorParallelError`` with what ``describe`` says of the group.
    ``seconds`` counts the wall time spent in collectives (for the benchmark's all-reduce column).
    """

    def __init__(
        self, rank: int, world_size: int, group: dist.ProcessGroup, describe: Callable[[BaseException], str]
    ) -> None:
        self.rank, self.world_size, self.group, self.describe = rank, world_size, group, describe
        self.seconds = 0.0
        self.num_calls = 0

    def all_reduce(self, x: torch.Tensor) -> None:
        start = time.perf_counter()
        try:
            dist.all_reduce(x, group=self.group)
        except RuntimeError as exc:
            raise TensorParallelError(self.describe(exc)) from exc
        self.seconds += time.perf_counter() - start
        self.num_calls += 1

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        start = time.perf_counter()
        out = [torch.empty_like(x) for _ in range(self.world_size)]
        try:
            dist.all_gather(out, x, group=self.group)
        except RuntimeError as exc:
            raise TensorParallelError(self.describe(exc)) from exc
        self.seconds += time.perf_counter() - start
        self.num_calls += 1
        return out


class TensorParallelGroup:
    """One rank's handle on its replica's group: the collectives, the plans and the startup exchange.

    Rank 0's also owns the other ranks' processes (``start``), and ``close`` ends them.

    Args:
        rank, world_size: this rank and the group's size.
        store: the group's ``torch.distributed.TCPStore``.
        backend: "gloo" or "nccl".
        processes: rank 0: the processes of ranks 1..N-1, in rank order; else empty.
    """

    def __init__(
        self, rank: int, world_size: int, store: dist.Store, backend: str, processes: list[_RankProcess] | None = None
    ) -> None:
        self.rank, self.world_size, self.store, self.backend = rank, world_size, store, backend
        self.processes = processes or []
        self.device_type = "cuda" if backend == "nccl" else "cpu"
        # NOTE: the forward pass's collectives on a group with STEP_TIMEOUT_S (the default group's is the
        # startup's); plans go through the store (``send_step``).
        self.step_group = dist.new_group(backend=backend, timeout=timedelta(seconds=STEP_TIMEOUT_S))
        self.comm = GroupCommunicator(rank, world_size, self.step_group, self.describe_failure)
        self.closed = False
        self._num_steps = 0  # plans sent (rank 0) or received (the others)

    def shard(self, model_config: ModelConfig) -> TensorParallelWeights:
        """This rank's share of a Llama-family model (its layout over the group's collectives)."""
        return TensorParallelWeights(ShardLayout.of(model_config, self.rank, self.world_size), self.comm)

    @property
    def ranks_per_memory(self) -> int:
        """Ranks that share one memory: the group on the CPU (one host), 1 on CUDA (a device each)."""
        return self.world_size if self.device_type == "cpu" else 1

    # ---- startup, through the store ------------------------------------------------------------------------------
    def agree_num_blocks(self, num_blocks: int) -> int:
        """The fewest KV-cache blocks any rank can hold, given this rank's ``num_blocks`` (every rank calls it)."""
        self.store.set(f"blocks/{self.rank}", str(num_blocks))
        if self.rank == 0:
            counts = [num_blocks] + [
                int(_wait_for_key(self.store, self.processes, f"blocks/{r}")) for r in range(1, self.world_size)
            ]
            self.store.set("num_blocks", str(min(counts)))
            return min(counts)
        return int(self.store.get("num_blocks"))

    def share_cache_spec(self, spec: CacheSpec | None) -> CacheSpec:
        """Rank 0 gives its ``CacheSpec``; every other rank gets it."""
        if self.rank == 0:
            assert spec is not None, "rank 0 gives the cache spec"
            self.store.set("cache_spec", pickle.dumps(spec))  # type: ignore[arg-type]  # NOTE: torch's stub says str; the store takes bytes
            return spec
        received: CacheSpec = pickle.loads(self.store.get("cache_spec"))
        return received

    # ---- steps ----------------------------------------------------------------------------------------------------
    def send_step(self, plan: SchedulerOutput, num_zeroed_pages: int) -> None:
        """Rank 0: hand every rank this step's plan and the KV pages that must be zeroed before it.

        NOTE: through the store, not a collective: setting a key never waits for the other ranks, so a rank that
        hangs cannot hang rank 0 here; the step's first collective then fails within ``STEP_TIMEOUT_S``.
        """
        self._post(pickle.dumps((plan, num_zeroed_pages)))

    def recv_step(self) -> tuple[SchedulerOutput, int] | None:
        """Rank > 0: the next ``(plan, num_zeroed_pages)``, or None when rank 0 closes the group. Waits as long as
        rank 0 takes (it ends with rank 0's process)."""
        key = f"step/{self.rank}/{self._num_steps}"
        try:
            message: tuple[SchedulerOutput, int] | None = pickle.loads(self.store.get(key))
            self.store.delete_key(key)
        except RuntimeError as exc:  # the store lives in rank 0's process
            raise TensorParallelError(self.describe_failure(exc)) from exc
        self._num_steps += 1
        return message

    def _post(self, data: bytes) -> None:
        for rank in range(1, self.world_size):
            self.store.set(f"step/{rank}/{self._num_steps}", data)  # type: ignore[arg-type]  # bytes, as above
        self._num_steps += 1

    def describe_failure(self, exc: BaseException) -> str:
        """What went wrong in the group, for the error: on rank 0, each other rank's state (its exit code, the
        error it reported, or that it is alive but did not answer within ``STEP_TIMEOUT_S``)."""
        if self.rank != 0:
            return f"tensor-parallel rank {self.rank} lost rank 0: {exc}"
        states = []
        for rank, process in enumerate(self.processes, start=1):
            process.join(timeout=2.0)  # a killed rank's exit is seen a moment after its connections close
            error = self.store.get(f"error/{rank}").decode() if _has_key(self.store, f"error/{rank}") else None
            if error:
                states.append(f"rank {rank} failed: {error}")
            elif process.exitcode is not None:
                states.append(f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}")
            else:
                states.append(f"rank {rank} (pid {process.pid}) is alive but did not answer")
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        return f"the tensor-parallel replica stopped: {'; '.join(states)} ({type(exc).__name__}: {first_line})"

    def close(self) -> None:
        """Rank 0: tell the other ranks to exit, wait for them (then end them), and leave the group."""
        if self.closed:
            return
        self.closed = True
        if self.rank == 0:
            self._post(pickle.dumps(None))
        for process in self.processes:
            process.join(timeout=10.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
        if dist.is_initialized():
            dist.destroy_process_group()


def _has_key(store: dist.Store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except RuntimeError:
        return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def per_rank_config(config: EngineConfig) -> EngineConfig:
    """``config`` as each rank runs it: on the CPU, ``num_threads = "auto"`` becomes the physical cores shared
    out over the ranks (one host's cores, not each rank all of them).

    Raises:
        ValueError: on CUDA, for more ranks than devices from the engine's device on.
    """
    size = config.tensor_parallel_size
    target = torch.device(config.device)
    if target.type == "cuda":
        count = torch.cuda.device_count()
        if (target.index or 0) + size > count:
            raise ValueError(
                f"tensor_parallel_size = {size} on {config.device} needs {size} CUDA devices from it on; this "
                f"machine has {count}"
            )
        return config
    if config.num_threads == "auto":
        from cbrun.engine.worker.threads import physical_cores

        return replace(config, num_threads=max(1, physical_cores() // size))
    return config


def start(model_path: str, config: EngineConfig) -> TensorParallelGroup:
    """Rank 0: start ranks 1..N-1 (each loads its shard of ``model_path``), join the group, return its handle.

    Args:
        model_path: the model directory (``cbrun.engine.model.loader.tensor_parallel_plan`` accepted it).
        config: the per-rank engine settings (``per_rank_config``), ``tensor_parallel_size`` ranks.

    Raises:
        TensorParallelError: a rank failed or died while starting.
    """
    size = config.tensor_parallel_size
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, size, is_master=True, timeout=_IDLE_TIMEOUT, wait_for_workers=False)
    # NOTE: what a rank runs travels through the store, not its command line
    store.set("launch", pickle.dumps((model_path, config, os.getpid())))  # type: ignore[arg-type]  # bytes, as above
    processes = [_start_rank(rank, size, port) for rank in range(1, size)]
    backend = _backend(config.device)
    try:
        for rank in range(1, size):
            _wait_for_key(store, processes, f"joined/{rank}")
        dist.init_process_group(backend, store=store, rank=0, world_size=size, timeout=_IDLE_TIMEOUT)
        group = TensorParallelGroup(0, size, store, backend, processes)
    except BaseException:
        for process in processes:
            process.kill()
        raise
    atexit.register(group.close)
    logger.info(
        "tensor parallelism: %d ranks on %s (%s), ranks 1..%d in pids %s",
        size,
        config.device,
        backend,
        size - 1,
        [p.pid for p in processes],
    )
    return group


def _start_rank(rank: int, size: int, port: int) -> "_RankProcess":
    env = dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # the caller's import path, so the rank imports the same cbrun (a source tree, a test's root)
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
    )
    return _RankProcess(subprocess.Popen([sys.executable, "-m", RANK_MODULE], env=env))


class _RankProcess:
    """A rank's process, as rank 0 watches it."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()
            self.join(5.0)


def _wait_for_key(store: dist.Store, processes: list[_RankProcess], key: str) -> bytes:
    """Rank 0: the store's value of ``key`` once a rank sets it; raises as soon as a rank reports an error or dies."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not store.check([key]):
        for rank, process in enumerate(processes, start=1):
            if _has_key(store, f"error/{rank}"):
                raise TensorParallelError(f"tensor-parallel rank {rank} failed: {store.get(f'error/{rank}').decode()}")
            if not process.is_alive():
                raise TensorParallelError(f"tensor-parallel rank {rank} exited with code {process.exitcode}")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel ranks did not start within {STARTUP_TIMEOUT_S:.0f} s")
        time.sleep(_POLL_S)
    return store.get(key)


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent (rank 0) exits (Linux ``PR_SET_PDEATHSIG``)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent_pid:  # rank 0 exited before the call
        os._exit(1)


def connect() -> tuple[dist.Store, int, int, str, EngineConfig]:
    """A rank > 0 started by ``start``: connect to the group's store from torchrun's environment and read what to
    run; the process then dies with rank 0.

    Returns:
        (store, rank, world_size, model_path, this rank's EngineConfig).
    """
    rank, size, port = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], port, size, is_master=False, timeout=_IDLE_TIMEOUT)
    model_path, config, parent_pid = pickle.loads(store.get("launch"))
    _die_with_parent(parent_pid)
    return store, rank, size, model_path, replace(config, device=rank_device(config.device, rank))


def join(store: dist.Store, rank: int, size: int, config: EngineConfig) -> TensorParallelGroup:
    """A rank > 0: join rank 0's process group."""
    backend = _backend(config.device)
    store.set(f"joined/{rank}", "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=_IDLE_TIMEOUT)
    return TensorParallelGroup(rank, size, store, backend)


def report_error(store: dist.Store, rank: int, exc: BaseException) -> None:
    """A rank > 0: leave its error where rank 0 reads it (and names it in its own)."""
    store.set(f"error/{rank}", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}")
