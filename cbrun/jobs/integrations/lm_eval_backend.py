"""cbrun as a model backend of lm-evaluation-harness (``lm_eval``): ``--model cbrun``.

All three request types run on cbrun's engine, every request of a call submitted at once, so they share forward
passes (continuous batching) and full KV blocks of equal prefixes (the choices of a multiple-choice question share
their context, computed once; ``CbrunLM.engine.stats`` counts the prefix-cache hits).

Token-for-token the inputs are those of lm-eval's ``hf`` backend (``lm_eval/models/huggingface.py``, ``HFLM``,
lm-eval 0.4.13), so the numbers agree with ``--model hf`` on the same model:

- context / continuation split: ``TemplateLM.loglikelihood`` and ``TemplateLM._encode_pair``
  (``lm_eval/api/model.py``), inherited unchanged: trailing whitespace of the context moves to the continuation,
  ``context_enc = tok_encode(context)``, ``continuation_enc = tok_encode(context + continuation)[len(context_enc):]``;
  an empty context becomes ``[prefix_token_id]``. ``tok_encode`` is ``HFLM.tok_encode``'s rule (``add_bos_token``,
  no second BOS when the text already starts with one).
- truncation and scored positions: ``HFLM._loglikelihood_tokens`` runs ``(context_enc + continuation_enc)[-(max_length
  + 1):][:-1]`` and scores the last ``len(continuation_enc)`` logits; see ``lm_eval_requests.loglikelihood_request``.
- rolling windows: ``HFLM.loglikelihood_rolling``: lm-eval's ``get_rolling_token_windows`` over ``tok_encode(text)``
  with ``prefix_token_id``, ``max_seq_len = max_length``, ``context_len = 1``, then ``make_disjoint_window``.
- ``generate_until``: ``HFLM.generate_until``: ``normalize_gen_kwargs``, the EOS text added to ``until``, the
  context left-truncated to ``max_length - max_gen_toks`` tokens, output decoded without special tokens and cut at
  the first stop string (``postprocess_generated_text``).

lm-eval 0.4.13 has no plugin mechanism for models, so ``cbrun lm-eval ...`` (``main``) registers this backend and
hands its arguments to lm-eval's own CLI. The ``lm_eval.models`` entry point in pyproject.toml makes
``lm_eval --model cbrun`` work on lm-eval versions that load model entry points.

This module owns the model class (``CbrunLM``, the entry point's target) and ``main``; the requests are built in
``cbrun.jobs.integrations.lm_eval_requests``, the device, tokenizer and engine loaded in
``cbrun.jobs.integrations.lm_eval_loading``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from typing import Iterable, Iterator

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from tqdm import tqdm

from cbrun.engine.config import EngineConfig
from cbrun.engine.model.loader import load_model, resolve_engine_dtype
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.integrations.lm_eval_loading import build_engine, load_tokenizer, resolve_device
from cbrun.jobs.integrations.lm_eval_requests import (
    LoglikelihoodRequest,
    loglikelihood_request,
    pair_encode_keys,
    request_seed,
    rolling_windows,
    score_params,
    scoring_order,
)

logger = logging.getLogger("cbrun.lm_eval")

#: ``gen_kwargs`` keys that map onto ``SamplingParams`` fields of the same name.
_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)
#: Engine settings of this backend where they differ from ``EngineConfig``'s: scoring requests finish at the end of
#: their prefill, so larger steps only amortise per-step work, and smaller pages leave less of a shared context
#: (its last, partial page) to recompute per choice (measured on stories260K, one thread: 2048 tokens and 8-token
#: pages score the 5,276 multiple-choice requests in about 0.7x the time of 1024 and 16).
ENGINE_DEFAULTS = {"max_batch_tokens": 2048, "max_requests_per_batch": 256, "page_size": 8}
#: lm-eval passes these to every backend; they do not apply to a continuous-batching engine.
_IGNORED_ARGS = ("batch_size", "max_batch_size", "trust_remote_code", "use_fast_tokenizer", "backend", "revision")


@register_model("cbrun")
class CbrunLM(TemplateLM):
    """lm-eval model backed by cbrun's ``LLMEngine``.

    Owns the engine, the tokenizer and the per-call request bookkeeping.

    Args:
        pretrained: local transformers model directory (nothing is downloaded).
        dtype: "auto" (the checkpoint's), "float32", "bfloat16" or "float16".
        max_length: context length of scoring windows and generation; default: ``hf``'s rule (the model config's
            ``n_positions`` / ``max_position_embeddings`` / ``n_ctx``, else the tokenizer's, else 2048).
        add_bos_token: as ``hf``: None keeps the tokenizer's default, True / False force it.
        prefix_token_id: token that conditions an empty context and the first rolling window; default BOS (else EOS).
        max_gen_toks: ``generate_until``'s default ``max_gen_toks`` (256, as ``hf``).
        device: "cpu", "cuda", ...; default (or a CUDA device where there is none): CUDA when available, else CPU.
        tokenizer: a tokenizer directory other than ``pretrained``.
        seed: seed of sampled generations whose ``gen_kwargs`` give none (see ``_generation_request``).
        batch_size, max_batch_size: accepted and ignored: the engine batches by ``max_batch_tokens``.
        **engine_settings: any ``EngineConfig`` field (``page_size``, ``max_batch_tokens``,
            ``max_requests_per_batch``, ``num_threads``, ``num_blocks``, ``max_memory_percent``,
            ``allow_block_sharing``, ``attention_backend``, ``model_impl``, ...); defaults as ``EngineConfig``'s
            except ``ENGINE_DEFAULTS``.

    Raises:
        ValueError: for an unknown argument or a bad engine setting, naming it.
    """

    def __init__(
        self,
        pretrained: str,
        dtype: str = "auto",
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        max_gen_toks: int = 256,
        device: str | None = None,
        tokenizer: str | None = None,
        seed: int = 1234,
        **kwargs,
    ) -> None:
        super().__init__()
        engine_fields = [f.name for f in dataclasses.fields(EngineConfig)]
        unknown = sorted(set(kwargs) - set(_IGNORED_ARGS) - set(engine_fields))
        if unknown:
            raise ValueError(
                f"unknown cbrun model argument(s) {unknown}; accepted: pretrained, dtype, max_length, "
                f"add_bos_token, prefix_token_id, max_gen_toks, device, tokenizer, seed and the "
                f"engine settings {engine_fields}"
            )
        engine_settings = {k: v for k, v in kwargs.items() if k in engine_fields}
        device = resolve_device(device)
        dtype = str(dtype).removeprefix("torch.")  # a torch.dtype from Python callers, as hf accepts
        config = EngineConfig(**{**ENGINE_DEFAULTS, "seed": seed, **engine_settings, "dtype": dtype, "device": device})
        self.tokenizer = load_tokenizer(tokenizer or pretrained, add_bos_token)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self._max_gen_toks = int(max_gen_toks)
        # As cbrun run loads it: the safetensors loader where it applies; torch's threads set ("auto" resolved).
        config = resolve_engine_dtype(pretrained, config)
        model = load_model(pretrained, config)
        self._max_length = int(max_length) if max_length else resolve_max_length(model.config, self.tokenizer)
        self.engine = build_engine(pretrained, model, config, self.tokenizer, self._max_length)
        self._device = torch.device(device)
        self.pretrained = pretrained
        self.seed = int(seed)
        self._prefix_text = self.tokenizer.decode(self.prefix_token_id)
        #: ``(string, add_special_tokens) -> token ids`` of the strings the current call will encode, encoded in
        #: one tokenizer call up front (``_encoded``); empty between calls.
        self._encodings: dict[tuple[str, bool | None], tuple[int, ...]] = {}

    # ---- what lm-eval asks of every model -------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        return self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs
    ) -> list[int]:
        """Token ids of ``string`` by ``HFLM.tok_encode``'s rule: an explicit ``add_special_tokens`` wins, then
        ``add_bos_token``; with neither, the tokenizer's default, except no BOS is added to a text that already
        starts with the prefix token's text."""
        ids = self._encodings.get((string, add_special_tokens))
        if ids is None:
            ids = self.tokenizer.encode(string, **self._special_tokens(string, add_special_tokens))
        return list(ids[-left_truncate_len:] if left_truncate_len else ids)

    def _special_tokens(self, string: str, add_special_tokens: bool | None) -> dict[str, bool]:
        """The tokenizer keyword that ``HFLM.tok_encode`` passes for ``string`` (empty: the tokenizer's default)."""
        if add_special_tokens is not None:
            special = {"add_special_tokens": add_special_tokens}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        else:
            special = {}
        if add_special_tokens is None and has_bos_prefix(string, self._prefix_text):
            special["add_special_tokens"] = False
        return special

    @contextlib.contextmanager
    def _encoded(self, keys: Iterable[tuple[str, bool | None]]) -> Iterator[None]:
        """Within the block, ``tok_encode`` of any ``(string, add_special_tokens)`` in ``keys`` is a lookup.

        The distinct strings are encoded with one tokenizer call per special-token setting: a batch call returns
        the ids ``tokenizer.encode`` does string by string, without its per-call Python work (on stories260K's
        tokenizer, 6,595 strings: 0.7x the time). A string not in ``keys`` is still encoded when asked for.
        """
        batches: dict[tuple, list[tuple[str, bool | None]]] = {}
        for key in dict.fromkeys(keys):
            batches.setdefault(tuple(self._special_tokens(*key).items()), []).append(key)
        encodings = {}
        for special, batch in batches.items():
            ids = self.tokenizer(
                [string for string, _ in batch],
                **dict(special),
                return_attention_mask=False,
                return_token_type_ids=False,
            )["input_ids"]
            encodings.update(zip(batch, ids))
        self._encodings = encodings
        try:
            yield
        finally:
            self._encodings = {}

    def tok_decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # ---- loglikelihood ----------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``TemplateLM.loglikelihood`` (its encoding rules, unchanged), with every string it encodes encoded up
        front in one batch (``_encoded``, ``pair_encode_keys``)."""
        with self._encoded(pair_encode_keys(request.args for request in requests)):
            return super().loglikelihood(requests, disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(sum of continuation log-probabilities, every continuation token was the argmax)`` per request.

        Args:
            requests: ``((context, continuation) or None, context_enc, continuation_enc)`` as ``TemplateLM``
                builds them; a None cache key marks a rolling window (cached per text by the caller).
        """
        scored = [loglikelihood_request(ctx, cont, self.max_length) for _, ctx, cont in requests]
        results = self._score(scored, disable_tqdm)
        answers = [results[r] for r in scored]
        for (cache_key, _, _), answer in zip(requests, answers):
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
        return answers

    def _score(
        self, requests: list[LoglikelihoodRequest], disable_tqdm: bool
    ) -> dict[LoglikelihoodRequest, tuple[float, bool]]:
        """Run the distinct requests on the engine in ``scoring_order``."""
        unique = scoring_order(set(requests))
        work = ((r, list(r.prompt_token_ids), score_params(r)) for r in unique)
        results = {}
        for output in tqdm(
            self.engine.generate(work), total=len(unique), disable=disable_tqdm, desc="cbrun: loglikelihood requests"
        ):
            request = output.request_id
            _raise_on_error(output, f"scoring a {len(request.prompt_token_ids)}-token window")
            assert len(output.prompt_logprobs) == request.num_continuation_tokens
            # Summed in float32 over the window, as ``hf`` sums its float32 log-softmax rows.
            logprob = float(torch.tensor(output.prompt_logprobs, dtype=torch.float32).sum())
            results[request] = (logprob, bool(all(output.prompt_greedy)))
        self._log_stats("loglikelihood", len(requests))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text, summed over ``hf``'s rolling windows, all texts' windows at once."""
        texts = [request.args[0] for request in requests]
        windows, owners = [], []
        with self._encoded((text, None) for text in texts):
            encoded = [self.tok_encode(text) for text in texts]
        for index, token_ids in enumerate(encoded):
            for context_enc, continuation_enc in rolling_windows(token_ids, self.prefix_token_id, self.max_length):
                windows.append((None, context_enc, continuation_enc))
                owners.append(index)
        totals = [0.0] * len(texts)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        for text, total in zip(texts, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    # ---- generation -------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Generate for every request at once; stop at ``until`` strings, EOS or ``max_gen_toks``."""
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        work, untils = [], []
        with self._encoded((request.args[0], None) for request in requests):
            for index, request in enumerate(requests):
                context, gen_kwargs = request.args
                prompt, params, until = self._generation_request(context, gen_kwargs, eos_text, index)
                work.append((index, prompt, params))
                untils.append(until)
        texts = [""] * len(requests)
        for output in tqdm(
            self.engine.generate(work), total=len(work), disable=disable_tqdm, desc="cbrun: generate_until requests"
        ):
            index = output.request_id
            _raise_on_error(output, f"generating for request {index}")
            text = output.text if output.text is not None else self.tok_decode(output.output_token_ids)
            texts[index] = postprocess_generated_text(text, untils[index], None)
            self.cache_hook.add_partial("generate_until", requests[index].args, texts[index])
        self._log_stats("generate_until", len(requests))
        return texts

    def _generation_request(
        self, context: str, gen_kwargs: dict, eos_text: str, index: int
    ) -> tuple[list[int], SamplingParams, list[str]]:
        """(prompt ids, sampling params, stop strings) by ``HFLM.generate_until``'s rules.

        A sampled request's seed derives from (``gen_kwargs["seed"]`` or the backend's ``seed``, its index in the
        call), so a run is reproducible and lm-eval's ``repeats`` of one prompt draw different samples."""
        if not isinstance(gen_kwargs, dict):
            raise ValueError(f"generation kwargs must be a dict, got {gen_kwargs!r}")
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
        max_gen_toks = kwargs.pop("max_gen_toks")
        max_context = self.max_length - max_gen_toks
        if max_context <= 0:
            raise ValueError(
                f"max_gen_toks = {max_gen_toks} leaves no room for a context in max_length = {self.max_length} tokens"
            )
        do_sample = kwargs.pop("do_sample", False)
        if kwargs.pop("num_beams", 1) != 1:
            raise ValueError("cbrun does not implement beam search (num_beams > 1)")
        unknown = sorted(set(kwargs) - set(_SAMPLING_KEYS))
        if unknown:
            raise ValueError(
                f"generation kwargs {unknown} are not supported by cbrun; supported: do_sample, "
                f"until, max_gen_toks, num_beams=1, {', '.join(_SAMPLING_KEYS)}"
            )
        sampling = {k: kwargs[k] for k in _SAMPLING_KEYS if k in kwargs}
        sampling["seed"] = request_seed(int(sampling.get("seed", self.seed)), index)
        if not do_sample:
            sampling["temperature"] = 0.0
        params = SamplingParams(max_new_tokens=max_gen_toks, stop=tuple(s for s in until if s), **sampling)
        return self.tok_encode(context, left_truncate_len=max_context), params, until

    # ---- reporting --------------------------------------------------------------------------------------------
    def _log_stats(self, kind: str, num_requests: int) -> None:
        stats = self.engine.stats
        logger.info(
            "cbrun: %d %s requests done; engine so far: %d prompt tokens, %d from the prefix cache "
            "(hit rate %.1f%%), %d generated, %d steps",
            num_requests,
            kind,
            stats.num_prompt_tokens,
            stats.num_cached_prompt_tokens,
            100 * stats.prefix_hit_rate,
            stats.num_generated_tokens,
            stats.num_steps,
        )


def _raise_on_error(output, what: str) -> None:
    if output.finish_reason == "error":
        raise RuntimeError(f"cbrun engine failed {what}: {output.error}")


def main(argv: list[str] | None = None) -> int:
    """``cbrun lm-eval ARGS``: lm-eval's CLI (``lm_eval ARGS``) with ``--model cbrun`` registered, and lm-eval's
    index of its built-in tasks read from a cache (``cbrun.jobs.integrations.lm_eval_task_index``; the same index, for any backend)."""
    from lm_eval.__main__ import cli_evaluate

    from cbrun.jobs.integrations.lm_eval_task_index import cached_builtin_task_index

    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(format="%(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    sys.argv = ["lm-eval", *argv]
    with cached_builtin_task_index():
        cli_evaluate()
    return 0
