"""Engine settings, validated in one place."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbrun.engine.setting_error import SettingError, must_be

SCHEDULER_TYPES = ("fifo", "prefill_first")
DTYPES = ("float32", "bfloat16", "float16", "auto")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
#: ``kv_cache_dtype`` values (vLLM's names): the model's dtype, or float8 e4m3 with a per-tensor scale.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
#: ``fp8_activation_scheme`` values (vLLM's ``Fp8Config.activation_scheme`` words; the same tuple as
#: ``cbrun.kernels.fp8_scaled_mm.FP8_ACTIVATION_SCHEMES``, kept here so the settings import no torch).
FP8_ACTIVATION_SCHEMES = ("none", "dynamic")
LINEAR_BACKENDS = ("auto", "torch", "onednn")
SWITCHES = ("auto", "on", "off")
#: ``cuda_graphs``' values: a switch, or "emulate" (the graph path on any device, ``cbrun.engine.worker.graph_emulation``).
CUDA_GRAPH_MODES = SWITCHES + ("emulate",)
MODEL_IMPLS = ("auto", "transformers", "lean")
LOADERS = ("auto", "transformers")
#: Default (max_requests_per_batch, max_batch_tokens) per device type, for throughput. CUDA: vLLM's offline (``LLM``)
#: defaults, 256 sequences and 8k batched tokens. CPU: measured on the gsm8k-long bench workload (stories260K, one
#: thread, 2-core machine): benchmarks/results-defaults.md.
DEFAULT_BATCH_LIMITS = {"cpu": (256, 1024), "cuda": (256, 8192)}
#: Default ``page_size`` per device type. CPU: 64, because the C attention kernel streams a page's rows from memory
#: and then jumps to the next page wherever it lies: longer pages mean fewer jumps and less per-page work. On the
#: gsm8k-long bench workload (stories260K, 2-core machine) the generation phase took 0.89x the time of 16-token
#: pages at 32, 0.86x at 64 and 0.82x at 128, within each other's spread from 64 up (benchmarks/results-page-size.md);
#: 64 keeps prefix sharing finer than 128 (only whole blocks are shared). CUDA: 16, the page the Triton kernels are
#: tuned for (vLLM's default block size on GPUs).
DEFAULT_PAGE_SIZE = {"cpu": 64, "cuda": 16}
SPECULATIVE_METHODS = ("off", "ngram", "draft")
#: ``structured_outputs_backend`` values (``cbrun.engine.structured_output.schema_support.BACKENDS``).
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")
#: The settings that name one of a fixed set of choices, and those choices (checked by ``EngineConfig``).
_CHOICES = {
    "scheduler_type": SCHEDULER_TYPES,
    "dtype": DTYPES,
    "async_batching": SWITCHES,
    "cuda_graphs": CUDA_GRAPH_MODES,
    "attention_backend": ATTENTION_BACKENDS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "fp8_activation_scheme": FP8_ACTIVATION_SCHEMES,
    "model_impl": MODEL_IMPLS,
    "loader": LOADERS,
    "linear_backend": LINEAR_BACKENDS,
    "batch_invariant": SWITCHES,
    "structured_outputs_backend": STRUCTURED_OUTPUTS_BACKENDS,
}


@dataclass(frozen=True)
class BatchLimits:
    """The batch shape of an engine on a resolved device: ``EngineConfig``'s device-dependent settings with the
    device's defaults filled in (``EngineConfig.limits``), so the engine's core reads integers, never None.

    Attributes:
        page_size: tokens per KV-cache block.
        max_batch_tokens: token budget of one forward pass.
        max_requests_per_batch: most requests in one forward pass.
        safety_margin: fraction of the block pool kept free before new prefills are admitted.
    """

    page_size: int
    max_batch_tokens: int
    max_requests_per_batch: int
    safety_margin: float


#: Version of the rule that decides a request's proposals (``cbrun.engine.spec_decode.speculative.Speculator.propose``). A sampled
#: row's draws depend on its proposals, so a job's fingerprint records it: bump it whenever a change alters which
#: proposals a request makes under the same settings. 2: evidence kept per n-gram match length, and a verify entry's
#: own cost. (Here, not in ``cbrun.engine.spec_decode.speculative``, so the job layer reads it without importing torch.)
SPECULATION_RULE_VERSION = 2
#: Version of the sampler's random stream and draw rule (``cbrun.engine.sample``). A sampled row's tokens depend on it,
#: so a job's fingerprint records it: bump it whenever a change alters which token a seeded row draws. 3: on the CPU
#: the C draw (``cbrun.kernels.cpu_sampler``): version 2's rule and numbers with its own floats, so a draw within about
#: 1e-7 of a boundary may differ; 2: the counter-based stream (``cbrun.engine.sample.sampler.uniform``) drawn by inverse
#: CDF with pivots; 1 (unrecorded): one ``torch.Generator`` per request on the host.
SAMPLER_VERSION = 3


@dataclass
class EngineConfig:
    """Settings of the continuous-batching engine.

    Attributes:
        page_size: tokens per KV-cache block (page); None (the default) takes the device's default from
            ``DEFAULT_PAGE_SIZE`` (CPU 64, CUDA 16). Prefix sharing reuses whole blocks only, so smaller pages share
            more of a common prefix.
        num_blocks: blocks in the KV-cache pool; None sizes the pool from free memory (``max_memory_percent``).
        max_batch_tokens: token budget of one forward pass (decode tokens plus prefill chunk tokens); None (the
            default) takes the device's throughput default from ``DEFAULT_BATCH_LIMITS`` (CPU 1024, CUDA 8192).
        max_requests_per_batch: most requests in one forward pass; None (the default) takes the device's default
            from ``DEFAULT_BATCH_LIMITS`` (256).
        scheduler_type: "fifo" or "prefill_first".
        safety_margin: fraction of the block pool kept free before new prefills are admitted; None takes the
            scheduler's default (FIFO 0.15, PrefillFirst 0.0); 0 disables it.
        max_memory_percent: on the CPU, the fraction of available memory (MemAvailable, read after the model is
            loaded) the KV cache and one step's workspace may use when ``num_blocks`` is None.
        gpu_memory_utilization: on CUDA, the fraction of the device's total memory this engine may hold in all
            (vLLM's name): weights, the CUDA-graph pool, one step's activations and logits, and the KV cache,
            which gets what is left (``cbrun.engine.core.cache_sizing``). Memory other processes hold counts against it.
        allow_block_sharing: reuse KV blocks of identical prompt prefixes (prefix caching).
        cpu_offload_space: GiB of CPU swap space for offloaded requests; 0 falls back to soft reset.
        dtype: model and KV-cache dtype: "float32", "bfloat16", "float16", or "auto" (the default): the
            checkpoint's ``torch_dtype`` (``dtype``) on CUDA, float32 on the CPU (``resolve_dtype``). Weights load
            straight to the device in that dtype.
        device: torch device string, e.g. "cpu", "cuda" or "cuda:1"; "auto" (a job manifest's default) leaves the
            device defaults above None until the job resolves the device and replaces it. A CUDA device with an
            index becomes the process's current device when the engine is built, so every stream, event, graph
            pool and kernel launch lands on it.
        attention_backend: "torch" (the PyTorch reference: gathers the pages, then SDPA), "triton" (kernels),
            "cpu" (``cbrun.kernels.cpu_attention``: a C/OpenMP kernel that reads pages in place, compiled at first use;
            float32 on the CPU only, else a ValueError), or "auto": triton on CUDA, else cpu where it applies
            (float32, the kernel builds), else torch.
        kv_cache_dtype: the KV cache's storage (vLLM's name). "auto" (the default): the model's dtype.
            "fp8_e4m3": float8_e4m3fn with a per-tensor scale of 1.0 (vLLM's default ``k_scale`` / ``v_scale``),
            values saturated to +-448, dequantized to the model's dtype as attention reads each page: one byte per
            value, so a memory budget holds 2x the tokens of a bfloat16 cache (4x float32). Lossy: greedy tokens
            equal a reference whose attention reads the same float8-rounded K/V, not the full-precision model's
            (docs/engine.md, "FP8 KV cache"). Attention then runs the PyTorch reference on any device
            (``attention_backend`` "auto" or "torch"; "cpu" and "triton" read the model's dtype and are refused);
            not with ``tensor_parallel_size`` above 1.
        fp8_activation_scheme: what an FP8 checkpoint's linear layers do with their inputs (vLLM's
            ``activation_scheme`` words; vLLM follows the checkpoint's, cbrun asks for it). "none" (the default):
            weight-only, the activations stay in ``dtype``, so greedy tokens equal transformers' ``generate`` on the
            same weights dequantized. "dynamic": W8A8, each row of a linear's input rounded to float8_e4m3fn with
            its own scale (its largest magnitude / 448) and multiplied with the float8 weight by
            ``torch._scaled_mm`` (FP8 tensor cores on CUDA sm_89+; PyTorch's own code on the CPU). Lossy: greedy
            tokens are a reference's whose linears round their inputs so (but for near-ties), not the dequantized
            model's (docs/engine.md, "FP8 W8A8"). Every FP8 linear runs so except MoE experts, which stay
            weight-only.
            It needs an FP8 checkpoint with per-channel or per-tensor weight scales (compressed-tensors
            ``float-quantized``; not the 128 x 128 block ``fp8`` layout), ``dtype = "bfloat16"``, weights whose
            two dimensions are multiples of 16, compute capability 8.9+ on CUDA, ``tensor_parallel_size = 1`` and
            ``batch_invariant`` not "on": anything else is refused at load, by name.
        seed: seed of the engine's generator for requests without a seed of their own.
        cuda_graphs: replay decode and uniform verify steps from CUDA graphs, padded to batch-size buckets
            (``cbrun.engine.worker.padding``); other steps run eagerly. "auto" (on for CUDA with the Triton backend), "on",
            "off", or "emulate": the same graph path recorded and replayed op by op on any device and backend
            (``cbrun.engine.worker.graph_emulation``; for tests: slower than "off"). A model whose forward pass
            reads values back to the host (dynamic RoPE, transformers' MoE blocks) runs eager: "auto" turns
            graphs off saying why, "on" and "emulate" are refused.
        cuda_graph_max_batch_size: the largest batch-size bucket (SGLang's ``cuda_graph_max_bs``); decode steps
            with more requests run eagerly. None (the default) takes ``max_requests_per_batch``.
        async_batching: "auto" (on with CUDA graphs on a CUDA device, off with speculative decoding, which
            needs each step's tokens before the next plan), "on" or "off": plan and upload step N+1 while the
            device computes step N (see ``engine.async_batching``).
        num_threads: CPU intra-op threads for torch (``torch.set_num_threads``, process-wide): a positive int,
            "auto" (the default: 1 thread for a model under 10M parameters, whose ops are too small to split,
            else every physical core; torch's default on CUDA; see ``cbrun.engine.worker.threads.resolve_num_threads``), or None
            (keep the process's current setting). The C attention kernel takes the same count, except under
            "auto", where it uses every physical core (``cbrun.engine.worker.threads.resolve_attention_threads``).
        prefix_hash_bits: width of the prefix cache's block hash (SHA-256 cut to a multiple of 8 bits, default the
            full 256). Narrow widths exist for tests that force collisions; a collision is never served.
        model_impl: the forward pass. "lean" runs the lean-path families (``cbrun.engine.model.registry``: Llama,
            Mistral and Mixtral without sliding windows, Qwen2, Qwen3, Qwen3-MoE, gpt-oss) through their own forward
            pass (``cbrun.engine.model.models``): the same math and attention without transformers' per-module
            overhead, bit-identical logits; an unsupported model, or CUDA graphs on, is a ValueError.
            "transformers" always runs the transformers modules; "auto" takes lean where it applies.
        loader: who loads the model and tokenizer. "auto" (the default) reads a Llama-family checkpoint that the
            lean path runs straight from its files without importing transformers (``cbrun.engine.model.safetensors_loader``,
            ``cbrun.engine.core.tokenizer``: config.json, safetensors weights, tokenizer.json) and leaves everything else to
            transformers, as does "transformers" always. The log says which loader ran and why.
        linear_backend: the GEMM of the lean path's linear layers (``cbrun.engine.model.layers.linear``): "torch" (``F.linear``;
            logits bit-identical to transformers'), "onednn" (oneDNN's matmul, float32 on the CPU only, else a
            ValueError), or "auto": oneDNN for float32 CPU weights of at least 2^18 elements (2^17 where the
            safetensors loader packs them in oneDNN's layout at load), where it is faster, torch's for the rest.
            The transformers modules always use torch's.
        batch_invariant: "on" makes a row's logits the same bits whatever else is in its step, so that a seeded
            row draws the same tokens and logprobs alone or in any batch, under preemption and prefix sharing
            (docs/sampling.md, "Batch invariance"). On the CPU: linear layers through
            ``linear.batch_invariant_linear``, the MLP's silu and every attention query row in C, row by row (the C
            attention kernel, float32). With Triton attention (CUDA, compute capability 8.0+): cbrun's invariant
            Triton matmul and RMSNorm, attention's one invariant tile, each sampled row drawn in its own call, CUDA
            graphs off (docs/gpu.md). Either needs the lean forward pass, ``linear_backend = "auto"``,
            ``speculative = "off"``, ``tensor_parallel_size = 1`` and unquantized weights; MoE blocks run each
            expert over its own rows. Anything else is a ValueError naming it. "off" runs the fastest kernels,
            whose bits may change with the batch (by about 1e-5 in a logprob). "auto" (the default): a job turns it on when its rows are
            sampled and it can run (``cbrun.jobs.run.resolve.resolve_batch_invariant``), off for greedy-only jobs; the
            Python engine API takes "auto" as "off". Its logits differ from "off"'s by float32 rounding.
        speculative: speculative decoding (see ``cbrun.engine.spec_decode.speculative``): "off", "ngram" (prompt lookup: proposals
            copied from the request's own prompt and output) or "draft" (a small model with the same tokenizer,
            ``draft_model``, proposes; see ``cbrun.engine.spec_decode.draft_proposer``). Greedy outputs equal "off" token for
            token; sampled ones keep the distribution.
        draft_model: the draft model's directory (a transformers causal LM with the target's tokenizer), needed
            by ``speculative = "draft"``; its KV cache takes its share of every block of the same pool.
        num_speculative_tokens: most tokens proposed (and verified) per request per step (k); the cost rule
            proposes fewer where they do not pay. Default 8: on ``cbrun bench --workload speculative``'s
            story-repeat requests at batch 1, k = 4 took 9% more steps (399 against 366); 12 and 16 saved
            under 2% more and verified more rows.
        ngram_min, ngram_max: the n-gram lookup matches the last n tokens, longest n in [ngram_min, ngram_max] first.
            ngram_min default 1: single-token matches keep their own acceptance evidence (the cost rule gates
            them apart from longer ones); on story-repeat at batch 1 they took 340 steps against 368 with
            ngram_min 2 (``benchmarks/results-speculative-bound.md`` bounds both).
        speculative_max_batch: speculation runs only while at most this many requests are running; above it the
            engine decodes plainly (one token per request per step), where verification would cost more than it
            saves.
        speculative_row_cost: the cost of one more query row in a step, as a fraction of a step's fixed cost; the
            speculator proposes a token only when its chance of being accepted pays for its row
            (``cbrun.engine.spec_decode.speculative.verify_threshold``). 0 always proposes ``num_speculative_tokens``. The default
            is stories260K's: its step time grew by about 3% of a one-row step per extra query row on a 2-core
            CPU, one thread, with the C attention kernel; values from 0.03 to 0.06 ran equally fast in
            ``cbrun bench --workload speculative --engine speculative_row_cost=X``. A model whose per-row compute
            weighs more (a bigger model on a CPU) warrants a higher value, a GPU at small batches a lower one.
        tensor_parallel_size: ranks one replica is split over (vLLM's name), each its own process on its own
            device (``cuda:i`` from the given index on CUDA, NCCL; the CPU, gloo), started by the engine itself
            (``cbrun.engine.worker.tp_group``): the lean path's weights split as Megatron-LM does
            (``cbrun.engine.model.layers.parallel``), one scheduler on rank 0 whose plan every rank executes on its own
            slice of the KV cache. 1 (the default) runs one process. Above 1 it runs only the lean path loaded
            from safetensors (quantized weights too, each rank reading its slices of them, which must start on
            their blocks or groups), without speculation, CUDA graphs or ``batch_invariant``: anything else is a
            ValueError naming it.
        structured_outputs_backend: the grammar engine of JSON-schema constraints (vLLM's
            ``structured_outputs_config.backend``): "auto" (the default) gives a schema to xgrammar when it enforces
            every keyword of it, else to llguidance when that does (the ``guidance`` extra); "xgrammar" or
            "guidance" uses only that one. A schema the chosen engines would not fully enforce is the row's error,
            naming each such keyword and its place (``$.properties.a.not``); the table:
            ``docs/structured-outputs.md``. Regex, choice and grammar constraints are xgrammar's, llguidance's
            under "guidance".
        structured_outputs_ignore_formats: serve JSON schemas whose ``format`` values (``date-time``, ``uri``,
            ...) no engine here enforces, with those formats unchecked; false (the default) refuses them by name.

    Raises:
        SettingError: (a ``ValueError``) naming the setting and the reason, for a value of the wrong type or out of
            range; a job names it with its section (``engine.page_size``).
    """

    page_size: int | None = None
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_requests_per_batch: int | None = None
    scheduler_type: str = "fifo"
    safety_margin: float | None = None
    max_memory_percent: float = 0.5
    gpu_memory_utilization: float = 0.9
    allow_block_sharing: bool = True
    cpu_offload_space: float = 0.0
    dtype: str = "auto"
    device: str = "cpu"
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    fp8_activation_scheme: str = "none"
    seed: int = 0
    cuda_graphs: str = "auto"
    cuda_graph_max_batch_size: int | None = None
    async_batching: str = "auto"
    num_threads: int | str | None = "auto"
    model_impl: str = "auto"
    loader: str = "auto"
    linear_backend: str = "auto"
    batch_invariant: str = "auto"
    prefix_hash_bits: int = 256
    speculative: str = "off"
    draft_model: str | None = None
    num_speculative_tokens: int = 8
    ngram_min: int = 1
    ngram_max: int = 4
    speculative_max_batch: int = 16
    speculative_row_cost: float = 0.03
    tensor_parallel_size: int = 1
    structured_outputs_backend: str = "auto"
    structured_outputs_ignore_formats: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.device, str):
            raise must_be("device", 'a device name ("cpu", "cuda", "cuda:1", "auto")', self.device)
        self._resolve_device_defaults()
        self._check_counts()
        self._check_choices()
        self._check_memory_shares()
        if self.kv_cache_dtype != "auto" and self.attention_backend in ("cpu", "triton"):
            raise SettingError(
                "{kv_cache_dtype} = {value} runs attention on the PyTorch reference (the {backend} kernels read "
                "K/V in the model's dtype); set {attention_backend} = auto or torch",
                value=self.kv_cache_dtype,
                backend=self.attention_backend,
            )
        if self.fp8_activation_scheme != "none" and self.batch_invariant == "on":
            raise SettingError(
                '{fp8_activation_scheme} = "{value}" does not run with {batch_invariant} = on (torch._scaled_mm\'s '
                'sums are not batch-invariant); set one of them off ({fp8_activation_scheme} = "none", or '
                '{batch_invariant} = "auto" or "off")',
                value=self.fp8_activation_scheme,
            )
        if not _is_int(self.prefix_hash_bits) or self.prefix_hash_bits % 8 or not 8 <= self.prefix_hash_bits <= 256:
            raise must_be("prefix_hash_bits", "a multiple of 8 in [8, 256]", self.prefix_hash_bits)
        for name in ("allow_block_sharing", "structured_outputs_ignore_formats"):
            if not isinstance(getattr(self, name), bool):
                raise must_be(name, "true or false", getattr(self, name))
        if not _is_int(self.seed):
            raise must_be("seed", "an integer", self.seed)
        self._check_speculative()
        self._check_tensor_parallel()

    def _check_counts(self) -> None:
        """The settings that count something (tokens, requests, blocks, threads) are positive integers where set."""
        for name in ("page_size", "max_batch_tokens", "max_requests_per_batch"):
            if getattr(self, name) is not None:  # None only while the device is "auto"
                self._check_positive_int(name)
        for name in ("num_blocks", "cuda_graph_max_batch_size"):
            if getattr(self, name) is not None:
                self._check_positive_int(name)
        if self.num_threads not in (None, "auto"):
            if isinstance(self.num_threads, str):
                raise must_be("num_threads", "a positive integer or 'auto'", self.num_threads)
            self._check_positive_int("num_threads")

    def _check_choices(self) -> None:
        """The settings that name one of a fixed set of choices (``_CHOICES``) name one of them."""
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise must_be(name, f"one of {choices}", value)

    def _check_memory_shares(self) -> None:
        """The shares of memory the engine may take or keep free lie in their ranges; ``safety_margin`` left None
        takes its scheduler's default (FIFO 0.15, PrefillFirst 0.0)."""
        if self.safety_margin is None:
            self.safety_margin = 0.15 if self.scheduler_type == "fifo" else 0.0
        if not _is_number(self.safety_margin) or not 0.0 <= self.safety_margin < 1.0:
            raise must_be("safety_margin", "in [0, 1)", self.safety_margin)
        for name in ("max_memory_percent", "gpu_memory_utilization"):
            if not _is_number(getattr(self, name)) or not 0.0 < getattr(self, name) <= 1.0:
                raise must_be(name, "in (0, 1]", getattr(self, name))
        if not _is_number(self.cpu_offload_space) or self.cpu_offload_space < 0:
            raise must_be("cpu_offload_space", "a number >= 0 (GiB)", self.cpu_offload_space)

    @property
    def limits(self) -> BatchLimits:
        """The device-dependent settings with the device's defaults filled in.

        Raises:
            AssertionError: while ``device`` is "auto": the job resolves the device before it builds an engine
                (``cbrun.jobs.run.resources.resolve_device``), so an engine never sees "auto".
        """
        page_size, max_tokens, max_requests = self.page_size, self.max_batch_tokens, self.max_requests_per_batch
        assert page_size is not None and max_tokens is not None and max_requests is not None, (
            f"device {self.device!r} is not resolved"
        )
        assert self.safety_margin is not None  # set by __post_init__
        return BatchLimits(page_size, max_tokens, max_requests, self.safety_margin)

    def resolve_dtype(self, checkpoint: str | None) -> str:
        """The dtype the engine runs in: ``dtype`` unless "auto", which is ``checkpoint`` on CUDA (float32
        when the checkpoint states none) and float32 on the CPU (its kernels and GEMMs are float32).

        Args:
            checkpoint: config.json's ``dtype`` / ``torch_dtype`` as a name ("bfloat16"), or None.
        """
        if self.dtype != "auto":
            return self.dtype
        if self.device.startswith("cuda") and checkpoint in ("float32", "bfloat16", "float16"):
            return checkpoint
        return "float32"

    def _resolve_device_defaults(self) -> None:
        """Fill ``page_size``, ``max_requests_per_batch`` and ``max_batch_tokens`` left None with the device's
        defaults. A job's manifest says device "auto" until ``cbrun.jobs.run.resources.resolve_device`` picks one; those stay
        None until then, so that ``dataclasses.replace(config, device=...)`` takes the defaults of the device the
        job runs on, not the CPU's."""
        if self.device == "auto":
            return
        device_type = "cuda" if self.device.startswith("cuda") else "cpu"
        default_requests, default_tokens = DEFAULT_BATCH_LIMITS[device_type]
        if self.page_size is None:
            self.page_size = DEFAULT_PAGE_SIZE[device_type]
        if self.max_requests_per_batch is None:
            self.max_requests_per_batch = default_requests
        if self.max_batch_tokens is None:
            self.max_batch_tokens = default_tokens

    def _check_speculative(self) -> None:
        if self.speculative not in SPECULATIVE_METHODS:
            raise must_be("speculative", f"one of {SPECULATIVE_METHODS}", self.speculative)
        if self.speculative == "draft" and not self.draft_model:
            raise SettingError('{speculative} = "draft" needs a draft model: set {draft_model} to its directory')
        if self.draft_model is not None and not isinstance(self.draft_model, str):
            raise must_be("draft_model", "a directory path", self.draft_model)
        if self.draft_model is not None and self.speculative != "draft":  # silently unused otherwise
            raise SettingError(
                '{draft_model} is set but {speculative} = "{value}": set {speculative} = "draft" to use it, or leave '
                "{draft_model} unset",
                value=self.speculative,
            )
        for name in ("num_speculative_tokens", "ngram_min", "ngram_max", "speculative_max_batch"):
            self._check_positive_int(name)
        row_cost = self.speculative_row_cost
        if not _is_number(row_cost) or not 0 <= row_cost < float("inf"):
            raise must_be("speculative_row_cost", "a number >= 0", row_cost)
        if self.ngram_min > self.ngram_max:
            raise SettingError(
                "{ngram_min} ({low}) must be <= {ngram_max} ({high})", low=self.ngram_min, high=self.ngram_max
            )

    def _check_tensor_parallel(self) -> None:
        """Refuse, by name, what a tensor-parallel replica does not run (the lean path is its only forward pass)."""
        self._check_positive_int("tensor_parallel_size")
        if self.tensor_parallel_size == 1:
            return
        unsupported = {
            "speculative": self.speculative != "off",
            "model_impl": self.model_impl == "transformers",
            "loader": self.loader == "transformers",
            "cuda_graphs": self.cuda_graphs in ("on", "emulate"),
            "async_batching": self.async_batching == "on",
            # NOTE: "auto" is resolved by the job (backends.batch_invariant_blocker: off, saying why)
            "batch_invariant": self.batch_invariant == "on",
            "kv_cache_dtype": self.kv_cache_dtype != "auto",
        }
        if self.fp8_activation_scheme != "none":
            raise SettingError(
                '{tensor_parallel_size} = {size} does not run with {fp8_activation_scheme} = "{value}": a '
                "row-parallel linear (o_proj, down_proj) would scale each row of its input over one rank's slice only, "
                'not as one rank does; set {fp8_activation_scheme} = "none" or {tensor_parallel_size} = 1',
                size=self.tensor_parallel_size,
                value=self.fp8_activation_scheme,
            )
        for name, refused in unsupported.items():
            if refused:
                setting = "{" + name + "}"
                raise SettingError(
                    "{tensor_parallel_size} = {size} does not run with " + setting + " = {value!r} (a tensor-parallel "
                    "replica runs only the lean path, loaded from safetensors, without speculation, CUDA graphs or "
                    "batch_invariant); leave " + setting + " at its default or set {tensor_parallel_size} = 1",
                    size=self.tensor_parallel_size,
                    value=getattr(self, name),
                )

    def _check_positive_int(self, name: str) -> None:
        value = getattr(self, name)
        if not _is_int(value) or value < 1:
            raise must_be(name, "a positive integer", value)


def _is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (``True`` and ``False`` are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """Whether ``value`` is an integer or a float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def checkpoint_dtype(model_path: str | Path) -> str | None:
    """config.json's ``dtype`` (transformers 5) or ``torch_dtype`` (older files), or its text config's; None when
    it states none or cannot be read (the loader reports a missing or bad config.json itself)."""
    try:
        raw = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (raw, raw.get("text_config") or {}):
        value = section.get("dtype") or section.get("torch_dtype")
        if isinstance(value, str):
            return value.removeprefix("torch.")
    return None
