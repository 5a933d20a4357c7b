"""One batch inference job: reader -> mode -> engine.generate -> mode -> writer, with resume, progress and a summary.

``run_job`` checks every resource first (``jobs.resources``), then takes the output's lock and holds it to the end
(``jobs.checkpoint``, ``jobs.lock``). The job owns rows and files; the engine only sees (request_id,
prompt_token_ids, SamplingParams). The job's mode (``MODES``: ``jobs.generate``, ``jobs.scoring``) turns rows into
requests and outputs back into rows: request ids are ``(row_index, sample_index)`` in generate mode, one request
per sample (``sampling.n`` or the row's ``n`` column), ``(row_index, candidate index)`` in score mode. Rows are
submitted in prefix-aware order over a window of ``input.order_window`` rows, a row's requests back to back
(``jobs.ordering``); a row's samples are written together, in one part, once all are back. Rows the job can tell
are bad (null or empty prompt, prompt too long, bad per-row sampling value) never reach the engine: they go
straight to the writer as error rows, and the job goes on.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from jobs.carry import carried_fields, carried_values, check_kept_columns, keep_roles
from jobs.chat import check_chat_template, check_messages_column
from jobs.checkpoint import Checkpoint, FingerprintMismatch
from jobs.fingerprint import job_fingerprint
from jobs.generate import GenerateMode
from jobs.lock import OutputLocked
from jobs.manifest import PROMPT_SETTINGS_MESSAGE, JobManifest, apply_model_defaults
from jobs.mode import JobMode
from jobs.openai_batch import OPENAI_FIELDS, REQUEST_FIELDS, OpenAIBatchReader, input_fields, is_openai_batch_input
from jobs.ordering import order_by_prefix
from jobs.reader import InputError, PromptReader
from jobs.resources import JobAborted, JobError, check_model_dir, load_engine, load_tokenizer, resolve_device
from jobs.row_ids import warn_repeated_ids
from jobs.scoring import Scorer, check_candidates_column
from jobs.writer import OutputRow, PartWriter


def _score_mode(manifest: JobManifest, tokenizer, max_model_len: int, vocab_size: int | None) -> Scorer:
    return Scorer(tokenizer, max_model_len, vocab_size, manifest.input.corruptions)


#: ``input.mode`` -> the factory of its ``JobMode``: ``(manifest, tokenizer, max_model_len, vocab_size) -> mode``.
#: A new mode registers here (and its name in ``InputSettings.mode``'s check).
MODES = {"generate": GenerateMode, "score": _score_mode}


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
        num_repeated_ids: distinct ``id_column`` values that more than one input row holds (see ``jobs.row_ids``).
        engine_stats: ``LLMEngine.stats.as_dict()`` at the end.
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
    num_repeated_ids: int = 0
    engine_stats: dict[str, Any] = field(default_factory=dict)
    total_output_rows: int = 0
    total_error_rows: int = 0
    max_error_fraction: float = 1.0

    @property
    def too_many_errors(self) -> bool:
        """More error rows than ``max_error_fraction`` of the output allows; an output of error rows alone always."""
        total, errors = self.total_output_rows, self.total_error_rows
        return total > 0 and (errors == total or errors > self.max_error_fraction * total)

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
        if self.already_finished:
            return (f"cbrun: job already finished: all {self.num_skipped} rows of this input are in {self.output_dir} "
                    f"(see _cbrun/stats.json); nothing to do (use --overwrite to recompute)"
                    f"{self._errors()}")
        gpu = "" if self.peak_gpu_memory_mib is None else f" | peak GPU memory {self.peak_gpu_memory_mib:.0f} MiB"
        if self.num_candidates:
            return (self._score_line() + f" | peak memory {self.peak_memory_mib:.0f} MiB{gpu}"
                    f"{self._engine_counters()}{self._errors()}")
        samples = f" | {self.num_output_rows} samples" if self.num_output_rows != self.num_rows else ""
        if self.num_repeated_ids:
            samples += f" | {self.num_repeated_ids} repeated ids"
        return (f"cbrun: {self.num_rows} rows ({self.num_errors} errors, {self.num_skipped} skipped){samples} | "
                f"{self.num_prompt_tokens} prompt tokens | {self.num_generated_tokens} generated tokens | "
                f"{self.elapsed_s:.1f} s | {self.generated_tokens_per_s:.0f} tokens/s generated | "
                f"peak memory {self.peak_memory_mib:.0f} MiB{gpu}{self._engine_counters()}{self._errors()}")

    def _errors(self) -> str:
        """Where the error rows are, when there are any; what exit code 3 means, when it applies."""
        if not self.total_error_rows:
            return ""
        where = (f"{self.total_error_rows} of {self.total_output_rows} output rows in {self.output_dir} are error "
                 f"rows (finish_reason = 'error'; their error column says why; rerun them with --retry-errors)")
        if self.too_many_errors:
            return (f"\ncbrun: too many errors (exit code 3): {where}, above output.max_error_fraction = "
                    f"{self.max_error_fraction:g}")
        return f"\ncbrun: {where}"

    def _score_line(self) -> str:
        """Score mode's throughput: candidates/s, and tokens/s over context + candidate tokens."""
        seconds = max(self.generation_s or self.elapsed_s, 1e-9)
        return (f"cbrun: {self.num_rows} rows ({self.num_errors} errors, {self.num_skipped} skipped) | "
                f"{self.num_candidates} candidates | {self.num_prompt_tokens} context tokens | "
                f"{self.num_scored_tokens} candidate tokens | {self.elapsed_s:.1f} s | "
                f"{self.num_candidates / seconds:.1f} candidates/s, "
                f"{(self.num_prompt_tokens + self.num_scored_tokens) / seconds:.0f} tokens/s scored")

    def _engine_counters(self) -> str:
        stats = self.engine_stats
        if not stats:
            return ""
        line = (f" | prefix cache hit rate {100 * stats['prefix_hit_rate']:.1f}% | {stats['num_offloads']} offloads, "
                f"{stats['num_soft_resets']} soft resets")
        if stats.get("num_verify_steps"):  # speculative decoding ran
            line += (f" | speculative: {100 * stats['acceptance_rate']:.1f}% of {stats['num_proposed_tokens']} "
                     f"proposals accepted, {stats['mean_tokens_per_verify_step']:.2f} tokens per verify step")
        return line

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "generated_tokens_per_s": self.generated_tokens_per_s}


def open_reader(manifest: JobManifest) -> PromptReader | OpenAIBatchReader:
    """The job's reader: OpenAI batch requests (``jobs.openai_batch``) or rows, reading the kept columns too.

    Raises:
        InputError: for a missing input, column or prompt setting, a kept column that clashes, repeated custom_ids.
    """
    inp = manifest.input
    keep = manifest.output.keep_columns
    if is_openai_batch_input(inp):
        if inp.format == "auto" and not set(REQUEST_FIELDS) <= set(input_fields(inp.path)):
            raise InputError(PROMPT_SETTINGS_MESSAGE)
        return OpenAIBatchReader(inp.path, limit=inp.limit, batch_size=inp.batch_size, keep_columns=keep,
                                 default_model=Path(manifest.model.path).name)
    extra_columns = {role: getattr(inp, role) for role in ("candidates_column", "messages_column")
                     if getattr(inp, role) is not None}
    reader = PromptReader(inp.path, prompt_column=inp.prompt_column, prompt_ids_column=inp.prompt_ids_column,
                          id_column=inp.id_column, template=inp.template, limit=inp.limit, batch_size=inp.batch_size,
                          extra_columns=extra_columns,
                          per_row_settings=inp.per_row_settings and inp.mode == "generate")
    if inp.candidates_column is not None:
        check_candidates_column(reader.schema, inp.candidates_column, inp.path)
    if inp.messages_column is not None:
        check_messages_column(reader.schema, inp.messages_column, inp.path)
    check_kept_columns(keep, reader.column_names)
    reader.add_extra_columns(keep_roles(keep))
    return reader


def output_carried_fields(manifest: JobManifest, reader: PromptReader | OpenAIBatchReader) -> list:
    """The Arrow fields the job's output rows carry beyond ``OUTPUT_SCHEMA`` (``jobs.carry``)."""
    derived = OPENAI_FIELDS if isinstance(reader, OpenAIBatchReader) else []
    return carried_fields(manifest.output.keep_columns, reader.schema, derived)


def run_job(manifest: JobManifest, *, progress: bool = True, engine=None, retry_errors: bool = False) -> JobSummary:
    """Run (or resume, or recognise as finished) the job a manifest describes, holding the output's lock throughout.

    Args:
        manifest: the job.
        progress: show a tqdm progress bar on stderr.
        engine: an ``LLMEngine`` already loaded from ``manifest.model.path`` (tests reuse one); None loads it.
        retry_errors: first take the rows that have error rows out of the output, then run them again (each row
            is in the output once afterwards, as before).

    Returns:
        The run's ``JobSummary`` (its ``exit_code`` says whether the error rows are within
        ``output.max_error_fraction``); also written to the output's ``_cbrun/stats.json`` when the job is finished.

    Raises:
        JobError: before any generation, for a missing or unusable resource (input, column, model, tokenizer,
            device, output directory), an output directory that holds another job, or one another run holds.
        JobAborted: generation stopped on a fault that is not one row's (e.g. out of memory, a device error); the
            rows finished before it are committed.
        KeyboardInterrupt: (or ``jobs.signals.Interrupted``) the run was interrupted; the rows finished before it
            are committed, and ``num_committed_rows`` on the exception counts them.
    """
    start = time.perf_counter()
    try:
        manifest.check_required()
        reader = open_reader(manifest)
    except (InputError, ValueError) as exc:
        raise JobError(str(exc)) from None
    check_model_dir(manifest.model.path)
    try:
        apply_model_defaults(manifest)  # NOTE: before the fingerprint, which records the settings used
    except ValueError as exc:
        raise JobError(str(exc)) from None
    engine_config = replace(manifest.engine, device=resolve_device(manifest.engine.device))
    tokenizer = load_tokenizer(manifest.model.path)  # NOTE: checked before any work, loading the model included
    if manifest.input.chat or isinstance(reader, OpenAIBatchReader):
        try:
            if isinstance(reader, OpenAIBatchReader):
                reader.bind_tokenizer(tokenizer, manifest.model.path)
            else:
                check_chat_template(tokenizer, manifest.model.path)
        except ValueError as exc:
            raise JobError(str(exc)) from None
    checkpoint = Checkpoint(manifest.output.path)
    fingerprint = job_fingerprint(manifest, reader.num_input_rows)
    try:
        checkpoint.check(fingerprint, overwrite=manifest.output.overwrite)  # before creating anything
        checkpoint.lock.acquire()
    except (FingerprintMismatch, ValueError, OutputLocked) as exc:
        raise JobError(str(exc)) from None
    except OSError as exc:
        raise JobError(f"cannot create the output directory {manifest.output.path!r}: {exc}") from None
    try:
        job = _Job(manifest, reader, checkpoint, fingerprint, start)
        return job.run(engine, engine_config, tokenizer, progress, retry_errors)
    finally:
        checkpoint.lock.release()


class _Job:
    """One run of a job under the output directory's lock: open the output, run the rows not done, finish."""

    def __init__(self, manifest: JobManifest, reader: PromptReader, checkpoint: Checkpoint, fingerprint: dict,
                 start: float):
        self.manifest = manifest
        self.reader = reader
        self.checkpoint = checkpoint
        self.fingerprint = fingerprint
        self.start = start

    def run(self, engine, engine_config, tokenizer, progress: bool, retry_errors: bool) -> JobSummary:
        manifest, checkpoint, overwrite = self.manifest, self.checkpoint, self.manifest.output.overwrite
        try:
            state = checkpoint.open(self.fingerprint, self.reader.num_rows, overwrite=overwrite,
                                    retry_errors=retry_errors)
        except ValueError as exc:  # FingerprintMismatch included
            raise JobError(str(exc)) from None
        summary = JobSummary(output_dir=str(manifest.output.path), num_skipped=int(state.done.sum()),
                             total_output_rows=state.num_output_rows, total_error_rows=state.num_error_rows,
                             max_error_fraction=manifest.output.max_error_fraction)
        if isinstance(self.reader, PromptReader) and manifest.input.id_column is not None:
            summary.num_repeated_ids = warn_repeated_ids(self.reader)
        if state.done.all() and not overwrite:
            # NOTE: every row is in the output already; a run killed between its last commit and _SUCCESS is
            # finished here without loading the model.
            if not checkpoint.is_finished():
                checkpoint.prepare(self.fingerprint)
                write_results_file(manifest)
                checkpoint.mark_finished(self.fingerprint, {**summary.as_dict(),
                                                            "num_rows_in_output": summary.num_skipped})
            else:
                write_results_file(manifest, only_if_missing=True)  # the job ran without --output-format before
            summary.already_finished = True
            summary.elapsed_s = time.perf_counter() - self.start
            return summary

        if engine is None:
            engine = load_engine(manifest.model.path, engine_config,
                                 expected_requests(manifest, self.reader, state.done))
        out = manifest.output
        writer = checkpoint.start(self.fingerprint, out.commit_every_rows, out.commit_every_seconds,
                                  overwrite=overwrite, carried_fields=output_carried_fields(manifest, self.reader))
        remove_stale_results(manifest)
        mode = MODES[manifest.input.mode](manifest, tokenizer, engine.max_model_len,
                                          _model_vocab_size(manifest.model.path))
        generation_start = time.perf_counter()
        max_in_flight = 4 * engine_config.max_requests_per_batch
        try:
            _JobRun(mode, engine, writer, summary, manifest.input.order_window, max_in_flight).run(
                self.reader, state.done, progress)
        except KeyboardInterrupt as exc:  # jobs.signals.Interrupted (SIGINT, SIGTERM) included
            exc.num_committed_rows = writer.num_committed_rows
            raise
        except Exception as exc:
            raise JobAborted(
                f"the job stopped on a fault that is not one row's: {type(exc).__name__}: {exc}; the "
                f"{writer.num_committed_rows} output rows this run finished are committed in {out.path}; rerun the "
                f"same command to resume") from exc
        summary.generation_s = time.perf_counter() - generation_start
        summary.elapsed_s = time.perf_counter() - self.start
        summary.peak_memory_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        summary.peak_gpu_memory_mib = _peak_gpu_memory_mib(engine_config.device)
        summary.engine_stats = engine.stats.as_dict()
        summary.total_output_rows += summary.num_output_rows
        summary.total_error_rows += summary.num_errors
        write_results_file(manifest, tokenizer)
        checkpoint.mark_finished(self.fingerprint, {**summary.as_dict(),
                                                    "num_rows_in_output": summary.num_skipped + summary.num_rows})
        return summary


def write_results_file(manifest: JobManifest, tokenizer=None, only_if_missing: bool = False) -> None:
    """Write ``results.jsonl`` when ``output.format = "openai-batch"`` (before _SUCCESS: a finished job has it)."""
    from jobs.export import RESULTS_FILE, export_openai_batch

    path = Path(manifest.output.path) / RESULTS_FILE
    if manifest.output.format == "openai-batch" and not (only_if_missing and path.is_file()):
        export_openai_batch(manifest.output.path, tokenizer=tokenizer)


def remove_stale_results(manifest: JobManifest) -> None:
    """Remove a ``results.jsonl`` the run will write again, so that no stale one sits beside new parts."""
    from jobs.export import RESULTS_FILE

    if manifest.output.format == "openai-batch":
        (Path(manifest.output.path) / RESULTS_FILE).unlink(missing_ok=True)


def expected_requests(manifest: JobManifest, reader, done: np.ndarray) -> int | None:
    """Requests this run will add to the engine: rows to do times ``n``; None when a row can add more than that
    (score mode's candidates, a per-row ``n`` column or OpenAI request body). Lets the engine size its default
    cache to the job."""
    if (manifest.input.mode == "score" or not isinstance(reader, PromptReader)
            or reader.samples_column is not None):
        return None
    return int((~done).sum()) * manifest.n


def _peak_gpu_memory_mib(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def _model_vocab_size(model_path: str) -> int | None:
    config = json.loads((Path(model_path) / "config.json").read_text())
    return config.get("vocab_size")


class _JobRun:
    """The row loop of one run: rows through the job's mode into the engine, outputs back through it to the writer,
    counting as it goes."""

    def __init__(self, mode: JobMode, engine, writer: PartWriter, summary: JobSummary, order_window: int,
                 max_in_flight: int):
        self.mode = mode
        self.engine = engine
        self.writer = writer
        self.summary = summary
        self.order_window = order_window
        self.max_in_flight = max_in_flight
        self.progress_bar = None
        self.carried: dict[int, dict[str, Any]] = {}  # row index -> carried column values, until written

    def run(self, reader: PromptReader, done: np.ndarray, progress: bool) -> None:
        from tqdm import tqdm

        self.generated_at_start = self.engine.stats.num_generated_tokens
        self.started = time.perf_counter()
        self.last_postfix = 0.0
        # A log file (no terminal) gets a line every 30 s rather than a redraw per row.
        interval = 0.5 if sys.stderr.isatty() else 30.0
        with tqdm(total=int((~done).sum()), unit="row", disable=not progress, desc="cbrun",
                  dynamic_ncols=True, mininterval=interval) as self.progress_bar:
            try:
                for output in self.engine.generate(self._requests(reader, done), max_in_flight=self.max_in_flight):
                    rows = self.mode.collect(output)
                    if rows is not None:
                        self._finish(rows)
                assert not self.mode.num_in_flight, f"{self.mode.num_in_flight} rows never finished"
            finally:
                # NOTE: rows already finished are committed even when the run is interrupted (Ctrl-C).
                self.writer.commit()

    def _requests(self, reader: PromptReader, done: np.ndarray):
        """The requests of the rows not done, in prefix-aware order (``input.order_window``), a row's together."""
        work = order_by_prefix(self._row_work(reader, done), key=lambda w: w.prompt_token_ids,
                               window=self.order_window)
        for item in work:
            yield from item.requests

    def _row_work(self, reader: PromptReader, done: np.ndarray):
        """Each good row's requests as a ``RowWork``; bad rows go to the writer as error rows on the spot."""
        for row in reader.iter_rows(done):
            self.carried[row.row_index] = carried_values(row)
            work = self.mode.prepare(row)
            if isinstance(work, OutputRow):
                self._finish([work])
            else:
                yield work

    def _finish(self, rows: list[OutputRow]) -> None:
        """Hand one input row's output rows (its samples) to the writer as one group, and count them."""
        carried = self.carried.pop(rows[0].row_index, {})
        for row in rows:
            row.carried = carried
        self.writer.add_group(rows)
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
        self.progress_bar.update(1)
        now = time.perf_counter()
        if now - self.last_postfix >= 0.5:
            self.last_postfix = now
            seconds = max(now - self.started, 1e-9)
            generated = self.engine.stats.num_generated_tokens - self.generated_at_start
            rate = (f"{summary.num_candidates / seconds:.1f} candidates/s" if summary.num_candidates
                    else f"{generated / seconds:.0f} gen tok/s")
            self.progress_bar.set_postfix_str(f"{rate}, {summary.num_errors} errors", refresh=False)

