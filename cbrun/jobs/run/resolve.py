"""A job as it runs: ``resolve_job(manifest) -> ResolvedJob``, built once, before the fingerprint.

Everything a manifest leaves open is settled here, in one place and in this order: the model found on this machine
(a Hub id at the commit an earlier run of the output recorded, a URI copied into the cache), the sampling settings
the model's generation_config.json gives where the job is silent, the device ("auto" resolved), the dtype the
engine runs in, ``engine.batch_invariant``, the shard and the output's owner over its store. The caller's manifest
is never changed: the ``ResolvedJob`` holds a resolved copy (``manifest``), and everything after it (the
fingerprint, the lock, the run, the Ray replicas) reads that copy.

Every check that needs no engine runs here too, so that a bad job is refused (``JobError``, exit 2) before any work.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from cbrun.engine.config import EngineConfig, checkpoint_dtype
from cbrun.jobs.config.manifest import JobManifest
from cbrun.jobs.input.chat import check_chat_template
from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.openai_batch import OpenAIBatchReader
from cbrun.jobs.input.reader import PromptReader
from cbrun.jobs.model.defaults import model_sampling_defaults
from cbrun.jobs.model.source import ModelSource, is_hub_id, recorded_commit, resolve_model
from cbrun.jobs.output.fingerprint import job_fingerprint
from cbrun.jobs.output.lock import Shard
from cbrun.jobs.output.output_dir import OutputDir, open_output
from cbrun.jobs.run.resources import (
    JobError,
    check_model_dir,
    load_tokenizer,
    open_reader,
    output_carried_fields,
    resolve_device,
)
from cbrun.jobs.store.files import StorageError, is_uri

logger = logging.getLogger("cbrun")

#: What a setup step may raise for a bad job; ``resolve_job`` reports each as a ``JobError``.
SETUP_ERRORS = (InputError, ValueError, ImportError, FileNotFoundError, StorageError)


@dataclass(frozen=True)
class ResolvedJob:
    """One job with every open setting settled (``resolve_job``); read, never changed, by everything after.

    Attributes:
        manifest: the job's settings as they run: a copy of the given manifest with ``model.path`` the model's
            folder on this machine, the model's sampling defaults applied, and ``engine`` resolved (device,
            ``batch_invariant``).
        model: where the model came from (``cbrun.jobs.model.source.ModelSource``: name, revision, commit).
        dtype: the dtype the engine runs in ("auto" resolved for the device; recorded in the fingerprint).
        shard: this run's share of the rows (``Shard()``: all of them).
        output: the owner of the output (``OutputDir``), over the output's store.
        reader: the job's rows (``PromptReader``) or OpenAI batch requests (``OpenAIBatchReader``).
        tokenizer: the model's tokenizer.
        may_sample: whether any row may be sampled (the job's settings, a per-row setting column, or an OpenAI
            batch file, whose bodies carry their settings).
        sampling_defaults: the settings taken from the model's generation_config.json ({} when none).
        carried_fields: the Arrow fields the output rows carry beyond ``OUTPUT_SCHEMA`` (the kept columns,
            ``cbrun.jobs.run.resources.output_carried_fields``).
    """

    manifest: JobManifest
    model: ModelSource
    dtype: str
    shard: Shard
    output: OutputDir
    reader: PromptReader | OpenAIBatchReader
    tokenizer: Any
    may_sample: bool
    sampling_defaults: dict[str, Any]
    carried_fields: list[pa.Field]

    @property
    def engine(self) -> EngineConfig:
        """The engine's settings as they run (device and ``batch_invariant`` resolved)."""
        return self.manifest.engine

    def fingerprint(self) -> dict[str, Any]:
        """The job's fingerprint (``cbrun.jobs.output.fingerprint.job_fingerprint``) from the resolved values.

        Raises:
            StorageError: an input object could not be read.
        """
        return job_fingerprint(
            self.manifest,
            self.reader.num_input_rows,
            self.shard.count,
            engine_dtype=self.dtype,
            may_sample=self.may_sample,
            batch_invariant=self.engine.batch_invariant == "on",
            model_source=self.model,
        )


def resolve_job(manifest: JobManifest, shard: Shard | None = None, progress: bool = True) -> ResolvedJob:
    """Check a job's resources and settle its open settings (see the module's docstring).

    Args:
        manifest: the job as given; never changed.
        shard: this run's shard; None: ``input.shard``, else the whole job.
        progress: show the download of a Hub model.

    Raises:
        JobError: for a missing or unusable resource (input, column, model, tokenizer, device, output path) or a
            setting this run cannot serve, naming it.
    """
    try:
        manifest.check_required()
        run_shard = shard or (Shard.parse(manifest.input.shard) if manifest.input.shard is not None else Shard())
        # NOTE: the output's path is classified here, once: its owner knows its store from now on
        output = open_output(manifest.output.path, run_shard, manifest.storage.endpoint_url)
        check_output_apart_from_input(manifest.input.path, output)
        check_object_store_output(manifest, output, shard)
        model = resolve_job_model(manifest, output, progress)
        manifest = replace(manifest, model=replace(manifest.model, path=model.local_path))
        reader = open_reader(manifest, model)
    except SETUP_ERRORS as exc:
        raise JobError(str(exc)) from None
    check_model_dirs(manifest)
    manifest, taken = _with_model_defaults(manifest)
    may_sample = _may_sample(manifest, reader)
    engine = replace(manifest.engine, device=resolve_device(manifest.engine.device))
    # NOTE: dtype "auto" means bf16 on a GPU and float32 on the CPU: decided once, here, for the batch-invariance
    # check and the fingerprint (which records the one this run uses)
    dtype = engine.resolve_dtype(checkpoint_dtype(manifest.model.path))
    manifest = replace(manifest, engine=resolve_batch_invariant(engine, manifest.model.path, may_sample, dtype))
    # NOTE: checked before any work, loading the model included
    tokenizer = load_tokenizer(manifest.model.path, loader=manifest.engine.loader)
    _check_prompt_formatting(manifest, reader, tokenizer)
    _check_cluster(manifest)
    return ResolvedJob(
        manifest=manifest,
        model=model,
        dtype=dtype,
        shard=run_shard,
        output=output,
        reader=reader,
        tokenizer=tokenizer,
        may_sample=may_sample,
        sampling_defaults=taken,
        carried_fields=output_carried_fields(manifest.output.keep_columns, reader),
    )


def check_output_apart_from_input(input_path: str | Path, output: OutputDir) -> None:
    """Refuse an output directory that is the input, lies inside an input directory, or holds the input: the
    output's parts would be read back as input by the next run (or ``--overwrite`` would delete the input).

    Raises:
        InputError: naming both paths.
    """
    output_path = output.output_dir
    if is_uri(input_path) or output.local_dir is None:
        inp, out = str(input_path).rstrip("/"), str(output_path).rstrip("/")
        if out == inp or out.startswith(inp + "/") or inp.startswith(out + "/"):
            raise InputError(
                f"output {str(output_path)!r} overlaps the input {str(input_path)!r}: its part files "
                f"would be read back as input; give an --output outside the input"
            )
        return
    inp_dir, out_dir = Path(input_path).resolve(), Path(output_path).resolve()
    if out_dir == inp_dir:
        where = "is the input"
    elif inp_dir.is_dir() and out_dir.is_relative_to(inp_dir):
        where = "is inside the input directory"
    elif inp_dir.is_relative_to(out_dir):
        where = "holds the input"
    else:
        return
    raise InputError(
        f"output directory {str(output_path)!r} {where} {str(input_path)!r}: its part files would be "
        f"read back as input; give an --output outside the input"
    )


def check_object_store_output(manifest: JobManifest, output: OutputDir, shard: Shard | None) -> None:
    """Refuse what an object-store output does not support yet: ``--shard`` and ``output.format =
    "openai-batch"`` (their files are written by local-only steps).

    Raises:
        ValueError: naming the setting.
    """
    if output.local_dir is not None:
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


def resolve_job_model(manifest: JobManifest, output: OutputDir, progress: bool = True) -> ModelSource:
    """The job's model on this machine (``cbrun.jobs.model.source``): a Hub model at the commit the output's
    recorded job started at when it asked for the same revision (a resume, a later shard), so that one output
    never mixes two commits of a repo whose branch moved on; ``--overwrite`` resolves the revision afresh.

    Raises:
        ModelSourceError: as ``resolve_model`` (a ``ValueError``).
    """
    name, revision = manifest.model.path, manifest.model.revision
    pinned = None
    if is_hub_id(name) and not manifest.output.overwrite:
        try:
            recorded = output.read_job_file()
        except (OSError, ValueError):  # NOTE: an unreadable output is reported by the output's own checks
            recorded = None
        pinned = recorded_commit(recorded, name, revision)
    return resolve_model(
        name, revision, pinned_commit=pinned, progress=progress, endpoint_url=manifest.storage.endpoint_url
    )


def check_model_dirs(manifest: JobManifest) -> None:
    """The model's folder and, with ``engine.speculative = "draft"``, the draft model's (``check_model_dir``)."""
    check_model_dir(manifest.model.path)
    if manifest.engine.speculative == "draft":
        try:
            check_model_dir(str(manifest.engine.draft_model))
        except JobError as exc:
            raise JobError(f"engine.draft_model: {exc}") from None


def _with_model_defaults(manifest: JobManifest) -> tuple[JobManifest, dict[str, Any]]:
    """``manifest`` with the model's sampling defaults (``cbrun.jobs.model.defaults``) where the job is silent."""
    try:
        sampling, taken = model_sampling_defaults(manifest)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    return (replace(manifest, sampling=sampling) if taken else manifest), taken


def _may_sample(manifest: JobManifest, reader: PromptReader | OpenAIBatchReader) -> bool:
    """Whether any row of the job may be sampled: the job's own settings, a per-row column of one of the two
    settings that decide greedy (``SamplingParams.greedy``: temperature and top_k), or an OpenAI batch file (each
    body carries its settings)."""
    per_row = set(getattr(reader, "setting_of_column", {}).values())
    return (
        not manifest.sampling.greedy
        or bool(per_row & {"temperature", "top_k"})
        or isinstance(reader, OpenAIBatchReader)
    )


def resolve_batch_invariant(engine_config: EngineConfig, model_path: str, may_sample: bool, dtype: str) -> EngineConfig:
    """``engine.batch_invariant`` for this run: "auto" becomes "on" when a row may be sampled and the engine can
    run it in ``dtype`` (``backends.batch_invariant_blocker_before_load``), else "off", saying why in the log; "on"
    and "off" stay (the engine refuses an "on" it cannot run, by name)."""
    if engine_config.batch_invariant != "auto":
        return engine_config
    reason = None if may_sample else "no row is sampled (a greedy job)"
    if reason is None:
        from cbrun.engine.worker.backends import batch_invariant_blocker_before_load

        reason = batch_invariant_blocker_before_load(engine_config, model_path, dtype)
    if reason:
        logger.info("batch_invariant off: %s", reason)
        return replace(engine_config, batch_invariant="off")
    logger.info("batch_invariant on: the job's rows may be sampled")
    return replace(engine_config, batch_invariant="on")


def _check_prompt_formatting(manifest: JobManifest, reader, tokenizer) -> None:
    """Chat rows need the tokenizer's chat template; OpenAI batch requests take the tokenizer for their prompts."""
    try:
        if isinstance(reader, OpenAIBatchReader):
            reader.bind_tokenizer(tokenizer, manifest.model.path)
        elif manifest.input.chat:
            check_chat_template(tokenizer, manifest.model.path)
    except ValueError as exc:
        raise JobError(str(exc)) from None


def _check_cluster(manifest: JobManifest) -> None:
    """Refuse a data-parallel job (the ``cbrun`` command starts its replicas) and a Ray job Ray cannot serve."""
    cluster = manifest.cluster
    if cluster.data_parallel_size > 1:  # the cbrun command runs it (cbrun.jobs.run.data_parallel)
        raise JobError(
            f"cluster.data_parallel_size = {cluster.data_parallel_size}: run_job runs one replica; run the "
            "job with the cbrun command, which starts the replicas, or run each --shard I/N"
        )
    if cluster.executor == "ray":
        from cbrun.jobs.run.ray_executor import check_ray_installed, replica_resources

        try:
            check_ray_installed()
            replica_resources(cluster, manifest.engine)  # a tensor-parallel replica's GPUs
        except (ImportError, ValueError) as exc:
            raise JobError(str(exc)) from None
