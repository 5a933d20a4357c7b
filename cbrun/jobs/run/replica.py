"""One engine replica of the Ray executor: several batches in flight in one engine's continuous batching.

Ray Data hands a replica (an actor of the pool) up to ``cluster.max_concurrent_batches`` batches at once; its async
``__call__`` gives each to the replica's ``BatchLoop`` and awaits the batch's output table. The loop is one thread
that owns the engine and the job's mode: it admits the rows of every batch it holds into the same engine, steps
it, and hands a batch back as soon as its own rows are done, while the other batches' rows keep running::

    Ray Data ──batch 1──▶ __call__ ─┐                       ┌─▶ rows of batch 1 done ─▶ table 1
    Ray Data ──batch 2──▶ __call__ ─┼─▶ inbox ─▶ BatchLoop ─┤   (steps mix batch 1 and batch 2 rows)
                                    │   (one engine thread)  └─▶ rows of batch 2 done ─▶ table 2

So the engine's batch stays full across batch boundaries instead of draining at the end of each batch (the tail
of one batch overlaps the head of the next). It is the shape of Ray Data LLM's vLLM engine stage (an async UDF over
an async engine, ``max_concurrent_batches`` per actor:
https://docs.ray.io/en/latest/data/api/doc/ray.data.llm.vLLMEngineProcessorConfig.html); the code is ours.
A row's outputs depend only on the row (its seeds derive from the job seed and row id), never on which batches
shared its steps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import pyarrow as pa

from cbrun.engine.worker.tp_group import TensorParallelError
from cbrun.jobs.input.reader import InputRow
from cbrun.jobs.output.writer import OUTPUT_SCHEMA, OutputRow, rows_to_table
from cbrun.jobs.run.row_driver import RowDriver

logger = logging.getLogger("cbrun")

#: A column of the replica's tables beside ``OUTPUT_SCHEMA``'s: the number of output rows of the row (its
#: samples), so the driver writes a row only once it holds all of them.
GROUP_SIZE_COLUMN = "_num_in_group"
#: Another: the forward passes in which the row ran beside rows of another batch (the overlap this module is for;
#: the driver adds them up into the run's stats).
SHARED_STEPS_COLUMN = "_num_shared_steps"


@dataclass(eq=False)
class _Batch:
    """One batch in the loop: its output rows so far and the rows still running."""

    future: Future
    groups: list[list[OutputRow]] = field(default_factory=list)
    num_running: int = 0  # rows whose requests are not all back
    shared_steps: dict[int, int] = field(default_factory=dict)  # row index -> steps shared with another batch


class BatchLoop:
    """The engine thread of a replica: batches of input rows in, each batch's output table out when it is done.

    Owns the engine, the job's mode (through a ``RowDriver``, as the single-process loop) and every batch it was
    given; nothing else touches them, so the engine and the mode need no locks. ``submit`` is the only entry, safe
    from any thread.

    Args:
        engine: the replica's ``LLMEngine``.
        make_mode: builds the job's mode (``cbrun.jobs.modes.mode.JobMode``); called again after a fault to start clean.
        schema: the output table's schema (``OUTPUT_SCHEMA`` and the carried columns).
        order_window: ``input.order_window`` (prefix-aware order within a batch).
        max_in_flight: bound on the engine's queued plus running requests, over all batches.

    Attributes:
        num_steps: forward passes run.
        num_shared_steps: forward passes whose requests came from more than one batch.
        num_rows_done / num_error_rows: input rows handed back in finished batches, and their error output rows.
        on_idle: called on the engine thread each time the loop runs out of work (None: nothing is called); the
            replica's timeline records a sample there (``cbrun.jobs.observe.timeline``).
    """

    def __init__(self, engine, make_mode, schema: pa.Schema, order_window: int, max_in_flight: int):
        self.engine = engine
        self.make_mode = make_mode
        self.order_window = order_window
        self.driver = RowDriver(make_mode(), order_window)
        self.schema = schema
        self.max_in_flight = max_in_flight
        self.num_steps = 0
        self.num_shared_steps = 0
        self.num_rows_done = 0
        self.num_error_rows = 0
        self.on_idle = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: deque = deque()  # requests of admitted batches not yet added to the engine
        self._batch_of: dict[int, _Batch] = {}  # row index -> its batch, while the row runs
        self._num_in_engine = 0
        engine.step_observer = self._observe_step
        threading.Thread(target=self._run, name="cbrun-engine", daemon=True).start()

    def submit(self, rows: list[InputRow]) -> Future:
        """Queue a batch's input rows; the future holds its output table (``GROUP_SIZE_COLUMN`` and
        ``SHARED_STEPS_COLUMN`` added) once every row is done, or the exception of a fault that is not one row's."""
        future: Future = Future()
        self._inbox.put((rows, future))
        return future

    # ---- the engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                idle = not self._requests and not self.engine.has_unfinished_requests()
                if idle and self.on_idle is not None:
                    self.on_idle()
                self._take_batches(block=idle)
                self._add_requests()
                if self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        self._num_in_engine -= 1
                        self._collect(output)
            except TensorParallelError:
                # NOTE: the replica's group is broken for good: end the actor, so Ray restarts it (a new group) and
                # retries its batches; the driver writes each row once
                logger.exception("a rank of this tensor-parallel replica failed; ending the replica for Ray to restart")
                os._exit(1)
            except Exception as exc:  # not one row's fault (those come back as error rows): fail the batches held
                logger.exception("replica engine fault; failing its %d batches in flight", len(self._batches()))
                self._fail_all(exc)

    def _take_batches(self, block: bool) -> None:
        """Admit the batches waiting in the inbox (waiting for one when the engine is idle)."""
        while True:
            try:
                rows, future = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if not future.set_running_or_notify_cancel():
                continue
            try:
                self._admit(rows, future)
            except Exception as exc:  # NOTE: the batch may not be in _batch_of yet; _run fails the others
                if not future.done():
                    future.set_exception(exc)
                raise

    def _admit(self, rows: list[InputRow], future: Future) -> None:
        batch = _Batch(future)
        work = []
        for row in rows:
            prepared = self.driver.prepare(row)
            if isinstance(prepared, OutputRow):
                batch.groups.append([prepared])
            else:
                work.append(prepared)
                self._batch_of[row.row_index] = batch
                batch.num_running += 1
        for item in self.driver.ordered(work):
            self._requests.extend(item.requests)
        self._maybe_finish(batch)

    def _add_requests(self) -> None:
        while self._requests and self._num_in_engine < self.max_in_flight:
            self.engine.add_request(*self._requests.popleft())
            self._num_in_engine += 1

    def _collect(self, output) -> None:
        rows = self.driver.collect(output)
        if rows is None:
            return
        batch = self._batch_of.pop(rows[0].row_index)
        batch.groups.append(rows)
        batch.num_running -= 1
        self._maybe_finish(batch)

    def _maybe_finish(self, batch: _Batch) -> None:
        if batch.num_running:
            return
        self.num_rows_done += len(batch.groups)
        self.num_error_rows += sum(row.finish_reason == "error" for group in batch.groups for row in group)
        table = rows_to_table([row for group in batch.groups for row in group], self.schema)
        sizes = [len(group) for group in batch.groups for _ in group]
        shared = [batch.shared_steps.get(row.row_index, 0) for group in batch.groups for row in group]
        table = table.append_column(GROUP_SIZE_COLUMN, pa.array(sizes, pa.int32()))
        batch.future.set_result(table.append_column(SHARED_STEPS_COLUMN, pa.array(shared, pa.int64())))

    def _observe_step(self, request_ids: list) -> None:
        """``LLMEngine.step_observer``: count the steps that ran rows of more than one batch."""
        self.num_steps += 1
        first = self._batch_of.get(request_ids[0][0])
        if all(self._batch_of.get(row_index) is first for row_index, _ in request_ids):
            return
        self.num_shared_steps += 1
        for row_index, _ in request_ids:
            batch = self._batch_of.get(row_index)
            if batch is not None:
                batch.shared_steps[row_index] = batch.shared_steps.get(row_index, 0) + 1

    def _batches(self) -> set[_Batch]:
        return set(self._batch_of.values())

    def _fail_all(self, exc: Exception) -> None:
        """Fail every batch held and start clean: an empty engine and a fresh mode (Ray Data may retry them)."""
        self.engine.abort_all_requests()
        for batch in self._batches():
            if not batch.future.done():
                batch.future.set_exception(exc)
        self._batch_of.clear()
        self._requests.clear()
        self._num_in_engine = 0
        self.driver = RowDriver(self.make_mode(), self.order_window)


class Replica:
    """A Ray Data actor holding one engine, loaded once, serving up to ``max_concurrent_batches`` batches at once.

    Args:
        manifest: the job's ``JobManifest``.
        engine_config: the resolved ``EngineConfig``.
        num_threads: torch threads of this replica.
        max_concurrent_batches: batches this replica runs at once (``cluster.max_concurrent_batches``).
        commit_output: an object-store output URI: the replica commits each batch's rows there itself
            (``cbrun.jobs.output.object_parts.commit_span``) and returns only their counts (``slim_table``); None: it returns
            the rows, and the driver writes them.
        model_source: the model the driver resolved (``cbrun.jobs.run.resolve.ResolvedJob.model``); None: the
            folder ``manifest.model.path``.
    """

    def __init__(
        self,
        manifest,
        engine_config,
        num_threads: int,
        max_concurrent_batches: int,
        commit_output: str | None = None,
        model_source=None,
    ):
        from cbrun.jobs.output.commits import new_attempt
        from cbrun.jobs.output.output_dir import open_output
        from cbrun.jobs.store.store import FsspecStore

        manifest, engine = self._open_rows_and_engine(manifest, engine_config, num_threads, model_source)
        self.max_concurrent_batches = max_concurrent_batches
        self._slots: asyncio.Semaphore | None = None
        # NOTE: the job's output, over a store with the job's endpoint: the replica's timeline, and its parts when
        # it commits them itself
        self.output = open_output(manifest.output.path, endpoint_url=manifest.storage.endpoint_url)
        store = self.output.store
        self.commit_store = store if commit_output is not None and isinstance(store, FsspecStore) else None
        self.attempt = new_attempt()  # NOTE: this replica's own part names; a restarted replica gets another
        self._num_parts = 0
        self.timeline = self._open_timeline(manifest, engine, engine_config)

    def _open_rows_and_engine(self, manifest, engine_config, num_threads: int, model_source):
        """This replica's reader (``self.reader``), engine and batch loop (``self.loop``) from the job's settings;
        returns the manifest with the model path as this machine sees it, and the engine."""
        import torch

        from cbrun.jobs.model.source import worker_model_path
        from cbrun.jobs.run.resources import (
            MODES,
            load_engine,
            load_tokenizer,
            model_vocab_size,
            open_reader,
            output_carried_fields,
        )

        torch.set_num_threads(num_threads)
        # NOTE: a Hub model at the commit the driver resolved, from this machine's cache when the driver's is not here
        model_path = worker_model_path(model_source, manifest.model.path, manifest.storage.endpoint_url)
        manifest = replace(manifest, model=replace(manifest.model, path=model_path))
        self.reader = open_reader(manifest, model_source)
        # NOTE: the replica's CPUs set its threads; engine.num_threads ("auto": every core) would oversubscribe them
        engine = load_engine(manifest.model.path, replace(engine_config, num_threads=num_threads))
        tokenizer = load_tokenizer(manifest.model.path, loader=engine_config.loader)
        if hasattr(self.reader, "bind_tokenizer"):  # OpenAI batch requests: prompt ids come from the tokenizer
            self.reader.bind_tokenizer(tokenizer, manifest.model.path)
        vocab_size = model_vocab_size(manifest.model.path)

        def make_mode():
            return MODES[manifest.input.mode](manifest, tokenizer, engine.max_model_len, vocab_size)

        schema = pa.schema([*OUTPUT_SCHEMA, *output_carried_fields(manifest.output.keep_columns, self.reader)])
        self.loop = BatchLoop(
            engine, make_mode, schema, manifest.input.order_window, 4 * engine_config.max_requests_per_batch
        )
        return manifest, engine

    def _open_timeline(self, manifest, engine, engine_config):
        """This replica's own timeline in the output's ``_cbrun/`` (``cbrun.jobs.observe.timeline``), sampled on the engine thread;
        None when ``output.timeline_interval_s`` is 0."""
        from cbrun.jobs.observe.timeline import TimelineRecorder, run_id, timeline_name

        interval = manifest.output.timeline_interval_s
        if not interval:
            return None
        run, part = run_id(), f"replica-{os.getpid()}"
        loop = self.loop
        recorder = TimelineRecorder(
            self.output,
            timeline_name(run, part),
            engine,
            lambda: (loop.num_rows_done, loop.num_error_rows),
            interval,
            {"run": run, "part": part, "model": manifest.model.path, "engine": engine_config},
        )
        engine.step_listener = recorder.on_step
        loop.on_idle = lambda: recorder.record(flush=True)
        return recorder

    async def __call__(self, batch: pa.Table) -> pa.Table:
        """``batch``: input rows (``cbrun.jobs.run.ray_executor.PendingRowsDatasource``). Returns their output rows (``OUTPUT_SCHEMA``,
        ``GROUP_SIZE_COLUMN`` and ``SHARED_STEPS_COLUMN``), a row's samples together."""
        if self._slots is None:  # NOTE: made here, on the event loop Ray Data runs async UDFs on
            self._slots = asyncio.Semaphore(self.max_concurrent_batches)
        async with self._slots:
            table = await asyncio.wrap_future(self.loop.submit(list(self.reader.rows_of(batch))))
        if self.commit_store is None or not table.num_rows:
            return table
        from cbrun.jobs.output.object_parts import commit_span

        seq, self._num_parts = self._num_parts, self._num_parts + 1
        parts = table.drop_columns([GROUP_SIZE_COLUMN, SHARED_STEPS_COLUMN])
        await asyncio.to_thread(commit_span, self.commit_store, parts, self.attempt, seq)
        return slim_table(table)


#: The columns a replica that commits its own parts still returns: what the driver's counts and summary need.
SLIM_COLUMNS = (
    "id",
    "row_index",
    "num_prompt_tokens",
    "num_completion_tokens",
    "finish_reason",
    "error",
    "candidate_num_tokens",
    "sample_index",
    "stop_reason",
)


def slim_table(table: pa.Table) -> pa.Table:
    """An output table with its completions, token ids, log-probabilities and carried columns nulled or left
    out: the driver counts the rows (``cbrun.jobs.run.ray_executor``), the parts hold them."""
    columns = {}
    for f in OUTPUT_SCHEMA:
        column = table.column(f.name)
        columns[f.name] = column if f.name in SLIM_COLUMNS else pa.nulls(table.num_rows, f.type)
    columns[GROUP_SIZE_COLUMN] = table.column(GROUP_SIZE_COLUMN)
    columns[SHARED_STEPS_COLUMN] = table.column(SHARED_STEPS_COLUMN)
    return pa.table(columns)
