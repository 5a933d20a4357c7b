"""``JobSummary``: what one ``run_job`` call did, the counts and timings it reports, its exit code and the one
summary line the CLI prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from cbrun.jobs.observe.progress import count_errors
from cbrun.jobs.output.status import too_many_errors


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
        num_repeated_ids: distinct ``id_column`` values that more than one input row holds (see ``cbrun.jobs.output.row_ids``).
        engine_stats: ``LLMEngine.stats.as_dict()`` at the end.
        replica_stats: the Ray executor's counters over its replicas (``cbrun.jobs.run.ray_executor.run_on_ray``).
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
            f"cbrun: {self.num_rows} rows ({self._row_counts()}){samples} | "
            f"{self.num_prompt_tokens} prompt tokens | {self.num_generated_tokens} generated tokens | "
            f"{self.elapsed_s:.1f} s | {self.generated_tokens_per_s:.0f} tokens/s generated | "
            f"peak memory {self.peak_memory_mib:.0f} MiB{gpu}{self._engine_counters()}{self._errors()}"
        )

    def _row_counts(self) -> str:
        """ "N errors, M skipped", singular where N is 1."""
        return f"{count_errors(self.num_errors)}, {self.num_skipped} skipped"

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
            f"cbrun: {self.num_rows} rows ({self._row_counts()}) | "
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
