"""One batch inference job: reader -> mode -> engine.generate -> mode -> writer, with resume, progress and a summary.

``run_job`` checks every resource first (``cbrun.jobs.run.resources``), then takes the output's lock and holds it to the end
(``cbrun.jobs.output.checkpoint``, ``cbrun.jobs.output.lock``). The job owns rows and files; the engine only sees (request_id,
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

This module owns ``run_job``'s setup: the checks of every resource, the fingerprint, the lock, and the cleanup of a
refused run's output. The run under the lock is ``cbrun.jobs.run.locked_run``, its row loop ``cbrun.jobs.run.row_loop``, the
summary it returns ``cbrun.jobs.run.summary``.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path

from cbrun.engine.config import EngineConfig, checkpoint_dtype
from cbrun.jobs.config.manifest import JobManifest
from cbrun.jobs.input.chat import check_chat_template
from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.openai_batch import OpenAIBatchReader
from cbrun.jobs.model.defaults import apply_model_defaults
from cbrun.jobs.model.source import ModelSource, is_hub_id, recorded_commit, resolve_model
from cbrun.jobs.output.checkpoint import Checkpoint, FingerprintMismatch
from cbrun.jobs.output.fingerprint import job_fingerprint
from cbrun.jobs.output.lease import LeaseLost
from cbrun.jobs.output.lock import OutputLocked, Shard
from cbrun.jobs.output.object_output import output_owner
from cbrun.jobs.output.writer import committed_parts
from cbrun.jobs.run.job_setup import open_reader
from cbrun.jobs.run.locked_run import _Job, _ShardJob
from cbrun.jobs.run.resources import JobAborted, JobError, check_model_dir, load_tokenizer, resolve_device
from cbrun.jobs.run.summary import JobSummary
from cbrun.jobs.store import files as storage
from cbrun.jobs.store.files import StorageError, is_uri, read_json

logger = logging.getLogger("cbrun")


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
    storage.configure(manifest.storage.endpoint_url)
    try:
        manifest.check_required()
        check_output_apart_from_input(manifest.input.path, manifest.output.path)
        check_object_store_output(manifest, shard)
        manifest.model.source = resolve_job_model(manifest, progress)
        manifest.model.path = manifest.model.source.local_path
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
    engine_config = _resolve_batch_invariant(engine_config, manifest, reader)
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
    if manifest.cluster.data_parallel_size > 1:  # the cbrun command runs it (cbrun.jobs.run.data_parallel)
        raise JobError(
            f"cluster.data_parallel_size = {manifest.cluster.data_parallel_size}: run_job runs one replica; run the "
            "job with the cbrun command, which starts the replicas, or run each --shard I/N"
        )
    if manifest.cluster.executor == "ray":
        from cbrun.jobs.run.ray_executor import check_ray_installed, replica_resources

        try:
            check_ray_installed()
            replica_resources(manifest.cluster, engine_config)  # a tensor-parallel replica's GPUs
        except (ImportError, ValueError) as exc:
            raise JobError(str(exc)) from None
    if shard is None:
        shard = Shard.parse(manifest.input.shard) if manifest.input.shard is not None else Shard()
    checkpoint = output_owner(manifest.output.path, shard, manifest.storage.endpoint_url)
    try:
        # NOTE: dtype "auto" means bf16 on a GPU and float32 on the CPU: the fingerprint records the one this run uses
        fingerprint = job_fingerprint(
            manifest,
            reader.num_input_rows,
            shard.count,
            engine_dtype=engine_config.resolve_dtype(checkpoint_dtype(manifest.model.path)),
            may_sample=_may_sample(manifest, reader),
            batch_invariant=engine_config.batch_invariant == "on",
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


def resolve_job_model(manifest: JobManifest, progress: bool = True) -> ModelSource:
    """The job's model on this machine (``cbrun.jobs.model.source``): a Hub model at the commit the output's
    recorded job started at when it asked for the same revision (a resume, a later shard), so that one output
    never mixes two commits of a repo whose branch moved on; ``--overwrite`` resolves the revision afresh.

    Raises:
        ModelSourceError: as ``resolve_model`` (a ``ValueError``).
    """
    name, revision = manifest.model.path, manifest.model.revision
    earlier = manifest.model.source
    if earlier is not None and name == earlier.local_path:  # NOTE: a manifest this function resolved before
        name = earlier.name
    pinned = None
    if is_hub_id(name) and not manifest.output.overwrite:
        try:
            recorded = read_json(output_owner(manifest.output.path).job_file)
        except (OSError, ValueError):  # NOTE: an unreadable output is reported by the output's own checks
            recorded = None
        pinned = recorded_commit(recorded, name, revision)
    return resolve_model(name, revision, pinned_commit=pinned, progress=progress)


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


def _may_sample(manifest: JobManifest, reader) -> bool:
    """Whether any row of the job may be sampled: the job's own settings, a per-row setting column, or an OpenAI
    batch file (each body carries its settings)."""
    return (
        not manifest.sampling.greedy
        or bool(getattr(reader, "setting_of_column", None))
        or isinstance(reader, OpenAIBatchReader)
    )


def _resolve_batch_invariant(engine_config: EngineConfig, manifest: JobManifest, reader) -> EngineConfig:
    """``engine.batch_invariant`` for this run: "auto" becomes "on" when a row may be sampled (``_may_sample``)
    and the engine can run it (``backends.batch_invariant_blocker_before_load``), else "off", saying why in the
    log; "on" and "off" stay (the engine refuses an "on" it cannot run, by name)."""
    if engine_config.batch_invariant != "auto":
        return engine_config
    reason = None if _may_sample(manifest, reader) else "no row is sampled (a greedy job)"
    if reason is None:
        from cbrun.engine.worker.backends import batch_invariant_blocker_before_load

        reason = batch_invariant_blocker_before_load(engine_config, manifest.model.path)
    if reason:
        logger.info("batch_invariant off: %s", reason)
        return replace(engine_config, batch_invariant="off")
    logger.info("batch_invariant on: the job's rows are sampled")
    return replace(engine_config, batch_invariant="on")
