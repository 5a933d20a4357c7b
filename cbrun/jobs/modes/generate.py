"""Generate mode: a completion (or ``n`` sampled completions) per row; the twin of ``cbrun.jobs.modes.scoring``.

A row's prompt is its token ids as given (``input.prompt_ids_column``), the chat template over its conversation
(``input.chat``) or its text encoded with the tokenizer's special tokens. Its settings are the job's ``[sampling]``
with the row's per-row columns over them, validated here, so a bad value is that row's error row. Sample ``i`` of a
row is request ``(row_index, i)`` with its own seed (``sample_seeds``); the samples go back to the writer together.
"""

from __future__ import annotations

import hashlib
import logging

from cbrun.engine.structured_output import StructuredOutputsParams
from cbrun.engine.structured_output.validate import is_valid_output
from cbrun.jobs.input.chat import conversation, encode_chat
from cbrun.jobs.input.prompts import encode_prompt
from cbrun.jobs.input.reader import InputRow
from cbrun.jobs.modes.ordering import RowWork, SampleGroups
from cbrun.jobs.output.writer import OutputRow, error_row

logger = logging.getLogger("cbrun.job")


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


class GenerateMode:
    """Turns rows into one request per sample and gathers each row's samples back into output rows.

    Owns the rows in flight (``SampleGroups``). Implements ``cbrun.jobs.modes.mode.JobMode``.

    Args:
        manifest: the job (``[sampling]``, ``seed``, ``n`` and the ``[input]`` chat settings are read).
        tokenizer: the model's tokenizer.
        max_model_len: the model's maximum length (prompt + completion), in tokens.
        vocab_size: the model's vocabulary size, None when unknown.
    """

    def __init__(self, manifest, tokenizer, max_model_len: int, vocab_size: int | None):
        self.manifest = manifest
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.in_flight = SampleGroups()
        self.warned_identical_samples = False
        self._constraints: dict[int, StructuredOutputsParams] = {}  # row index -> its constraint, while in flight

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def prepare(self, row: InputRow) -> RowWork | OutputRow:
        """The row's requests, one per sample, or its error row."""
        if row.error is not None:
            return error_row(row.id, row.row_index, row.error)
        prompt_token_ids = row.prompt_token_ids
        if prompt_token_ids is None:
            try:
                prompt_token_ids = self._encode(row)
            except ValueError as exc:
                return error_row(row.id, row.row_index, f"{row.where()}: {exc}")
        try:
            self._check_prompt(prompt_token_ids)
            params = self.manifest.sampling.replace(**row.sampling_overrides)
            params.validate()
        except ValueError as exc:
            return error_row(row.id, row.row_index, f"{row.where()}: {exc}", len(prompt_token_ids))
        num_samples = row.num_samples or self.manifest.n
        if num_samples > 1 and params.greedy and not self.warned_identical_samples:
            self.warned_identical_samples = True
            logger.warning(
                "row %d (id %r) asks for %d samples with greedy decoding (temperature 0 or top_k 1): "
                "its samples are identical; set sampling.temperature > 0 for different ones "
                "(warned once)",
                row.row_index,
                row.id,
                num_samples,
            )
        seeds = sample_seeds(self.manifest.seed, row.id, num_samples, row.sampling_overrides.get("seed"))
        self.in_flight.start(row.row_index, row.id, num_samples, row.place)
        if params.structured_outputs is not None:
            self._constraints[row.row_index] = params.structured_outputs
        requests = [((row.row_index, i), prompt_token_ids, params.replace(seed=seed)) for i, seed in enumerate(seeds)]
        return RowWork(row.row_index, row.id, prompt_token_ids, requests)

    def collect(self, output) -> list[OutputRow] | None:
        """Record one sample's ``RequestOutput``; all the row's samples, by sample index, once all are back."""
        row_index, _ = output.request_id
        rows = self.in_flight.add(row_index, self._output_row(self.in_flight.row_id(row_index), output))
        if rows is not None:
            self._constraints.pop(row_index, None)
        return rows

    def _encode(self, row: InputRow) -> list[int]:
        """The prompt ids of a text row: the chat template over its conversation, or the plain encoding."""
        inp = self.manifest.input
        if not inp.chat:
            return encode_prompt(self.tokenizer, row.prompt)
        messages = conversation(
            row.prompt, row.extra.get("messages_column"), inp.messages_column is not None, inp.system_prompt
        )
        return encode_chat(self.tokenizer, messages)

    def _check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt encodes to no tokens")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens, but the model's maximum length is "
                f"{self.max_model_len} tokens (prompt + completion)"
            )
        if self.vocab_size is not None and max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"token id {max(prompt_token_ids)} is out of the model's vocabulary of {self.vocab_size}")

    def _output_row(self, row_id: str, output) -> OutputRow:
        row_index, sample_index = output.request_id
        if output.finish_reason == "error":
            message = f"{self.in_flight.where(row_index)}: {output.error}"
            return error_row(row_id, row_index, message, output.num_prompt_tokens, sample_index)
        ids = list(output.output_token_ids)
        # NOTE: when a stop string ended the request the engine hands back the text cut before it.
        text = output.text if output.text is not None else self.tokenizer.decode(ids, skip_special_tokens=True)
        row = OutputRow(
            id=row_id,
            row_index=row_index,
            sample_index=sample_index,
            completion=text,
            completion_token_ids=ids,
            num_prompt_tokens=output.num_prompt_tokens,
            num_completion_tokens=len(ids),
            finish_reason=output.finish_reason,
            logprobs=output.logprobs,
            prompt_logprobs=output.prompt_logprobs,
            prompt_greedy=output.prompt_greedy,
            stop_reason=None if output.stop_reason is None else str(output.stop_reason),
            structured_output_valid=is_valid_output(text, self._constraints.get(row_index)),
        )
        if self.manifest.output.row_timings:
            row.queue_s, row.ttft_s, row.decode_s = output.queue_s, output.ttft_s, output.decode_s
        return row
