"""One run of a job under the output's lock, once ``run_job`` has checked its resources and taken the lock:
``_Job`` opens the output (the owner's ``open``: resume, ``--overwrite``, ``--retry-errors``), runs the rows not
done (locally through the row loop, ``cbrun.jobs.run.row_loop``, or on Ray, ``cbrun.jobs.run.ray_executor``) and finishes
(_results.jsonl, stats.json, _SUCCESS); ``_ShardJob`` does the same for one shard (``cbrun.jobs.run.sharding``)."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from cbrun.jobs.config.manifest import JobManifest
from cbrun.jobs.input.reader import PromptReader
from cbrun.jobs.observe.progress import JobProgress
from cbrun.jobs.observe.timeline import TimelineRecorder, run_id, timeline_name
from cbrun.jobs.output.compact import compact_output
from cbrun.jobs.output.fingerprint import fingerprint_differences
from cbrun.jobs.output.lock import DirectoryLock
from cbrun.jobs.output.output_dir import OutputDir
from cbrun.jobs.output.row_ids import warn_repeated_ids
from cbrun.jobs.output.writer import OUTPUT_SCHEMA, PartWriter
from cbrun.jobs.run.heap import frozen_heap
from cbrun.jobs.run.resolve import ResolvedJob
from cbrun.jobs.run.resources import MODES, JobAborted, JobError, load_engine, model_vocab_size
from cbrun.jobs.run.row_loop import _JobRun
from cbrun.jobs.run.sharding import shard_mask, shard_ranges, unit_starts, write_shards_file
from cbrun.jobs.run.summary import JobSummary


class _Job:
    """One run of a job under the output directory's lock: open the output, run the rows not done, finish."""

    def __init__(self, job: ResolvedJob, fingerprint: dict, start: float):
        self.job = job
        self.manifest = job.manifest
        self.reader = job.reader
        self.checkpoint = job.output
        self.fingerprint = fingerprint
        self.start = start

    #: rows of the job this run may write: all of them (a sharded run: its shard's, ``_ShardJob``).
    within: np.ndarray | None = None

    def open(self, retry_errors: bool):
        """Open the output and read which rows are done. Returns the ``OutputState``."""
        state = self.checkpoint.open(
            self.fingerprint, self.reader.num_rows, overwrite=self.manifest.output.overwrite, retry_errors=retry_errors
        )
        self.write_shards_file()
        return state

    def start_writer(self) -> PartWriter:
        """The output's ``PartWriter``, the directory made ready (``OutputDir.start``); a stale results file gone."""
        out = self.manifest.output
        writer = self.checkpoint.start(
            self.fingerprint,
            out.commit_every_rows,
            out.commit_every_seconds,
            overwrite=self.clears_at_start(),
            carried_fields=self.job.carried_fields,
        )
        self.write_shards_file()  # again: --overwrite cleared the directory's cbrun files
        remove_stale_results(self.manifest, self.checkpoint)
        return writer

    def clears_at_start(self) -> bool:
        """Whether the writer's start discards the directory's results (--overwrite; a shard clears in ``open``)."""
        return self.manifest.output.overwrite

    def write_shards_file(self) -> None:
        write_shards_file(self.checkpoint, 1, self.reader.num_rows, [(0, self.reader.num_rows)])

    #: the timeline file's suffix naming this run's share of the job ("": the whole job).
    timeline_part = ""

    def open_timeline(self, engine, engine_config, summary: JobSummary) -> TimelineRecorder | None:
        """This run's timeline recorder (``cbrun.jobs.observe.timeline``), or None when ``output.timeline_interval_s`` is 0."""
        interval = self.manifest.output.timeline_interval_s
        if not interval:
            return None
        run = run_id()
        header = {
            "run": run,
            "part": self.timeline_part or "whole job",
            "model": self.manifest.model.path,
            "engine": engine_config,
        }
        return TimelineRecorder(
            self.checkpoint,
            timeline_name(run, self.timeline_part),
            engine,
            lambda: (summary.num_rows, summary.num_errors),
            interval,
            header,
        )

    def finish(self, summary: JobSummary, tokenizer=None) -> None:
        """Write _results.jsonl (``output.format = "openai-batch"``), stats.json and _SUCCESS: the whole job is in
        the output."""
        self.checkpoint.prepare(self.fingerprint)
        # NOTE: an output with no rows still holds one part, so that readers see its columns (pandas, duckdb)
        self.checkpoint.write_empty_part_if_none(pa.schema([*OUTPUT_SCHEMA, *self.job.carried_fields]))
        write_results_file(self.manifest, tokenizer)
        if self.manifest.output.compact:
            compact_output(self.checkpoint.output_dir, self.manifest.output.target_file_mb, locked=True)
        self.checkpoint.mark_finished(
            self.fingerprint, {**summary.as_dict(), "num_rows_in_output": summary.num_skipped + summary.num_rows}
        )

    def run(self, engine, progress: bool, retry_errors: bool) -> JobSummary:
        """Open the output, run the rows not done (on ``engine`` when given, else on one loaded here, or on Ray),
        finish; returns the run's summary."""
        manifest, checkpoint, overwrite = self.manifest, self.checkpoint, self.manifest.output.overwrite
        engine_config, tokenizer = self.job.engine, self.job.tokenizer
        try:
            state = self.open(retry_errors)
        except ValueError as exc:  # FingerprintMismatch included
            raise JobError(str(exc)) from None
        done = state.done if self.within is None else state.done | ~self.within
        summary = JobSummary(
            output_dir=str(manifest.output.path),
            num_skipped=int(state.done.sum()),
            total_output_rows=state.num_output_rows,
            total_error_rows=state.num_error_rows,
            max_error_fraction=manifest.output.max_error_fraction,
        )
        if isinstance(self.reader, PromptReader) and manifest.input.id_column is not None:
            summary.num_repeated_ids = warn_repeated_ids(
                self.reader, self.checkpoint.local_dir, self.fingerprint["input"]
            )
        if done.all() and not overwrite:
            # NOTE: every row is in the output already; a run killed between its last commit and _SUCCESS is
            # finished here without loading the model.
            summary.empty_input = self.reader.num_rows == 0
            if not checkpoint.is_finished():
                self.finish(summary)
            else:
                write_results_file(manifest, only_if_missing=True)  # the job ran without --output-format before
            summary.already_finished = True
            summary.elapsed_s = time.perf_counter() - self.start
            return summary

        if manifest.cluster.executor == "ray":
            return self._run_on_ray(engine_config, summary, done, progress)
        if engine is not None:
            return self._generate(engine, engine_config, tokenizer, summary, done, progress)
        engine = load_engine(manifest.model.path, engine_config, expected_requests(manifest, self.reader, done))
        try:
            return self._generate(engine, engine_config, tokenizer, summary, done, progress)
        finally:
            engine.close()  # NOTE: a tensor-parallel engine's ranks end with its run, not with this process

    def _generate(
        self, engine, engine_config, tokenizer, summary: JobSummary, done: np.ndarray, progress: bool
    ) -> JobSummary:
        """The rows not ``done`` through ``engine`` into parts, then the job's finish; returns ``summary`` filled.

        Raises:
            JobAborted: a fault that is not one row's (the finished rows committed).
            KeyboardInterrupt: a stop signal, with ``num_committed_rows`` set.
        """
        manifest = self.manifest
        out = manifest.output
        writer = self.start_writer()
        mode = MODES[manifest.input.mode](
            manifest, tokenizer, engine.max_model_len, model_vocab_size(manifest.model.path)
        )
        generation_start = time.perf_counter()
        max_in_flight = 4 * engine_config.max_requests_per_batch
        try:
            with frozen_heap():  # the imports' and the model's objects, out of the collector's way (jobs.run.heap)
                _JobRun(
                    mode,
                    engine,
                    writer,
                    summary,
                    manifest.input.order_window,
                    max_in_flight,
                    self.open_timeline(engine, engine_config, summary),
                ).run(self.reader, done, progress)
        except KeyboardInterrupt as exc:  # jobs.run.signals.Interrupted (SIGINT, SIGTERM) included
            exc.num_committed_rows = writer.num_committed_rows
            raise
        except Exception as exc:
            raise JobAborted(
                f"the job stopped on a fault that is not one row's: {type(exc).__name__}: {exc}; the "
                f"{writer.num_committed_rows} output rows this run finished are committed in {out.path}; rerun the "
                f"same command to resume"
            ) from exc
        summary.generation_s = time.perf_counter() - generation_start
        summary.elapsed_s = time.perf_counter() - self.start
        summary.peak_memory_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        summary.peak_gpu_memory_mib = _peak_gpu_memory_mib(engine_config.device)
        summary.engine_stats = engine.stats.as_dict()
        summary.total_output_rows += summary.num_output_rows
        summary.total_error_rows += summary.num_errors
        self.finish(summary, tokenizer)
        return summary

    def _run_on_ray(self, engine_config, summary: JobSummary, done: np.ndarray, progress: bool) -> JobSummary:
        """The rows not ``done`` on a Ray Data pool of engine replicas (``cbrun.jobs.run.ray_executor``); this process only
        writes."""
        from cbrun.jobs.run.ray_executor import run_on_ray

        out = self.manifest.output
        writer = self.start_writer()
        counter = _JobRun(None, None, writer, summary, 0, 0)
        generation_start = time.perf_counter()
        try:
            with frozen_heap(), JobProgress(int((~done).sum()), None, enabled=progress) as bar:  # as in the local run
                # NOTE: on an object store each replica commits its own parts; the driver only counts their rows
                commit_output = self.checkpoint.output_dir if self.checkpoint.local_dir is None else None
                on_rows = counter.tally if commit_output else counter.count
                summary.replica_stats = run_on_ray(
                    self.manifest,
                    engine_config,
                    done,
                    writer,
                    lambda rows: (on_rows(rows), bar.row_finished(rows)),
                    commit_output,
                    self.job.model,
                )
        except KeyboardInterrupt as exc:
            writer.commit()
            exc.num_committed_rows = writer.num_committed_rows
            raise
        except Exception as exc:
            writer.commit()
            raise JobAborted(
                f"the job stopped on a fault that is not one row's: {type(exc).__name__}: {exc}; the "
                f"{writer.num_committed_rows} output rows this run finished are committed in {out.path}; rerun the "
                f"same command to resume"
            ) from exc
        writer.commit()
        summary.generation_s = time.perf_counter() - generation_start
        summary.elapsed_s = time.perf_counter() - self.start
        summary.peak_memory_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        summary.total_output_rows += summary.num_output_rows
        summary.total_error_rows += summary.num_errors
        self.finish(summary)
        return summary


class _ShardJob(_Job):
    """One run of shard I of N (``cbrun.jobs.run.sharding``): its rows only, under its own lock; the steps that touch the
    whole directory under ``DirectoryLock``; ``_SUCCESS`` only once every shard's rows are committed."""

    def __init__(self, job: ResolvedJob, fingerprint: dict, start: float):
        super().__init__(job, fingerprint, start)
        self.shard = job.shard
        self.ranges = shard_ranges(unit_starts(job.reader), job.reader.num_rows, self.shard.count)
        self.within = shard_mask(job.reader.num_rows, self.ranges[self.shard.index])
        self.timeline_part = f"shard-{self.shard.index}-of-{self.shard.count}"

    def open(self, retry_errors: bool):
        checkpoint, num_rows = self.checkpoint, self.reader.num_rows
        with DirectoryLock(checkpoint.output_dir):
            if self.manifest.output.overwrite:
                old = checkpoint.read_job_file()
                if old is not None and fingerprint_differences(old, self.fingerprint):
                    # NOTE: the first shard of a new job clears the old job's results; the next shards find this
                    # job's job.json and drop their own rows alone.
                    checkpoint.prepare(self.fingerprint, overwrite=True)
                else:
                    checkpoint.remove_rows(np.flatnonzero(self.within))
            state = checkpoint.open(self.fingerprint, num_rows)
            if retry_errors:
                failed = state.error_rows[self.within[state.error_rows]]
                if len(failed):
                    checkpoint.clear_finished()
                    checkpoint.remove_rows(failed)
            self.write_shards_file()
            state = checkpoint.read_state(num_rows, self.within)
        # NOTE: the rows outside the shard count as done for this run's bitmap (never read, never written).
        return state

    def start_writer(self) -> PartWriter:
        with DirectoryLock(self.checkpoint.output_dir):
            return super().start_writer()

    def clears_at_start(self) -> bool:
        return False  # ``open`` has dropped this shard's rows (or a new job's results); the other shards' stay

    def write_shards_file(self) -> None:
        write_shards_file(self.checkpoint, self.shard.count, self.reader.num_rows, self.ranges)

    def finish(self, summary: JobSummary, tokenizer=None) -> None:
        """Record this shard's summary; then, if every row of every shard is committed, the job's."""
        checkpoint, num_rows = self.checkpoint, self.reader.num_rows
        shard_stats = {**summary.as_dict(), "shard": str(self.shard), "rows": list(self.ranges[self.shard.index])}
        with DirectoryLock(checkpoint.output_dir):
            checkpoint.write_meta(f"stats-{self.shard.lock_name.removeprefix('lock-')}.json", shard_stats)
            whole = checkpoint.read_state(num_rows)
            if not whole.done.all() or checkpoint.is_finished():
                return
            shards = [checkpoint.read_meta(f"stats-{i}-of-{self.shard.count}.json") for i in range(self.shard.count)]
            write_results_file(self.manifest, tokenizer)
            checkpoint.mark_finished(
                self.fingerprint,
                {
                    "output_dir": str(checkpoint.output_dir),
                    "num_rows_in_output": num_rows,
                    "total_output_rows": whole.num_output_rows,
                    "total_error_rows": whole.num_error_rows,
                    "num_shards": self.shard.count,
                    "shards": shards,
                    "max_error_fraction": self.manifest.output.max_error_fraction,
                },
            )


def write_results_file(manifest: JobManifest, tokenizer=None, only_if_missing: bool = False) -> None:
    """Write ``_results.jsonl`` when ``output.format = "openai-batch"`` (before _SUCCESS: a finished job has it)."""
    from cbrun.jobs.output.export import RESULTS_FILE, export_openai_batch

    path = Path(manifest.output.path) / RESULTS_FILE
    if manifest.output.format == "openai-batch" and not (only_if_missing and path.is_file()):
        export_openai_batch(manifest.output.path, tokenizer=tokenizer)


def remove_stale_results(manifest: JobManifest, output: OutputDir) -> None:
    """Remove a ``_results.jsonl`` the run will write again, so that no stale one sits beside new parts."""
    from cbrun.jobs.output.export import RESULTS_FILE

    if manifest.output.format == "openai-batch":
        output.store.delete(RESULTS_FILE)


def expected_requests(manifest: JobManifest, reader, done: np.ndarray) -> int | None:
    """Requests this run will add to the engine: rows to do times ``n``; None when a row can add more than that
    (score mode's candidates, a per-row ``n`` column or OpenAI request body). Lets the engine size its default
    cache to the job."""
    if manifest.input.mode == "score" or not isinstance(reader, PromptReader) or reader.samples_column is not None:
        return None
    return int((~done).sum()) * manifest.n


def _peak_gpu_memory_mib(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
