"""One batch inference job: reader -> mode -> engine.generate -> mode -> writer, with resume, progress and a summary.

``run_job`` checks every resource first (``cbrun.jobs.run.resources``), then takes the output's lock and holds it to the end
(``cbrun.jobs.output.output_dir``, ``cbrun.jobs.output.lock``). The job owns rows and files; the engine only sees (request_id,
prompt_token_ids, SamplingParams). The job's mode (``MODES``: ``cbrun.jobs.modes.generate``, ``cbrun.jobs.modes.scoring``) turns rows into
requests and outputs back into rows: request ids are ``(row_index, sample_index)`` in generate mode, one request
per sample (``sampling.n`` or the row's ``n`` column), ``(row_index, candidate index)`` in score mode. Rows are
submitted in prefix-aware order over a window of ``input.order_window`` rows, a row's requests back to back
(``cbrun.jobs.modes.ordering``); a row's samples are written together, in one part, once all are back. Rows the job can tell
are bad (null or empty prompt, prompt too long, bad per-row sampling value) never reach the engine: they go
straight to the writer as error rows, and the job goes on.

A sharded run (``--shard I/N``, ``_ShardJob``) does the same over its share of the rows (``cbrun.jobs.run.sharding``); with
``cluster.executor = "ray"`` the engine work runs on a Ray Data pool of replicas and this process only writes
(``cbrun.jobs.run.ray_executor``).

This module owns ``run_job``'s order: the job resolved (``cbrun.jobs.run.resolve``: every resource checked, every open
setting settled), its fingerprint, the lock, and the cleanup of a refused run's output. The run under the lock is ``cbrun.jobs.run.locked_run``, its row loop ``cbrun.jobs.run.row_loop``, the
summary it returns ``cbrun.jobs.run.summary``.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from cbrun.jobs.config.manifest import JobManifest
from cbrun.jobs.output.lease import LeaseLost
from cbrun.jobs.output.lock import OutputLocked, Shard
from cbrun.jobs.output.output_dir import FingerprintMismatch
from cbrun.jobs.output.writer import committed_parts
from cbrun.jobs.run.locked_run import _Job, _ShardJob
from cbrun.jobs.run.resolve import ResolvedJob, resolve_job
from cbrun.jobs.run.resources import JobAborted, JobError
from cbrun.jobs.run.summary import JobSummary
from cbrun.jobs.store.files import StorageError

__all__ = ["JobAborted", "JobError", "run_job"]


def run_job(
    manifest: JobManifest, *, progress: bool = True, engine=None, retry_errors: bool = False, shard: Shard | None = None
) -> JobSummary:
    """Run (or resume, or recognise as finished) the job a manifest describes, holding the output's lock throughout.

    Args:
        manifest: the job (never changed: ``cbrun.jobs.run.resolve.resolve_job`` settles its open settings on a copy).
        progress: show a tqdm progress bar on stderr.
        engine: an ``LLMEngine`` already loaded from ``manifest.model.path`` (tests reuse one); None loads it.
        retry_errors: first take the rows that have error rows out of the output, then run them again (each row
            is in the output once afterwards, as before).
        shard: run only this shard of the job (``cbrun.jobs.run.sharding``); None: ``input.shard``, else the whole job.
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
        KeyboardInterrupt: (or ``cbrun.jobs.run.signals.Interrupted``) the run was interrupted; the rows finished before it
            are committed, and ``num_committed_rows`` on the exception counts them.
    """
    start = time.perf_counter()
    job = resolve_job(manifest, shard, progress)
    fingerprint = _fingerprint(job)
    output = job.output
    # NOTE: a refused run leaves no output directory it made (see _remove_refused_output); a shard's may be shared
    created_output = job.shard.count == 1 and output.local_dir is not None and not output.local_dir.exists()
    _take_output(job, fingerprint)
    try:
        run = (_ShardJob if job.shard.count > 1 else _Job)(job, fingerprint, start)
        return run.run(engine, progress, retry_errors)
    except (StorageError, LeaseLost) as exc:  # NOTE: in setup or at the finish; the row loop's are JobAborted
        raise JobAborted(
            f"the output store failed: {exc}; the rows committed so far are kept in "
            f"{job.manifest.output.path}; rerun the same command to resume"
        ) from exc
    except JobError:
        if created_output:
            _remove_refused_output(output.output_dir)
        raise
    finally:
        output.lock.release()


def _fingerprint(job: ResolvedJob) -> dict:
    """``job.fingerprint()``, an input object that cannot be read a ``JobError``."""
    try:
        return job.fingerprint()
    except StorageError as exc:
        raise JobError(str(exc)) from None


def _take_output(job: ResolvedJob, fingerprint: dict) -> None:
    """Check that the output may take this job (before creating anything), then take its lock (or lease).

    Raises:
        JobError: the output holds another job, is not a directory, cannot be created, or another run holds it.
    """
    try:
        job.output.check(fingerprint, overwrite=job.manifest.output.overwrite)
        job.output.lock.acquire()
    except (FingerprintMismatch, ValueError, OutputLocked, StorageError) as exc:
        raise JobError(str(exc)) from None
    except OSError as exc:
        raise JobError(f"cannot create the output directory {job.manifest.output.path!r}: {exc}") from None


def _remove_refused_output(output_dir: Path) -> None:
    """Remove the output directory a run made and then refused in setup (``JobError``: before any generation), so
    that the refusal leaves nothing behind; kept when it holds any committed part."""
    if not committed_parts(output_dir):
        shutil.rmtree(output_dir, ignore_errors=True)
