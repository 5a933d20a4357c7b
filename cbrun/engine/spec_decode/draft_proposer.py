"""Draft-model speculation: a small model with the target's vocabulary proposes k tokens per request per step.

The draft's KV cache is paged like the target's and addressed by the *same* block ids: block ``b`` holds the
target's pages of ``b`` and, in a second tensor, the draft's. So the block manager's one budget, reference counts,
prefix cache and rollback (``BlockManager.trim``) serve both caches, and a request's draft KV is freed, soft reset
or shared exactly with its target KV (vLLM's EAGLE / draft-model runners share the target's block tables the same
way). The invariant that keeps the draft cache valid: every position whose target KV a step writes, the draft
writes too, in the same step::

    plan (scheduler)        prefill chunks, decodes, verify entries [t | _ _ _]  (k slots allocated, ids unknown)
    draft forward 1         every entry as planned (the mirror), a verify entry only its last known token t
                            -> d1 for each verify entry
    draft forward j = 2..k  verify entries: d(j-1) at position P + j - 1  -> dj
    draft forward k + 1     verify entries: dk at P + k (its KV only; no token)
    target forward          the plan with [t d1 .. dk] filled in, verified as usual

Rejected positions hold stale draft KV past ``num_computed_tokens``, overwritten before anything reads them, as
the target's. Greedy requests propose the draft's argmax; sampled ones draw from the draft's own processed
distribution q (same temperature / top-k / top-p / penalties as the request), and the verifier accepts with
min(1, p/q) (``cbrun.engine.spec_decode.speculative_rule.verify``; Leviathan et al. 2023, Chen et al. 2023). The code is ours.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from cbrun.engine.core.cache_spec import CacheSpec
from cbrun.engine.core.faults import SamplingError
from cbrun.engine.core.kv_layout import SLIDING, KVLayout
from cbrun.engine.core.plan import RowSampling, ScheduledRequest, SchedulerOutput
from cbrun.engine.spec_decode.speculative_rule import sample_draft
from cbrun.engine.worker.device import to_device
from cbrun.engine.worker.kv_cache import KVCache
from cbrun.engine.worker.model_runner import ModelRunner


class DraftProposer:
    """Runs the draft model over each step's plan and fills the verify entries' proposals.

    Owns the draft model's runner and its KV-cache tensors; decides nothing (the scheduler chose which requests
    verify and how many proposals each, and allocated their slots).

    Args:
        model: the draft causal LM (loaded like the target, with cbrun's attention).
        target_spec: the target cache's geometry; the draft cache has the same chunks and block ids.
        vocab_size: the target's vocabulary size; draft logits are cut (or padded with -inf) to it.
        eos_token_ids: the target's EOS ids (the draft's processing treats them as the target's does).
        use_triton, max_model_len, lean_model: as for ``ModelRunner``.

    Raises:
        ValueError: for a draft with sliding-window layers, or with CPU swap configured in the target cache.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        target_spec: CacheSpec,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        use_triton: bool,
        max_model_len: int,
        lean_model=None,
    ) -> None:
        layout = draft_layout(model)
        if target_spec.num_cpu_pages:
            raise ValueError(
                'speculative = "draft" does not run with CPU swap yet (engine.cpu_offload_space > 0): '
                "the draft's pages are not swapped; set cpu_offload_space = 0 (preemption then soft "
                'resets) or use speculative = "ngram"'
            )
        assert target_spec.layout.num_layers_of(SLIDING) == 0, "LLMEngine refuses sliding-window targets"
        # One full block per chunk in the target: chunk id == block id, so the draft spec with the same chunks
        # (one draft block per chunk, one page per draft layer) addresses the same block ids.
        self.spec = CacheSpec(target_spec.page_size, layout, target_spec.num_chunks)
        num_kv_heads, head_dim = kv_shape(model)
        param = next(model.parameters())
        self.kv_cache = KVCache(self.spec, num_kv_heads, head_dim, param.dtype, param.device, num_zeroed_pages=0)
        self.runner = ModelRunner(
            model, self.kv_cache, use_triton=use_triton, max_model_len=max_model_len, lean_model=lean_model
        )
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def zero_chunks_below(self, num_chunks: int) -> None:
        """Zero the draft pages of chunks the block manager has handed out (as the target's ``KVCache``)."""
        self.kv_cache.zero_pages_below(num_chunks * self.spec.chunk_pages)

    @torch.inference_mode()
    def propose(
        self, plan: SchedulerOutput, sampling: Mapping[int, RowSampling]
    ) -> tuple[SchedulerOutput, dict[int, torch.Tensor]]:
        """Run the draft over the plan and return it with every verify entry's proposals filled in.

        Args:
            plan: the step's plan; a verify entry's ``spec_token_ids`` are placeholders, one per proposal slot.
            sampling: each planned request's ``RowSampling`` by ``Request.index`` (the sampler's, ``StepSampler.values``):
                with its entry (``RowSampling.at``) its sampling params, output and seed at this step.

        Returns:
            The plan to launch on the target, and for each sampled (non-greedy) verify entry its draft
            distributions, a (num_proposals, vocab_size) float32 tensor on the logits' device: row i is q of proposal i.
        """
        verify = [item for item in plan.scheduled if item.spec_token_ids]
        mirror = [_first_draft_entry(item) for item in plan.scheduled]
        # The released rows travel with the mirror: the draft's runner keeps its own persistent batch.
        handle = self.runner.launch(
            SchedulerOutput(scheduled=mirror, released_request_indices=plan.released_request_indices)
        )
        proposals: dict[int, list[int]] = {item.request_index: [] for item in verify}
        probs: dict[int, list[torch.Tensor]] = {item.request_index: [] for item in verify}
        for j in range(1, max((len(item.spec_token_ids) for item in verify), default=0) + 2):
            if j > 1:  # the last draft token in, at position P + j - 1
                entries = [
                    _next_draft_entry(item, j, proposals[item.request_index][-1])
                    for item in verify
                    if len(item.spec_token_ids) >= j - 1
                ]
                handle = self.runner.launch(SchedulerOutput(scheduled=entries))
            self._sample(handle, [item for item in verify if len(item.spec_token_ids) >= j], sampling, proposals, probs)
        filled = [
            _with_proposals(item, proposals[item.request_index]) if item.spec_token_ids else item
            for item in plan.scheduled
        ]
        draft_probs = {index: torch.stack(rows) for index, rows in probs.items() if rows}
        return replace(plan, scheduled=filled), draft_probs

    def _sample(
        self,
        handle,
        items: list[ScheduledRequest],
        sampling: Mapping[int, RowSampling],
        proposals: dict[int, list[int]],
        probs: dict[int, list[torch.Tensor]],
    ) -> None:
        """Append each item's next draft token (and q for sampled requests) from the step's logits."""
        if not items:
            return
        rows = to_device(
            [handle.sample_row_of[item.request_index] for item in items], torch.int64, handle.logits.device
        )
        logits = _fit_vocab(handle.logits[rows], self.vocab_size)
        argmax = logits.argmax(dim=-1).tolist()
        for i, item in enumerate(items):
            values = sampling[item.request_index].at(item)
            drafts = proposals[item.request_index]
            if values.params.greedy:
                drafts.append(argmax[i])
                continue
            try:
                token, q = sample_draft(logits[i], values, self.eos_token_ids, values.output_tokens() + drafts)
            except SamplingError:  # e.g. filters rule out every token: propose the argmax as a point mass (any q
                token = argmax[i]  # keeps the target distribution; the target's own row reports its error)
                q = torch.zeros(self.vocab_size, device=logits.device)
                q[token] = 1.0
            drafts.append(token)
            probs[item.request_index].append(q)


def draft_layout(model: torch.nn.Module) -> KVLayout:
    """The draft's layer layout (full attention only).

    Raises:
        ValueError: when the draft has sliding-window layers.
    """
    layout = KVLayout.from_model_config(_text_config(model))
    if layout.num_layers_of(SLIDING):
        raise ValueError(
            'speculative = "draft" does not support a draft model with sliding-window layers yet; '
            "choose a full-attention draft model"
        )
    return layout


def kv_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(num_kv_heads, head_dim) of a model's attention layers."""
    config = _text_config(model)
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return num_kv_heads, head_dim


def draft_bytes_per_block(model: torch.nn.Module, page_size: int) -> int:
    """Bytes of the draft's K and V for one block (``page_size`` tokens, every draft layer)."""
    num_kv_heads, head_dim = kv_shape(model)
    return KVCache.bytes_per_block(
        len(draft_layout(model).layer_types), page_size, num_kv_heads, head_dim, next(model.parameters()).dtype
    )


def check_draft_vocab(target_vocab_size: int, draft_vocab_size: int, target_tokenizer, draft_tokenizer) -> None:
    """Refuse a draft whose tokens mean something else than the target's.

    Both tokenizers, when both directories have one, must map the same strings to the same ids; without them the
    two configs' ``vocab_size`` must be equal. With equal tokenizers the sizes may differ (padded embedding
    matrices): draft logits are then cut or padded to the target's size.

    Raises:
        ValueError: naming the mismatch.
    """
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise ValueError(
                "the draft model's tokenizer differs from the target's (another vocabulary): "
                "speculative decoding needs a draft with the same tokenizer"
            )
        return
    if target_vocab_size != draft_vocab_size:
        raise ValueError(
            f"the draft model's vocab_size {draft_vocab_size} differs from the target's "
            f"{target_vocab_size}: speculative decoding needs a draft with the same vocabulary"
        )


def _text_config(model: torch.nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(N, V_draft) logits as (N, vocab_size) float32: extra ids cut, missing ones -inf (never proposed)."""
    logits = logits.float()
    if logits.shape[-1] >= vocab_size:
        return logits[:, :vocab_size]
    pad = torch.full((logits.shape[0], vocab_size - logits.shape[-1]), float("-inf"), device=logits.device)
    return torch.cat([logits, pad], dim=-1)


def _first_draft_entry(item: ScheduledRequest) -> ScheduledRequest:
    """The entry as the draft's first forward runs it: a verify entry cut to its last known token (which samples);
    every other entry computed as planned for its KV only (no logit rows)."""
    if item.spec_token_ids:
        return replace(
            item,
            num_tokens=item.num_tokens - len(item.spec_token_ids),
            token_ids=item.token_ids[: len(item.token_ids) - len(item.spec_token_ids)],
            spec_token_ids=(),
            needs_host_sampling=False,
            prompt_logprob_positions=range(0),
        )
    return replace(item, samples=False, needs_host_sampling=False, prompt_logprob_positions=range(0))


def _next_draft_entry(item: ScheduledRequest, j: int, token: int) -> ScheduledRequest:
    """Draft forward ``j`` (>= 2) of a verify entry: proposal ``j - 1`` in at its position; it samples proposal
    ``j`` unless all proposals are drawn (then only its KV is written)."""
    start = item.end - len(item.spec_token_ids) - 1 + j - 1
    return replace(
        item,
        start=start,
        num_tokens=1,
        token_ids=[token],
        num_pending_inputs=0,
        samples=j <= len(item.spec_token_ids),
        needs_host_sampling=False,
        prompt_logprob_positions=range(0),
        spec_token_ids=(),
    )


def _with_proposals(item: ScheduledRequest, proposals: list[int]) -> ScheduledRequest:
    """The verify entry with its placeholder proposals replaced by the draft's."""
    num_known = len(item.token_ids) - len(item.spec_token_ids)
    return replace(item, token_ids=item.token_ids[:num_known] + proposals, spec_token_ids=tuple(proposals))
