"""One batch inference job: reader -> engine.generate -> writer, with resume, progress and a summary.

The job owns rows and files; the engine only sees (request_id, prompt_token_ids, SamplingParams). A row's request
id is ``(row_index, sample_index)``, one request per sample (``sampling.n`` or the row's ``n`` column; score
mode: ``(row_index, candidate index)``, one request per candidate; see ``jobs.scoring``). Rows are submitted in
prefix-aware order over a window of ``input.order_window`` rows, a row's requests back to back (``jobs.ordering``);
a row's samples are written together, in one part, once all are back. Rows the job can tell are bad (null or
empty prompt, prompt too long, bad per-row sampling value) never reach the engine: they go straight to the writer
as error rows, and the job goes on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jobs.carry import carried_fields, carried_values, check_kept_columns, keep_roles
from jobs.chat import check_chat_template, check_messages_column, conversation, encode_chat
from jobs.checkpoint import Checkpoint, FingerprintMismatch, job_fingerprint
from jobs.manifest import PROMPT_SETTINGS_MESSAGE, JobManifest, apply_model_defaults
from jobs.openai_batch import OPENAI_FIELDS, REQUEST_FIELDS, OpenAIBatchReader, input_fields, is_openai_batch_input
from jobs.ordering import RowWork, SampleGroups, order_by_prefix
from jobs.prompts import encode_prompt
from jobs.reader import InputError, InputRow, PromptReader
from jobs.row_ids import warn_repeated_ids
from jobs.scoring import Scorer, check_candidates_column
from jobs.writer import OutputRow, PartWriter, committed_parts


logger = logging.getLogger("cbrun.job")


class JobError(Exception):
    """The job cannot start as configured; the message says what to fix. Raised before any row is generated."""


def derive_seed(job_seed: int, row_id: str, sample_index: int = 0) -> int:
    """A sample's seed: the first 63 bits of sha256(job seed, row id, sample index), independent of batching and
    order. Sample 0 hashes (job seed, row id) alone, so one-sample jobs keep the seeds they always had."""
    key = f"{job_seed}\0{row_id}" if sample_index == 0 else f"{job_seed}\0{row_id}\0{sample_index}"
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def sample_seeds(job_seed: int, row_id: str, num_samples: int, row_seed: int | None = None) -> list[int]:
    """The seeds of a row's samples 0 .. num_samples-1.

    Args:
        row_seed: the row's ``seed`` column, if any: sample 0 takes it as is, and it stands in for the job seed in
            the other samples' derivation (so they differ from sample 0 and from each other).
    """
    if row_seed is None:
        return [derive_seed(job_seed, row_id, i) for i in range(num_samples)]
    return [row_seed] + [derive_seed(row_seed, row_id, i) for i in range(1, num_samples)]


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

    @property
    def generated_tokens_per_s(self) -> float:
        seconds = self.generation_s or self.elapsed_s
        return self.num_generated_tokens / seconds if seconds > 0 else 0.0

    def line(self) -> str:
        """The one summary line the CLI prints."""
        if self.already_finished:
            return (f"cbrun: job already finished: all {self.num_skipped} rows of this input are in {self.output_dir} "
                    f"(see stats.json); nothing to do (use --overwrite to recompute)")
        gpu = "" if self.peak_gpu_memory_mib is None else f" | peak GPU memory {self.peak_gpu_memory_mib:.0f} MiB"
        if self.num_candidates:
            return self._score_line() + f" | peak memory {self.peak_memory_mib:.0f} MiB{gpu}{self._engine_counters()}"
        samples = f" | {self.num_output_rows} samples" if self.num_output_rows != self.num_rows else ""
        if self.num_repeated_ids:
            samples += f" | {self.num_repeated_ids} repeated ids"
        return (f"cbrun: {self.num_rows} rows ({self.num_errors} errors, {self.num_skipped} skipped){samples} | "
                f"{self.num_prompt_tokens} prompt tokens | {self.num_generated_tokens} generated tokens | "
                f"{self.elapsed_s:.1f} s | {self.generated_tokens_per_s:.0f} tokens/s generated | "
                f"peak memory {self.peak_memory_mib:.0f} MiB{gpu}{self._engine_counters()}")

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
        return (f" | prefix cache hit rate {100 * stats['prefix_hit_rate']:.1f}% | {stats['num_offloads']} offloads, "
                f"{stats['num_soft_resets']} soft resets")

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


def check_model_dir(model_path: str) -> None:
    """Raise ``JobError`` unless ``model_path`` looks like a Hugging Face model directory."""
    path = Path(model_path)
    if not (path / "config.json").is_file():
        what = "not found" if not path.exists() else "has no config.json"
        raise JobError(f"model directory {model_path!r} {what}: give a Hugging Face model directory, e.g. one "
                       f"made by `cbrun convert-llama2c CHECKPOINT TOKENIZER OUT_DIR`")


def run_job(manifest: JobManifest, *, progress: bool = True, engine=None) -> JobSummary:
    """Run (or resume, or recognise as finished) the job a manifest describes.

    Args:
        manifest: the job.
        progress: show a tqdm progress bar on stderr.
        engine: an ``LLMEngine`` already loaded from ``manifest.model.path`` (tests reuse one); None loads it.

    Returns:
        The run's ``JobSummary``; also written to the output's stats.json when the job is finished.

    Raises:
        JobError: before any generation, for a missing input/column/model, an unreadable model, or an output
            directory that holds another job.
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
    tokenizer = None
    if manifest.input.chat or isinstance(reader, OpenAIBatchReader):  # NOTE: before any work, model loading too
        tokenizer = load_tokenizer(manifest.model.path)
        try:
            if isinstance(reader, OpenAIBatchReader):
                reader.bind_tokenizer(tokenizer, manifest.model.path)
            else:
                check_chat_template(tokenizer, manifest.model.path)
        except ValueError as exc:
            raise JobError(str(exc)) from None
    checkpoint = Checkpoint(manifest.output.path)
    fingerprint = job_fingerprint(manifest, reader.num_input_rows)
    overwrite = manifest.output.overwrite
    try:
        checkpoint.check(fingerprint, overwrite=overwrite)
    except (FingerprintMismatch, ValueError) as exc:
        raise JobError(str(exc)) from None
    if not overwrite and not checkpoint.job_file.is_file() and committed_parts(checkpoint.output_dir):
        raise JobError(f"output directory {manifest.output.path!r} holds part files but no job.json; rerun with "
                       f"--overwrite to discard them, or choose another --output")
    done = np.zeros(reader.num_rows, dtype=bool) if overwrite else checkpoint.done_rows(reader.num_rows)
    summary = JobSummary(output_dir=str(manifest.output.path), num_skipped=int(done.sum()))
    if isinstance(reader, PromptReader) and manifest.input.id_column is not None:
        summary.num_repeated_ids = warn_repeated_ids(reader)
    if done.all() and not overwrite:
        # NOTE: every row is in the output already; a run killed between its last commit and _SUCCESS is
        # finished here without loading the model.
        if not checkpoint.is_finished():
            checkpoint.prepare(fingerprint)
            write_results_file(manifest)
            checkpoint.mark_finished({**summary.as_dict(), "num_rows_in_output": summary.num_skipped})
        else:
            write_results_file(manifest, only_if_missing=True)  # the job ran without --output-format before
        summary.already_finished = True
        summary.elapsed_s = time.perf_counter() - start
        return summary

    engine = engine if engine is not None else load_engine(manifest, expected_requests(manifest, reader, done))
    if tokenizer is None:
        tokenizer = load_tokenizer(manifest.model.path)
    checkpoint.prepare(fingerprint, overwrite=overwrite)
    checkpoint.clear_finished()
    remove_stale_results(manifest)
    writer = PartWriter(checkpoint.output_dir, manifest.output.commit_every_rows, manifest.output.commit_every_seconds,
                        carried_fields=output_carried_fields(manifest, reader))
    generation_start = time.perf_counter()
    _JobRun(manifest, engine, tokenizer, writer, summary).run(reader, done, progress)
    summary.generation_s = time.perf_counter() - generation_start
    summary.elapsed_s = time.perf_counter() - start
    summary.peak_memory_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    summary.peak_gpu_memory_mib = _peak_gpu_memory_mib(manifest.engine.device)
    summary.engine_stats = engine.stats.as_dict()
    write_results_file(manifest, tokenizer)
    checkpoint.mark_finished({**summary.as_dict(), "num_rows_in_output": summary.num_skipped + summary.num_rows})
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


def load_engine(manifest: JobManifest, expected_requests: int | None = None):
    """``LLMEngine.from_pretrained`` with load failures turned into ``JobError``."""
    from engine import LLMEngine

    try:
        return LLMEngine.from_pretrained(manifest.model.path, config=manifest.engine,
                                         expected_requests=expected_requests)
    except (ValueError, OSError) as exc:
        raise JobError(f"cannot load the model from {manifest.model.path!r}: {exc}") from None


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (ValueError, OSError) as exc:
        raise JobError(f"cannot load the tokenizer from {model_path!r}: {exc}") from None


def _peak_gpu_memory_mib(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def _model_vocab_size(model_path: str) -> int | None:
    config = json.loads((Path(model_path) / "config.json").read_text())
    return config.get("vocab_size")


class _JobRun:
    """The row loop of one run: turns rows into requests, engine outputs into output rows, and counts."""

    def __init__(self, manifest: JobManifest, engine, tokenizer, writer: PartWriter, summary: JobSummary):
        self.manifest = manifest
        self.engine = engine
        self.tokenizer = tokenizer
        self.writer = writer
        self.summary = summary
        self.vocab_size = _model_vocab_size(manifest.model.path)
        self.in_flight = SampleGroups()  # generate mode: rows submitted, and their samples until all are back
        self.scorer = None
        if manifest.input.mode == "score":
            self.scorer = Scorer(tokenizer, engine.max_model_len, self.vocab_size, manifest.input.corruptions)
        self.progress_bar = None
        self.warned_identical_samples = False
        self.carried: dict[int, dict[str, Any]] = {}  # row index -> carried column values, until written

    def run(self, reader: PromptReader, done: np.ndarray, progress: bool) -> None:
        from tqdm import tqdm

        max_in_flight = 4 * self.manifest.engine.max_requests_per_batch
        self.generated_at_start = self.engine.stats.num_generated_tokens
        self.started = time.perf_counter()
        self.last_postfix = 0.0
        # A log file (no terminal) gets a line every 30 s rather than a redraw per row.
        interval = 0.5 if sys.stderr.isatty() else 30.0
        with tqdm(total=int((~done).sum()), unit="row", disable=not progress, desc="cbrun",
                  dynamic_ncols=True, mininterval=interval) as self.progress_bar:
            try:
                for output in self.engine.generate(self._requests(reader, done), max_in_flight=max_in_flight):
                    row = self._collect(output)
                    if row is not None:
                        self._finish(row)
                assert not self.in_flight, f"{len(self.in_flight)} requests never finished"
                assert self.scorer is None or not self.scorer.pending, "scored rows never finished"
            finally:
                # NOTE: rows already finished are committed even when the run is interrupted (Ctrl-C).
                self.writer.commit()

    def _requests(self, reader: PromptReader, done: np.ndarray):
        """The requests of the rows not done, in prefix-aware order (``input.order_window``), a row's together."""
        work = order_by_prefix(self._row_work(reader, done), key=lambda w: w.prompt_token_ids,
                               window=self.manifest.input.order_window)
        for item in work:
            if self.scorer is None:
                self.in_flight.start(item.row_index, item.id, len(item.requests))
            yield from item.requests

    def _row_work(self, reader: PromptReader, done: np.ndarray):
        """Each good row's requests as a ``RowWork``; bad rows go to the writer as error rows on the spot."""
        for row in reader.iter_rows(done):
            self.carried[row.row_index] = carried_values(row)
            if self.scorer is not None:  # score mode: one request per candidate
                requests = self.scorer.requests(row, row.extra.get("candidates_column"))
                if isinstance(requests, OutputRow):
                    self._finish(requests)
                    continue
                yield RowWork(row.row_index, row.id, requests[0][1], list(requests))
                continue
            request = self._prepare(row)
            if isinstance(request, OutputRow):
                self._finish(request)
                continue
            row_index, prompt_token_ids, params = request
            num_samples = row.num_samples or self.manifest.n
            if num_samples > 1 and params.greedy and not self.warned_identical_samples:
                self.warned_identical_samples = True
                logger.warning("row %d (id %r) asks for %d samples with greedy decoding (temperature 0 or top_k 1): "
                               "its samples are identical; set sampling.temperature > 0 for different ones "
                               "(warned once)", row.row_index, row.id, num_samples)
            seeds = sample_seeds(self.manifest.seed, row.id, num_samples, row.sampling_overrides.get("seed"))
            requests = [((row_index, i), prompt_token_ids, params.replace(seed=seed)) for i, seed in enumerate(seeds)]
            yield RowWork(row_index, row.id, prompt_token_ids, requests)

    def _collect(self, output) -> OutputRow | list[OutputRow] | None:
        """The output row(s) a finished request completes: None until the row's last candidate (score mode) or
        sample (generate mode: all the row's samples, by sample index)."""
        if self.scorer is not None:
            return self.scorer.collect(output)
        row_index, _ = output.request_id
        return self.in_flight.add(row_index, self._output_row(self.in_flight.row_id(row_index), output))

    def _encode(self, row: InputRow) -> list[int]:
        """The prompt ids of a text row: the chat template over its conversation, or the plain encoding."""
        inp = self.manifest.input
        if not inp.chat:
            return encode_prompt(self.tokenizer, row.prompt)
        messages = conversation(row.prompt, row.extra.get("messages_column"), inp.messages_column is not None,
                                inp.system_prompt)
        return encode_chat(self.tokenizer, messages)

    def _prepare(self, row: InputRow):
        """(request_id, prompt_token_ids, SamplingParams) for a good row, an error ``OutputRow`` for a bad one."""
        if row.error is not None:
            return _error_row(row.id, row.row_index, row.error)
        where = f"row {row.row_index} (id {row.id!r})"
        prompt_token_ids = row.prompt_token_ids
        if prompt_token_ids is None:
            try:
                prompt_token_ids = self._encode(row)
            except ValueError as exc:
                return _error_row(row.id, row.row_index, f"{where}: {exc}")
        if not prompt_token_ids:
            return _error_row(row.id, row.row_index, f"{where}: the prompt encodes to no tokens")
        max_model_len = self.engine.max_model_len
        if len(prompt_token_ids) >= max_model_len:
            return _error_row(row.id, row.row_index, f"{where}: the prompt has {len(prompt_token_ids)} tokens, but "
                              f"the model's maximum length is {max_model_len} tokens (prompt + completion)",
                              len(prompt_token_ids))
        if self.vocab_size is not None and max(prompt_token_ids) >= self.vocab_size:
            return _error_row(row.id, row.row_index, f"{where}: token id {max(prompt_token_ids)} is out of the "
                              f"model's vocabulary of {self.vocab_size}", len(prompt_token_ids))
        try:
            overrides = {"seed": derive_seed(self.manifest.seed, row.id), **row.sampling_overrides}
            sampling_params = self.manifest.sampling.replace(**overrides)
            sampling_params.validate()
        except ValueError as exc:
            return _error_row(row.id, row.row_index, f"{where}: {exc}", len(prompt_token_ids))
        return row.row_index, prompt_token_ids, sampling_params

    def _output_row(self, row_id: str, output) -> OutputRow:
        row_index, sample_index = output.request_id
        if output.finish_reason == "error":
            message = f"row {row_index} (id {row_id!r}): {output.error}"
            return _error_row(row_id, row_index, message, output.num_prompt_tokens, sample_index)
        ids = list(output.output_token_ids)
        # NOTE: when a stop string ended the request the engine hands back the text cut before it.
        text = output.text if output.text is not None else self.tokenizer.decode(ids, skip_special_tokens=True)
        return OutputRow(
            id=row_id, row_index=row_index, sample_index=sample_index, completion=text, completion_token_ids=ids,
            num_prompt_tokens=output.num_prompt_tokens, num_completion_tokens=len(ids),
            finish_reason=output.finish_reason, logprobs=output.logprobs, prompt_logprobs=output.prompt_logprobs,
            prompt_greedy=output.prompt_greedy,
            stop_reason=None if output.stop_reason is None else str(output.stop_reason),
        )

    def _finish(self, rows: OutputRow | list[OutputRow]) -> None:
        """Hand one input row's output rows (its samples) to the writer as one group, and count them."""
        rows = [rows] if isinstance(rows, OutputRow) else rows
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
            rate = (f"{summary.num_candidates / seconds:.1f} candidates/s" if self.scorer is not None
                    else f"{generated / seconds:.0f} gen tok/s")
            self.progress_bar.set_postfix_str(f"{rate}, {summary.num_errors} errors", refresh=False)


def _error_row(row_id: str, row_index: int, message: str, num_prompt_tokens: int = 0,
               sample_index: int = 0) -> OutputRow:
    """A row that cannot run, or a sample the engine failed; a row that fails before the engine writes one, sample 0."""
    return OutputRow(id=row_id, row_index=row_index, completion=None, completion_token_ids=[],
                     num_prompt_tokens=num_prompt_tokens, num_completion_tokens=0, finish_reason="error",
                     error=message, sample_index=sample_index)
