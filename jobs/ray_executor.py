"""The Ray Data executor (``cluster.executor = "ray"``): a job's rows through a pool of engine replicas.

The driver (the ``cbrun run`` process) holds the output's lock, its ``PartWriter`` and the done bitmap, exactly as
a single-process run does; only the engine work moves out::

    pending row spans --ray.data.from_items--> map_batches(_Replica, ActorPoolStrategy(num_replicas))
        each replica: reads its spans' rows with cbrun's reader, runs them through the job's mode and one engine
        (continuous batching across the batch), returns their output rows (an Arrow table)
    --iter_batches--> driver: PartWriter.add_group per input row (temp file + rename, as ever)

Why this shape: the job's input is described by row spans ``[start, end)`` of rows not yet committed (batches of
``cluster.batch_size`` rows), so the driver never materialises the input, each replica reads only its spans' row
groups, and a row keeps its global ``row_index``. Each row's seeds derive from (job seed, row id), not from the
replica, so outputs equal the single-process run's. Ray restarts a dead replica and retries its batch (Ray Data's
actor pools default to ``max_restarts=-1``, ``max_task_retries=-1``); a retried batch's rows reach the driver once,
since a task's output is returned only when it completes, and the driver drops any row it has already written. A
killed driver loses only its uncommitted rows: the rerun computes the spans of the rows not in a committed part.

Ray Data's pattern for stateful batch inference (an actor pool of callable classes, the model loaded in
``__init__``): https://docs.ray.io/en/latest/data/batch_inference.html
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from jobs.carry import carried_values
from jobs.ordering import order_by_prefix
from jobs.reader import InputRow, PromptReader
from jobs.writer import OUTPUT_SCHEMA, OutputRow, rows_to_table

logger = logging.getLogger("cbrun")

#: A column of the replica's tables beside ``OUTPUT_SCHEMA``'s: the number of output rows of the row (its
#: samples), so the driver writes a row only once it holds all of them.
GROUP_SIZE_COLUMN = "_num_in_group"
RAY_EXTRA_MESSAGE = ("--executor ray (cluster.executor = \"ray\") needs Ray Data, which is not installed: "
                     "pip install 'cbrun[ray]' (the extra installs ray[data])")


def check_ray_installed() -> None:
    """Raise ``ImportError`` with ``RAY_EXTRA_MESSAGE`` when Ray Data cannot be imported."""
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
    except ImportError:
        raise ImportError(RAY_EXTRA_MESSAGE) from None


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


def read_span(reader: PromptReader, start: int, end: int) -> Iterator[InputRow]:
    """The input rows ``start .. end-1``, reading only the row groups they are in."""
    if not hasattr(reader, "_batch_rows"):  # NOTE: a reader that derives rows (OpenAI batch lines): via iter_rows
        skip = np.ones(reader.num_rows, dtype=bool)
        skip[start:end] = False
        yield from reader.iter_rows(skip)
        return
    first_row = 0
    for source in reader.sources:
        last_row = first_row + source.num_rows
        if first_row < end and start < last_row:
            skip = np.ones(source.num_rows, dtype=bool)
            skip[max(start - first_row, 0):end - first_row] = False
            for row, batch in source.iter_batches(reader.columns, reader.batch_size, first_row, skip):
                local = row - first_row
                yield from reader._batch_rows(row, batch, skip[local:local + batch.num_rows])
        first_row = last_row


class _Replica:
    """One engine replica: a Ray Data actor that loads the job's engine once and turns row spans into output rows.

    Args:
        manifest: the job's ``JobManifest``.
        engine_config: the resolved ``EngineConfig``.
        num_threads: torch threads of this replica.
    """

    def __init__(self, manifest, engine_config, num_threads: int):
        import torch

        from jobs.job import MODES, _model_vocab_size, open_reader, output_carried_fields
        from jobs.resources import load_engine, load_tokenizer

        torch.set_num_threads(num_threads)
        self.manifest = manifest
        self.reader = open_reader(manifest)
        self.schema = pa.schema([*OUTPUT_SCHEMA, *output_carried_fields(manifest, self.reader)])
        self.engine = load_engine(manifest.model.path, engine_config)
        self.mode = MODES[manifest.input.mode](manifest, load_tokenizer(manifest.model.path),
                                               self.engine.max_model_len, _model_vocab_size(manifest.model.path))
        self.max_in_flight = 4 * engine_config.max_requests_per_batch

    def __call__(self, batch: pa.Table) -> pa.Table:
        """``batch``: columns ``start``, ``end`` (row spans). Returns the spans' output rows (``OUTPUT_SCHEMA`` and
        ``GROUP_SIZE_COLUMN``), a row's samples together."""
        groups: list[list[OutputRow]] = []
        carried: dict[int, dict] = {}  # row index -> its carried input column values (``jobs.carry``)

        def row_work():
            for start, end in zip(batch.column("start").to_pylist(), batch.column("end").to_pylist()):
                for row in read_span(self.reader, start, end):
                    carried[row.row_index] = carried_values(row)
                    work = self.mode.prepare(row)
                    if isinstance(work, OutputRow):
                        groups.append([work])
                    else:
                        yield work

        def requests():
            for item in order_by_prefix(row_work(), key=lambda w: w.prompt_token_ids,
                                        window=self.manifest.input.order_window):
                yield from item.requests

        for output in self.engine.generate(requests(), max_in_flight=self.max_in_flight):
            rows = self.mode.collect(output)
            if rows is not None:
                groups.append(rows)
        for group in groups:
            for row in group:
                row.carried = carried.get(row.row_index, {})
        table = rows_to_table([row for group in groups for row in group], self.schema)
        sizes = [len(group) for group in groups for _ in group]
        return table.append_column(GROUP_SIZE_COLUMN, pa.array(sizes, pa.int32()))


def connect(address: str | None, num_cpus: int | None = None) -> None:
    """Join the Ray cluster at ``address`` ("auto", "ray://..."), or start a local instance when None."""
    import ray

    if ray.is_initialized():
        return
    kwargs = {"address": address} if address else {"num_cpus": num_cpus}
    ray.init(**kwargs, log_to_driver=False, include_dashboard=False, configure_logging=False)


def output_batches(manifest, engine_config, spans: list[tuple[int, int]]) -> Iterator[pa.Table]:
    """Run the spans through ``cluster.num_replicas`` replicas; yield their output tables as they stream back."""
    import ray.data

    cluster = manifest.cluster
    num_gpus = cluster.num_gpus_per_replica
    if num_gpus is None:
        num_gpus = 1 if engine_config.device.startswith("cuda") else 0
    num_threads = max(1, int(cluster.num_cpus_per_replica))
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    # NOTE: one span per item and one item per call: a call is one batch of up to cluster.batch_size rows.
    spans_ds = ray.data.from_items([{"start": s, "end": e} for s, e in spans], override_num_blocks=len(spans))
    outputs = spans_ds.map_batches(
        _Replica, batch_size=1, batch_format="pyarrow", concurrency=cluster.num_replicas,
        num_gpus=num_gpus, num_cpus=cluster.num_cpus_per_replica,
        fn_constructor_kwargs={"manifest": manifest, "engine_config": engine_config, "num_threads": num_threads},
    )
    yield from outputs.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0)


def run_on_ray(manifest, engine_config, done: np.ndarray, writer, on_group) -> None:
    """Compute the rows not ``done`` on Ray replicas and hand each row's output rows to ``on_group`` once.

    Args:
        manifest: the job.
        engine_config: the resolved ``EngineConfig`` (each replica loads its own engine with it).
        done: bool over the job's rows, True for rows this run must not compute (committed, or another shard's).
        writer: the run's ``PartWriter`` (its time threshold is checked as batches come back).
        on_group: called with each input row's output rows, in the order they come back.
    """
    connect(manifest.cluster.address, num_cpus=os.cpu_count())
    written = done.copy()
    waiting: dict[int, list[dict]] = {}
    for table in output_batches(manifest, engine_config, pending_spans(done, manifest.cluster.batch_size)):
        sizes = table.column(GROUP_SIZE_COLUMN).to_pylist()
        for record, size in zip(table.drop_columns([GROUP_SIZE_COLUMN]).to_pylist(), sizes):
            row_index = record["row_index"]
            if written[row_index]:
                continue  # NOTE: a retried batch's row that already came back; never written twice
            group = waiting.setdefault(row_index, [])
            group.append(record)
            if len(group) == size:
                del waiting[row_index]
                written[row_index] = True
                on_group([_output_row(r) for r in sorted(group, key=lambda r: r["sample_index"])])
        writer.maybe_commit()
    assert not waiting, f"{len(waiting)} rows came back without all their samples"


def _output_row(record: dict) -> OutputRow:
    """An output row read back from a replica's table: ``OUTPUT_SCHEMA``'s columns, then the carried ones."""
    fields = {name: record.pop(name) for name in OUTPUT_SCHEMA.names}
    if fields["logprobs"] is not None:
        fields["logprobs"] = [{e["token_id"]: e["logprob"] for e in step} for step in fields["logprobs"]]
    return OutputRow(**fields, carried=record)
