"""The Ray Data executor (``cluster.executor = "ray"``): a job's rows through a pool of engine replicas.

The driver (the ``cbrun run`` process) holds the output's lock, its ``PartWriter`` and the done bitmap, exactly as
a single-process run does; only the reading and the engine work move out::

    read_datasource(PendingRowsDatasource)       one read task per span of pending rows (pending_spans): only
        |                                        their row groups are read; each row keeps its exact row_index
    map_batches(Replica, ActorPoolStrategy(num_replicas), up to max_concurrent_batches batches per replica)
        |                                        each replica: one engine, loaded once, whose continuous batching
        |                                        runs the rows of all its batches together (jobs.run.replica)
    iter_batches --> driver: PartWriter.add_group per input row (temp file + rename, as ever)

On an object-store output the replicas commit their own parts instead (``cbrun.jobs.output.object_parts.commit_span``: the part
under the replica's attempt name, then the span's commit record, create-only, so one attempt per span wins) and send
the driver only the rows' counts; the driver hands out spans, holds the lease, counts, and writes ``_SUCCESS``.

Each row's seeds derive from (job seed, row id), not from the replica or the batch, so outputs equal the
single-process run's. Ray restarts a dead replica and retries its batches (Ray Data's actor pools default to
``max_restarts=-1``, ``max_task_retries=-1``); a retried batch's rows reach the driver once, since a task's output
is returned only when it completes, and the driver drops any row it has already written. A killed driver loses only
its uncommitted rows: the rerun reads the spans of the rows not in a committed part.

The input side: ``PendingRowsDatasource`` gives one read task per span of pending rows (runs of rows not
committed, cut every ``cluster.batch_size`` rows). A read task reads only the row groups its span is in, with
cbrun's sources (Parquet, JSON Lines, a ``datasets`` directory), and yields Arrow batches of the reader's columns
plus ``ROW_INDEX_COLUMN``, the row's index in the whole input: the resume key and, with the row id, the source of its
seeds. Ray Data runs the reads as tasks of their own, streamed ahead of the replicas with backpressure.
NOTE: why a ``Datasource`` and not ``ray.data.read_parquet`` / ``read_json``: those readers give no row position.
``monotonically_increasing_id()`` is unique but not consecutive (a task id in its upper bits), ``Dataset.zip`` with
``ray.data.range`` materialises the whole input before the first row runs, and ``row_hash`` is a hash. cbrun's
resume needs each row's exact index, and skipping committed rows should skip their row groups, so the read tasks
here are cut from the done bitmap, which is the reader interface Ray Data documents for sources of its own:
https://docs.ray.io/en/latest/data/custom-datasource-example.html

Ray Data's pattern for stateful batch inference (an actor pool of callable classes, the model loaded in
``__init__``): https://docs.ray.io/en/latest/data/batch_inference.html
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

__all__ = ["RAY_EXTRA_MESSAGE", "check_ray_installed", "pending_spans", "replica_resources", "run_on_ray"]

from cbrun.jobs.output.writer import OUTPUT_SCHEMA, OutputRow
from cbrun.jobs.run.replica import GROUP_SIZE_COLUMN, SHARED_STEPS_COLUMN

try:  # NOTE: Ray is an optional extra; without it this module still imports (``pending_spans``, the checks)
    from ray.data import Datasource, ReadTask
    from ray.data.block import BlockMetadata
except ImportError:
    Datasource = object  # type: ignore[misc,assignment]  # NOTE: PendingRowsDatasource is never built then

logger = logging.getLogger("cbrun")

RAY_EXTRA_MESSAGE = (
    '--executor ray (cluster.executor = "ray") needs Ray Data, which is not installed: '
    "pip install 'cbrun[ray]' (the extra installs ray[data])"
)


def check_ray_installed() -> None:
    """Raise ``ImportError`` with ``RAY_EXTRA_MESSAGE`` when Ray Data cannot be imported; Ray's logs are quieted
    first (``quiet_ray_logs``: Ray Data reads its level when imported)."""
    quiet_ray_logs()
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
    except ImportError:
        raise ImportError(RAY_EXTRA_MESSAGE) from None


#: Ray's log levels unless the environment sets them: its Python and Ray Data loggers print warnings and above; its
#: C++ core prints fatal errors only, because Ray Data's actor pool always makes it print a harmless ERROR line
#: (``core_worker.cc``: the replicas' constructor arguments sit in the object store and ``max_restarts > 0``).
#: Errors that matter reach cbrun as Python exceptions.
QUIET_RAY_ENV = {"RAY_BACKEND_LOG_LEVEL": "fatal", "RAY_DATA_LOG_LEVEL": "WARNING", "RAY_LOGGER_LEVEL": "warning"}


def quiet_ray_logs() -> None:
    """Quiet Ray's logs to warnings (``QUIET_RAY_ENV``), keeping any level the user's environment sets."""
    for name, level in QUIET_RAY_ENV.items():
        os.environ.setdefault(name, level)
    logging.getLogger("ray").setLevel(os.environ["RAY_LOGGER_LEVEL"].upper())
    # NOTE: Ray Data reads its variable when first imported (this module's import may have): set it here too
    logging.getLogger("ray.data").setLevel(os.environ["RAY_DATA_LOG_LEVEL"].upper())


def connect(address: str | None, num_cpus: int | None = None) -> None:
    """Join the Ray cluster at ``address`` ("auto", "ray://..."), or start a local instance when None; Ray's logs
    are quieted first (``quiet_ray_logs``)."""
    import ray

    if ray.is_initialized():
        return
    quiet_ray_logs()
    kwargs = {"address": address} if address else {"num_cpus": num_cpus}
    ray.init(**kwargs, log_to_driver=False, include_dashboard=False, configure_logging=False)


def replica_resources(cluster, engine_config) -> tuple[float, float, int]:
    """What one replica actor reserves, and its ranks' torch threads: ``(num_gpus, num_cpus, threads per rank)``.

    A replica of ``tensor_parallel_size = N`` ranks is one actor whose ranks 1..N-1 are its own processes
    (``cbrun.engine.worker.tp_group``), so the actor reserves every rank's share: N x ``num_gpus_per_replica``
    (None: 1 per rank on CUDA, 0 on the CPU) and N x ``num_cpus_per_replica``. Ray places one actor's resources on
    one node, so the N ranks are on one node; the ranks see the actor's ``CUDA_VISIBLE_DEVICES`` (its N GPUs) and
    rank r takes its r-th device. NOTE: not a placement group of N one-GPU bundles, which would give the actor's
    subprocesses one GPU or none (Ray Data LLM reserves as here for vLLM's multiprocessing executor, whose TP
    workers are subprocesses too; docs/running.md, "Tensor-parallel replicas").

    Raises:
        ValueError: on CUDA, fewer than one GPU per rank of a tensor-parallel replica (each rank needs its own).
    """
    ranks = engine_config.tensor_parallel_size
    per_rank = cluster.num_gpus_per_replica
    on_cuda = engine_config.device.startswith("cuda")
    if per_rank is None:
        per_rank = 1 if on_cuda else 0
    if ranks > 1 and on_cuda and per_rank < 1:
        raise ValueError(
            f"cluster.num_gpus_per_replica = {per_rank} with tensor_parallel_size = {ranks}: each rank needs a "
            "GPU of its own (the replica reserves num_gpus_per_replica per rank); set it to 1 or more"
        )
    return ranks * per_rank, ranks * cluster.num_cpus_per_replica, max(1, int(cluster.num_cpus_per_replica))


def output_batches(
    manifest, engine_config, spans: list[tuple[int, int]], commit_output: str | None = None, model_source=None
) -> Iterator[pa.Table]:
    """Run the spans through ``cluster.num_replicas`` replicas; yield their output tables as they stream back."""
    import ray.data

    from cbrun.jobs.run.replica import Replica

    cluster = manifest.cluster
    num_gpus, num_cpus, num_threads = replica_resources(cluster, engine_config)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    # NOTE: one block per span (no splitting), and reads reserve no CPU: they are light, and a replica per CPU
    # (2 replicas on 2 CPUs) must not leave the reads unschedulable.
    rows = ray.data.read_datasource(
        PendingRowsDatasource(manifest, spans), override_num_blocks=max(1, len(spans)), num_cpus=0
    )
    # NOTE: max_concurrent_batches calls run at once in a replica (its async __call__ awaits the engine thread),
    # and Ray Data keeps that many tasks queued at each replica so the next batch is there when one finishes.
    per_replica = cluster.max_concurrent_batches
    outputs = rows.map_batches(
        Replica,
        batch_size=cluster.batch_size,
        batch_format="pyarrow",
        num_gpus=num_gpus,
        num_cpus=num_cpus,
        compute=ray.data.ActorPoolStrategy(
            size=cluster.num_replicas,
            max_concurrent_calls_per_actor=per_replica,
            max_tasks_in_flight_per_actor=per_replica,
        ),
        fn_constructor_kwargs={
            "manifest": manifest,
            "engine_config": engine_config,
            "num_threads": num_threads,
            "max_concurrent_batches": per_replica,
            "commit_output": commit_output,
            "model_source": model_source,
        },
    )
    yield from outputs.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0)


def run_on_ray(
    manifest, engine_config, done: np.ndarray, writer, on_group, commit_output: str | None = None, model_source=None
) -> dict[str, int]:
    """Compute the rows not ``done`` on Ray replicas and hand each row's output rows to ``on_group`` once.

    Args:
        manifest: the job.
        engine_config: the resolved ``EngineConfig`` (each replica loads its own engine with it).
        done: bool over the job's rows, True for rows this run must not compute (committed, or another shard's).
        writer: the run's ``PartWriter`` (its time threshold is checked as batches come back).
        on_group: called with each input row's output rows, in the order they come back.
        commit_output: an object-store output: each replica commits its batches' parts there itself
            (``cbrun.jobs.run.replica``), and ``on_group`` gets the rows without their completions, to count them.
        model_source: the model the driver resolved (``ResolvedJob.model``): a replica runs the same commit.

    Returns:
        The replicas' counters: ``num_row_steps_shared_across_batches``, the forward passes of the rows written in
        which a row ran beside rows of another batch (``cbrun.jobs.run.replica``), summed over the rows.
    """
    connect(manifest.cluster.address, num_cpus=os.cpu_count())
    written = done.copy()
    waiting: dict[int, list[dict]] = {}
    num_shared = 0
    spans = pending_spans(done, manifest.cluster.batch_size)
    for table in output_batches(manifest, engine_config, spans, commit_output, model_source):
        sizes = table.column(GROUP_SIZE_COLUMN).to_pylist()
        shared = table.column(SHARED_STEPS_COLUMN).to_pylist()
        records = table.drop_columns([GROUP_SIZE_COLUMN, SHARED_STEPS_COLUMN]).to_pylist()
        for record, size, row_shared in zip(records, sizes, shared):
            row_index = record["row_index"]
            if written[row_index]:
                continue  # NOTE: a retried batch's row that already came back; never written twice
            group = waiting.setdefault(row_index, [])
            group.append(record)
            if len(group) == size:
                del waiting[row_index]
                written[row_index] = True
                num_shared += row_shared
                on_group([_output_row(r) for r in sorted(group, key=lambda r: r["sample_index"])])
        writer.maybe_commit()
    assert not waiting, f"{len(waiting)} rows came back without all their samples"
    return {"num_row_steps_shared_across_batches": num_shared}


def _output_row(record: dict) -> OutputRow:
    """An output row read back from a replica's table: ``OUTPUT_SCHEMA``'s columns, then the carried ones."""
    fields = {name: record.pop(name) for name in OUTPUT_SCHEMA.names}
    if fields["logprobs"] is not None:
        fields["logprobs"] = [{e["token_id"]: e["logprob"] for e in step} for step in fields["logprobs"]]
    return OutputRow(**fields, carried=record)


def pending_spans(done: np.ndarray, batch_size: int) -> list[tuple[int, int]]:
    """The rows not done as spans ``[start, end)`` of at most ``batch_size`` rows each, in row order: runs of
    consecutive rows not done, cut every ``batch_size`` rows (a span holds no done row)."""
    pending = np.flatnonzero(~done)
    if not len(pending):
        return []
    breaks = np.flatnonzero(np.diff(pending) != 1) + 1
    spans = []
    for run in np.split(pending, breaks):
        start, end = int(run[0]), int(run[-1]) + 1
        spans += [(s, min(s + batch_size, end)) for s in range(start, end, batch_size)]
    return spans


class PendingRowsDatasource(Datasource):
    """The rows of ``spans`` of the job's input, one read task per span.

    Args:
        manifest: the job (its ``[input]`` opens the reader in each read task).
        spans: ``pending_spans`` of the rows to read.
    """

    def __init__(self, manifest, spans: list[tuple[int, int]]):
        self.manifest = manifest
        self.spans = spans

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context=None
    ) -> list[ReadTask]:
        """One task per span whatever ``parallelism`` asks: a span is already one batch of a replica."""
        manifest = self.manifest
        return [
            ReadTask(
                functools.partial(_read_span, manifest, start, end),
                BlockMetadata(num_rows=end - start, size_bytes=None, input_files=None, exec_stats=None),
                per_task_row_limit=per_task_row_limit,
            )
            for start, end in self.spans
        ]

    def get_name(self) -> str:
        return "CbrunInput"


def _read_span(manifest, start: int, end: int) -> Iterator[pa.Table]:
    batches = list(_reader(manifest).read_span(start, end))
    assert sum(b.num_rows for b in batches) == end - start, (start, end)
    yield pa.Table.from_batches(batches)


_READERS: dict[str, object] = {}  # the [input] settings -> their reader, per worker process


def _reader(manifest):
    """The job's reader, opened once per worker process (its footers and schema are read once, not per span)."""
    from cbrun.jobs.run.resources import open_reader

    key = repr(manifest.input) + repr(manifest.output.keep_columns)
    if key not in _READERS:
        _READERS.clear()
        _READERS[key] = open_reader(manifest)
    return _READERS[key]
