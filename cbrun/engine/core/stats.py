"""Counters an engine keeps across its lifetime."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineStats:
    """Engine-wide counters.

    Attributes:
        num_prompt_tokens: prompt tokens of finished requests.
        num_cached_prompt_tokens: of those, tokens served from the prefix cache.
        num_computed_tokens: tokens run through the model (prefill chunks, decodes, recomputation).
        num_generated_tokens: output tokens committed, as plain decoding samples them (a stop inside an accepted
            speculative run cuts the count there too; an echo-only request adds none).
        num_steps: forward passes.
        num_requests: requests finished (failed included).
        num_failed_requests: requests that finished with an error.
        num_soft_resets: requests whose blocks were freed and their tokens later recomputed.
        num_offloads: requests swapped to CPU memory.
        num_evicted_blocks: prefix-cache blocks reused for other content.
        num_proposed_tokens: speculative proposals verified.
        num_accepted_tokens: of those, accepted (equal to what the target model chose).
        num_verify_steps: request-steps that verified proposals (each commits 1 + its accepted proposals).
        num_cuda_graph_captures: CUDA graphs captured (emulated ones included): at most one per padded shape.
        num_cuda_graph_replays: steps replayed from a CUDA graph (emulated or real); the other steps ran eagerly.
        num_grammar_mask_steps: steps with at least one constrained row (structured outputs).
        grammar_mask_seconds: host time those steps spent filling and applying token bitmasks.
        grammar_compile_seconds: time spent compiling distinct constraints (on the compile threads).
    """

    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_requests: int = 0
    num_failed_requests: int = 0
    num_soft_resets: int = 0
    num_offloads: int = 0
    num_evicted_blocks: int = 0
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    num_cuda_graph_captures: int = 0
    num_cuda_graph_replays: int = 0
    num_grammar_mask_steps: int = 0
    grammar_mask_seconds: float = 0.0
    grammar_compile_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Fraction of speculative proposals accepted (0 when none were made)."""
        return self.num_accepted_tokens / self.num_proposed_tokens if self.num_proposed_tokens else 0.0

    @property
    def mean_tokens_per_verify_step(self) -> float:
        """Tokens a verify step commits on average: its accepted proposals plus the bonus token (0 when none)."""
        return (self.num_accepted_tokens / self.num_verify_steps + 1) if self.num_verify_steps else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of prompt tokens served from the prefix cache."""
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def as_dict(self) -> dict[str, int | float]:
        return {
            **asdict(self),
            "prefix_hit_rate": self.prefix_hit_rate,
            "acceptance_rate": self.acceptance_rate,
            "mean_tokens_per_verify_step": self.mean_tokens_per_verify_step,
        }
