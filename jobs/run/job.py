"""One batch inference job: reader -> mode -> engine.generate -> mode -> writer, with resume, progress and a summary.

``run_job`` checks every resource first (``jobs.run.resources``), then takes the output's lock and holds it to the end
(``jobs.output.checkpoint``, ``jobs.output.lock``). The job owns rows and files; the engine only sees (request_id,
prompt_token_ids, SamplingParams). The job's mode (``MODES``: ``jobs.modes.generate``, ``jobs.modes.scoring``) turns rows into
requests and outputs back into rows: request ids are ``(row_index, sample_index)`` in generate mode, one request
per sample (``sampling.n`` or the row's ``n`` column), ``(row_index, candidate index)`` in score mode. Rows are
submitted in prefix-aware order over a window of ``input.order_window`` rows, a row's requests back to back
(``jobs.modes.ordering``); a row's samples are written together, in one part, once all are back. Rows the job can tell
are bad (null or empty prompt, prompt too long, bad per-row sampling value) never reach the engine: they go
straight to the writer as error rows, and the job goes on.

A sharded run (``--shard I/N``, ``_ShardJob``) does the same over its share of the rows (``jobs.run.sharding``); with
``cluster.executor = "ray"`` the engine work runs on a Ray Data pool of replicas and this process only writes
(``jobs.run.ray_executor``).
"""

from __future__ import annotations

import resource
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from engine.config import checkpoint_dtype
from jobs import storage
from jobs.input.carry import carried_values
from jobs.input.chat import check_chat_template
from jobs.input.errors import InputError
from jobs.input.openai_batch import OpenAIBatchReader
from jobs.input.reader import PromptReader
from jobs.manifest import JobManifest
from jobs.model_defaults import apply_model_defaults
from jobs.modes.mode import JobMode
from jobs.modes.ordering import order_by_prefix
from jobs.observe.progress import JobProgress
from jobs.observe.timeline import TimelineRecorder, run_id, step_listeners, timeline_path
from jobs.output.checkpoint import Checkpoint, FingerprintMismatch
from jobs.output.compact import compact_output
from jobs.output.fingerprint import fingerprint_differences, job_fingerprint
from jobs.output.lease import LeaseLost
from jobs.output.lock import DirectoryLock, OutputLocked, Shard
from jobs.output.object_output import output_owner
from jobs.output.row_ids import warn_repeated_ids
from jobs.output.status import too_many_errors
from jobs.output.writer import OUTPUT_SCHEMA, OutputRow, PartWriter, committed_parts
from jobs.run.heap import frozen_heap
from jobs.run.job_setup import MODES, model_vocab_size, open_reader, output_carried_fields
from jobs.run.resources import JobAborted, JobError, check_model_dir, load_engine, load_tokenizer, resolve_device
from jobs.run.sharding import shard_mask, shard_ranges, unit_starts, write_shards_file
from jobs.storage import StorageError, is_uri
from jobs.storage_cache import local_model


@dataclass
class JobSummary:
    """What one ``run_job`` call did.

    Attributes:
        num_rows: input rows finished (written) by this run, errors included.
        num_output_rows: output rows written by this run: a row with n samples writes n (an error row one).
        num_errors: of the output rows, those with ``finish_reason == "error"``.
        num_skipped: rows already in the output before this run (resume).
        num_prompt_tokens / num_generated_tokens: summed over this run's rows.
        num_candidates / num_scored_tokens: score mode: candidates scored and their tokens (contexts excluded).
        elapsed_s: wall seconds of the whole run, model loading included.
        generation_s: wall seconds of generation alone (what tokens/s is measured over).
        peak_memory_mib: peak resident memory of the process.
        peak_gpu_memory_mib: peak CUDA memory allocated by torch, None off CUDA.
        already_finished: the output already held the finished job; nothing was done.
        empty_input: the input has no rows to run (no rows at all, or ``input.limit = 0``); the job is finished
            with no output rows (exit 0, as vLLM and Ray Data take an empty data set).
        num_repeated_ids: distinct ``id_column`` values that more than one input row holds (see ``jobs.output.row_ids``).
        engine_stats: ``LLMEngine.stats.as_dict()`` at the end.
        replica_stats: the Ray executor's counters over its replicas (``jobs.run.ray_executor.run_on_ray``).
        total_output_rows / total_error_rows: output rows in the whole output (earlier runs' and this run's), and
            of them the error rows.
        max_error_fraction: ``output.max_error_fraction``: above it, ``exit_code`` is 3.
    """

    output_dir: str
    num_rows: int = 0
    num_output_rows: int = 0
    num_errors: int = 0
    num_skipped: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_candidates: int = 0
    num_scored_tokens: int = 0
    elapsed_s: float = 0.0
    generation_s: float = 0.0
    peak_memory_mib: float = 0.0
    peak_gpu_memory_mib: float | None = None
    already_finished: bool = False
    empty_input: bool = False
    num_repeated_ids: int = 0
    engine_stats: dict[str, Any] = field(default_factory=dict)
    replica_stats: dict[str, int] = field(default_factory=dict)
    total_output_rows: int = 0
    total_error_rows: int = 0
    max_error_fraction: float = 1.0

    @property
    def too_many_errors(self) -> bool:
        """More error rows than ``max_error_fraction`` of the output allows; an output of error rows alone always."""
        return too_many_errors(self.total_output_rows, self.total_error_rows, self.max_error_fraction)

    @property
    def exit_code(self) -> int:
        """0: finished with error rows within budget; 3: finished, but too many error rows (``too_many_errors``)."""
        return 3 if self.too_many_errors else 0

    @property
    def generated_tokens_per_s(self) -> float:
        seconds = self.generation_s or self.elapsed_s
        return self.num_generated_tokens / seconds if seconds > 0 else 0.0

    def line(self) -> str:
        """The one summary line the CLI prints."""
        if self.empty_input:
            return (
                f"cbrun: warning: the input has no rows to run (an empty input, or --limit 0): nothing "
                f"generated; {self.output_dir} holds the finished job with no output rows"
            )
        if self.already_finished:
            return (
                f"cbrun: job already finished: all {self.num_skipped} rows of this input are in {self.output_dir} "
                f"(see _cbrun/stats.json); nothing to do (use --overwrite to recompute)"
                f"{self._errors()}"
            )
        gpu = "" if self.peak_gpu_memory_mib is None else f" | peak GPU memory {self.peak_gpu_memory_mib:.0f} MiB"
        if self.num_candidates:
            return (
                self._score_line() + f" | peak memory {self.peak_memory_mib:.0f} MiB{gpu}"
                f"{self._engine_counters()}{self._errors()}"
            )
        samples = f" | {self.num_output_rows} samples" if self.num_output_rows != self.num_rows else ""
        if self.num_repeated_ids:
            samples += f" | {self.num_repeated_ids} repeated ids"
        return (
            f"cbrun: {self.num_rows} rows ({self.num_errors} errors, {self.num_skipped} skipped){samples} | "
            f"{self.num_prompt_tokens} prompt tokens | {self.num_generated_tokens} generated tokens | "
            f"{self.elapsed_s:.1f} s | {self.generated_tokens_per_s:.0f} tokens/s generated | "
            f"peak memory {self.peak_memory_mib:.0f} MiB{gpu}{self._engine_counters()}{self._errors()}"
        )

    def _errors(self) -> str:
        """Where the error rows are, when there are any; what exit code 3 means, when it applies."""
        if not self.total_error_rows:
            return ""
        where = (
            f"{self.total_error_rows} of {self.total_output_rows} output rows in {self.output_dir} are error "
            f"rows (finish_reason = 'error'; their error column says why; rerun them with --retry-errors)"
        )
        if self.too_many_errors:
            return (
                f"\ncbrun: too many errors (exit code 3): {where}, above output.max_error_fraction = "
                f"{self.max_error_fraction:g}"
            )
        return f"\ncbrun: {where}"

    def _score_line(self) -> str:
        """Score mode's throughput: candidates/s, and tokens/s over context + candidate tokens."""
        seconds = max(self.generation_s or self.elapsed_s, 1e-9)
        return (
            f"cbrun: {self.num_rows} rows ({self.num_errors} errors, {self.num_skipped} skipped) | "
            f"{self.num_candidates} candidates | {self.num_prompt_tokens} context tokens | "
            f"{self.num_scored_tokens} candidate tokens | {self.elapsed_s:.1f} s | "
            f"{self.num_candidates / seconds:.1f} candidates/s, "
            f"{(self.num_prompt_tokens + self.num_scored_tokens) / seconds:.0f} tokens/s scored"
        )

    def _engine_counters(self) -> str:
        stats = self.engine_stats
        if not stats:
            return ""
        line = (
            f" | prefix cache hit rate {100 * stats['prefix_hit_rate']:.1f}% | {stats['num_offloads']} offloads, "
            f"{stats['num_soft_resets']} soft resets"
        )
        if stats.get("num_verify_steps"):  # speculative decoding ran
            line += (
                f" | speculative: {100 * stats['acceptance_rate']:.1f}% of {stats['num_proposed_tokens']} "
                f"proposals accepted, {stats['mean_tokens_per_verify_step']:.2f} tokens per verify step"
            )
        return line

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "generated_tokens_per_s": self.generated_tokens_per_s}


def check_output_apart_from_input(input_path: str | Path, output_path: str | Path) -> None:
    """Refuse an output directory that is the input, lies inside an input directory, or holds the input: the
    output's parts would be read back as input by the next run (or ``--overwrite`` would delete the input).

    Raises:
        InputError: naming both paths.
    """
    if is_uri(input_path) or is_uri(output_path):
        inp, out = str(input_path).rstrip("/"), str(output_path).rstrip("/")
        if out == inp or out.startswith(inp + "/") or inp.startswith(out + "/"):
            raise InputError(
                f"output {str(output_path)!r} overlaps the input {str(input_path)!r}: its part files "
                f"would be read back as input; give an --output outside the input"
            )
        return
    inp, out = Path(input_path).resolve(), Path(output_path).resolve()
    if out == inp:
        where = "is the input"
    elif inp.is_dir() and out.is_relative_to(inp):
        where = "is inside the input directory"
    elif inp.is_relative_to(out):
        where = "holds the input"
    else:
        return
    raise InputError(
        f"output directory {str(output_path)!r} {where} {str(input_path)!r}: its part files would be "
        f"read back as input; give an --output outside the input"
    )


def run_job(
    manifest: JobManifest, *, progress: bool = True, engine=None, retry_errors: bool = False, shard: Shard | None = None
) -> JobSummary:
    """Run (or resume, or recognise as finished) the job a manifest describes, holding the output's lock throughout.

    Args:
        manifest: the job.
        progress: show a tqdm progress bar on stderr.
        engine: an ``LLMEngine`` already loaded from ``manifest.model.path`` (tests reuse one); None loads it.
        retry_errors: first take the rows that have error rows out of the output, then run them again (each row
            is in the output once afterwards, as before).
        shard: run only this shard of the job (``jobs.run.sharding``); None: ``input.shard``, else the whole job.
            A shard locks, resumes and finishes its own rows; the job's ``_SUCCESS`` and ``stats.json`` are
            written by whichever shard finds every row of every shard committed.

    Returns:
        The run's ``JobSummary`` (its ``exit_code`` says whether the error rows are within
        ``output.max_error_fraction``); also written to the output's ``_cbrun/stats.json`` when the job is finished.

    Raises:
        JobError: before any generation, for a missing or unusable resource (input, column, model, tokenizer,
            device, output directory), an output directory that holds another job, or one another run holds.
        JobAborted: generation stopped on a fault that is not one row's (e.g. out of memory, a device error); the
            rows finished before it are committed.
        KeyboardInterrupt: (or ``jobs.run.signals.Interrupted``) the run was interrupted; the rows finished before it
            are committed, and ``num_committed_rows`` on the exception counts them.
    """
    start = time.perf_counter()
    storage.configure(manifest.storage.endpoint_url)
    try:
        manifest.check_required()
        check_output_apart_from_input(manifest.input.path, manifest.output.path)
        check_object_store_output(manifest, shard)
        manifest.model.path = local_model(manifest.model.path)
        reader = open_reader(manifest)
    except (InputError, ValueError, ImportError, FileNotFoundError, StorageError) as exc:
        raise JobError(str(exc)) from None
    check_model_dir(manifest.model.path)
    if manifest.engine.speculative == "draft":
        try:
            check_model_dir(manifest.engine.draft_model)
        except JobError as exc:
            raise JobError(f"engine.draft_model: {exc}") from None
    try:
        apply_model_defaults(manifest)  # NOTE: before the fingerprint, which records the settings used
    except ValueError as exc:
        raise JobError(str(exc)) from None
    engine_config = replace(manifest.engine, device=resolve_device(manifest.engine.device))
    # NOTE: checked before any work, loading the model included
    tokenizer = load_tokenizer(manifest.model.path, loader=manifest.engine.loader)
    if manifest.input.chat or isinstance(reader, OpenAIBatchReader):
        try:
            if isinstance(reader, OpenAIBatchReader):
                reader.bind_tokenizer(tokenizer, manifest.model.path)
            else:
                check_chat_template(tokenizer, manifest.model.path)
        except ValueError as exc:
            raise JobError(str(exc)) from None
    if manifest.cluster.executor == "ray":
        from jobs.run.ray_executor import check_ray_installed

        try:
            check_ray_installed()
        except ImportError as exc:
            raise JobError(str(exc)) from None
    if shard is None:
        shard = Shard.parse(manifest.input.shard) if manifest.input.shard is not None else Shard()
    checkpoint = output_owner(manifest.output.path, shard)
    try:
        # NOTE: dtype "auto" means bf16 on a GPU and float32 on the CPU: the fingerprint records the one this run uses
        fingerprint = job_fingerprint(
            manifest,
            reader.num_input_rows,
            shard.count,
            engine_dtype=engine_config.resolve_dtype(checkpoint_dtype(manifest.model.path)),
            may_sample=_may_sample(manifest, reader),
        )
    except StorageError as exc:
        raise JobError(str(exc)) from None
    # NOTE: a refused run leaves no output directory it made (see _remove_refused_output); a shard's may be shared
    created_output = (
        shard.count == 1 and isinstance(checkpoint, Checkpoint) and not Path(checkpoint.output_dir).exists()
    )
    try:
        checkpoint.check(fingerprint, overwrite=manifest.output.overwrite)  # before creating anything
        checkpoint.lock.acquire()
    except (FingerprintMismatch, ValueError, OutputLocked, StorageError) as exc:
        raise JobError(str(exc)) from None
    except OSError as exc:
        raise JobError(f"cannot create the output directory {manifest.output.path!r}: {exc}") from None
    try:
        job = _Job(manifest, reader, checkpoint, fingerprint, start)
        if shard.count > 1:
            job = _ShardJob(manifest, reader, checkpoint, fingerprint, start)
        return job.run(engine, engine_config, tokenizer, progress, retry_errors)
    except (StorageError, LeaseLost) as exc:  # NOTE: in setup or at the finish; the row loop's are JobAborted
        raise JobAborted(
            f"the output store failed: {exc}; the rows committed so far are kept in "
            f"{manifest.output.path}; rerun the same command to resume"
        ) from exc
    except JobError:
        if created_output:
            _remove_refused_output(checkpoint.output_dir)
        raise
    finally:
        checkpoint.lock.release()


def check_object_store_output(manifest: JobManifest, shard: Shard | None) -> None:
    """Refuse what an object-store output does not support yet: ``--shard`` and ``output.format =
    "openai-batch"`` (their files are written by local-only steps).

    Raises:
        ValueError: naming the setting.
    """
    if not is_uri(manifest.output.path):
        return
    if shard is not None and shard.count > 1 or manifest.input.shard not in (None, "0/1"):
        raise ValueError(
            f"--shard is not supported for an object-store output ({manifest.output.path}) yet; use "
            f"--executor ray to spread one job over machines, or a shared file system"
        )
    if manifest.output.format == "openai-batch":
        raise ValueError(
            f'output.format = "openai-batch" is not supported for an object-store output '
            f"({manifest.output.path}) yet; write the parts, then run cbrun export on a local copy"
        )


def _remove_refused_output(output_dir: Path) -> None:
    """Remove the output directory a run made and then refused in setup (``JobError``: before any generation), so
    that the refusal leaves nothing behind; kept when it holds any committed part."""
    if not committed_parts(output_dir):
        shutil.rmtree(output_dir, ignore_errors=True)


class _Job:
    """One run of a job under the output directory's lock: open the output, run the rows not done, finish."""

    def __init__(
        self, manifest: JobManifest, reader: PromptReader, checkpoint: Checkpoint, fingerprint: dict, start: float
    ):
        self.manifest = manifest
        self.reader = reader
        self.checkpoint = checkpoint
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
        """The output's ``PartWriter``, the directory made ready (``Checkpoint.start``); a stale results file gone."""
        out = self.manifest.output
        writer = self.checkpoint.start(
            self.fingerprint,
            out.commit_every_rows,
            out.commit_every_seconds,
            overwrite=self.clears_at_start(),
            carried_fields=output_carried_fields(self.manifest, self.reader),
        )
        self.write_shards_file()  # again: --overwrite cleared the directory's cbrun files
        remove_stale_results(self.manifest)
        return writer

    def clears_at_start(self) -> bool:
        """Whether the writer's start discards the directory's results (--overwrite; a shard clears in ``open``)."""
        return self.manifest.output.overwrite

    def write_shards_file(self) -> None:
        write_shards_file(self.checkpoint, 1, self.reader.num_rows, [(0, self.reader.num_rows)])

    #: the timeline file's suffix naming this run's share of the job ("": the whole job).
    timeline_part = ""

    def open_timeline(self, engine, engine_config, summary: JobSummary) -> TimelineRecorder | None:
        """This run's timeline recorder (``jobs.observe.timeline``), or None when ``output.timeline_interval_s`` is 0."""
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
            timeline_path(self.checkpoint.cbrun_dir, run, self.timeline_part),
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
        self.checkpoint.write_empty_part_if_none(
            pa.schema([*OUTPUT_SCHEMA, *output_carried_fields(self.manifest, self.reader)])
        )
        write_results_file(self.manifest, tokenizer)
        if self.manifest.output.compact:
            compact_output(self.checkpoint.output_dir, self.manifest.output.target_file_mb, locked=True)
        self.checkpoint.mark_finished(
            self.fingerprint, {**summary.as_dict(), "num_rows_in_output": summary.num_skipped + summary.num_rows}
        )

    def run(self, engine, engine_config, tokenizer, progress: bool, retry_errors: bool) -> JobSummary:
        manifest, checkpoint, overwrite = self.manifest, self.checkpoint, self.manifest.output.overwrite
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
            recorded_in = None if is_uri(self.checkpoint.output_dir) else self.checkpoint.output_dir
            summary.num_repeated_ids = warn_repeated_ids(self.reader, recorded_in, self.fingerprint["input"])
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
        if engine is None:
            engine = load_engine(manifest.model.path, engine_config, expected_requests(manifest, self.reader, done))
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
        """The rows not ``done`` on a Ray Data pool of engine replicas (``jobs.run.ray_executor``); this process only
        writes."""
        from jobs.run.ray_executor import run_on_ray

        out = self.manifest.output
        writer = self.start_writer()
        counter = _JobRun(None, None, writer, summary, 0, 0)
        generation_start = time.perf_counter()
        try:
            with frozen_heap(), JobProgress(int((~done).sum()), None, enabled=progress) as bar:  # as in the local run
                # NOTE: on an object store each replica commits its own parts; the driver only counts their rows
                commit_output = self.checkpoint.output_dir if is_uri(self.checkpoint.output_dir) else None
                on_rows = counter.tally if commit_output else counter.count
                summary.replica_stats = run_on_ray(
                    self.manifest,
                    engine_config,
                    done,
                    writer,
                    lambda rows: (on_rows(rows), bar.row_finished(rows)),
                    commit_output,
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
    """One run of shard I of N (``jobs.run.sharding``): its rows only, under its own lock; the steps that touch the
    whole directory under ``DirectoryLock``; ``_SUCCESS`` only once every shard's rows are committed."""

    def __init__(
        self, manifest: JobManifest, reader: PromptReader, checkpoint: Checkpoint, fingerprint: dict, start: float
    ):
        super().__init__(manifest, reader, checkpoint, fingerprint, start)
        self.shard = checkpoint.lock.shard
        self.ranges = shard_ranges(unit_starts(reader), reader.num_rows, self.shard.count)
        self.within = shard_mask(reader.num_rows, self.ranges[self.shard.index])
        self.timeline_part = f"shard-{self.shard.index}-of-{self.shard.count}"

    def open(self, retry_errors: bool):
        checkpoint, num_rows = self.checkpoint, self.reader.num_rows
        with DirectoryLock(checkpoint.output_dir):
            if self.manifest.output.overwrite:
                old = checkpoint._read_job_file()
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


def _may_sample(manifest: JobManifest, reader) -> bool:
    """Whether any row of the job may be sampled: the job's own settings, a per-row setting column, or an OpenAI
    batch file (each body carries its settings)."""
    return (
        not manifest.sampling.greedy
        or bool(getattr(reader, "setting_of_column", None))
        or isinstance(reader, OpenAIBatchReader)
    )


def write_results_file(manifest: JobManifest, tokenizer=None, only_if_missing: bool = False) -> None:
    """Write ``_results.jsonl`` when ``output.format = "openai-batch"`` (before _SUCCESS: a finished job has it)."""
    from jobs.output.export import RESULTS_FILE, export_openai_batch

    path = Path(manifest.output.path) / RESULTS_FILE
    if manifest.output.format == "openai-batch" and not (only_if_missing and path.is_file()):
        export_openai_batch(manifest.output.path, tokenizer=tokenizer)


def remove_stale_results(manifest: JobManifest) -> None:
    """Remove a ``_results.jsonl`` the run will write again, so that no stale one sits beside new parts."""
    from jobs.output.export import RESULTS_FILE

    if manifest.output.format == "openai-batch":
        (Path(manifest.output.path) / RESULTS_FILE).unlink(missing_ok=True)


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


class _JobRun:
    """The row loop of one run: rows through the job's mode into the engine, outputs back through it to the writer,
    counting as it goes."""

    def __init__(
        self,
        mode: JobMode,
        engine,
        writer: PartWriter,
        summary: JobSummary,
        order_window: int,
        max_in_flight: int,
        timeline: TimelineRecorder | None = None,
    ):
        self.mode = mode
        self.timeline = timeline
        self.engine = engine
        self.writer = writer
        self.summary = summary
        self.order_window = order_window
        self.max_in_flight = max_in_flight
        self.progress: JobProgress | None = None
        self.carried: dict[int, dict[str, Any]] = {}  # row index -> carried column values, until written

    def run(self, reader: PromptReader, done: np.ndarray, progress: bool) -> None:
        stats = self.engine.stats
        self.processed_at_start = stats.num_computed_tokens + stats.num_cached_prompt_tokens
        self.generated_at_start = stats.num_generated_tokens
        timeline = self.timeline
        with JobProgress(int((~done).sum()), self._tokens, enabled=progress) as self.progress:
            self.engine.step_listener = step_listeners(self.progress.on_step, timeline and timeline.on_step)
            try:
                for output in self.engine.generate(self._requests(reader, done), max_in_flight=self.max_in_flight):
                    rows = self.mode.collect(output)
                    if rows is not None:
                        self._finish(rows)
                assert not self.mode.num_in_flight, f"{self.mode.num_in_flight} rows never finished"
            finally:
                # NOTE: rows already finished are committed even when the run is interrupted (Ctrl-C).
                self.engine.step_listener = None
                self.writer.commit()
                if timeline is not None:
                    timeline.close()

    def _tokens(self) -> tuple[int, int]:
        """Tokens processed (prefilled, decoded, prefix-cache hits) and generated since the run's start."""
        stats = self.engine.stats
        return (
            stats.num_computed_tokens + stats.num_cached_prompt_tokens - self.processed_at_start,
            stats.num_generated_tokens - self.generated_at_start,
        )

    def _requests(self, reader: PromptReader, done: np.ndarray):
        """The requests of the rows not done, in prefix-aware order (``input.order_window``), a row's together."""
        work = order_by_prefix(self._row_work(reader, done), key=lambda w: w.prompt_token_ids, window=self.order_window)
        for item in work:
            yield from item.requests

    def _row_work(self, reader: PromptReader, done: np.ndarray):
        """Each good row's requests as a ``RowWork``; bad rows go to the writer as error rows on the spot."""
        for row in reader.iter_rows(done):
            self.carried[row.row_index] = carried_values(row)
            work = self.mode.prepare(row)
            if isinstance(work, OutputRow):
                self.progress.eta.add_error_row()
                self._finish([work])
            else:
                self.progress.eta.add_row(
                    [len(r[1]) for r in work.requests], [r[2].max_new_tokens for r in work.requests]
                )
                yield work

    def _finish(self, rows: list[OutputRow]) -> None:
        """Hand one input row's output rows (its samples) to the writer as one group, and count them."""
        carried = self.carried.pop(rows[0].row_index, {})
        for row in rows:
            row.carried = carried
        self.count(rows)
        self.progress.row_finished(rows)

    def count(self, rows: list[OutputRow]) -> None:
        """Hand one input row's output rows to the writer as one group and add them to the summary."""
        self.writer.add_group(rows)
        self.tally(rows)

    def tally(self, rows: list[OutputRow]) -> None:
        """Add one input row's output rows to the summary (rows a Ray replica committed itself)."""
        summary = self.summary
        summary.num_rows += 1
        summary.num_output_rows += len(rows)
        for row in rows:
            if row.finish_reason == "error":
                summary.num_errors += 1
            else:
                summary.num_prompt_tokens += row.num_prompt_tokens
                summary.num_generated_tokens += row.num_completion_tokens or 0
                if row.candidate_num_tokens is not None:
                    summary.num_candidates += len(row.candidate_num_tokens)
                    summary.num_scored_tokens += sum(row.candidate_num_tokens)
