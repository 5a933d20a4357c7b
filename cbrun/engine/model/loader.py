"""Loading a model directory for the engine: which loader runs (the safetensors loader, without transformers, or
transformers), the target and draft models, the tokenizer, and what the engine reads from the model's config
(maximum length, EOS ids, KV heads and head size)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import torch

from cbrun.engine.config import EngineConfig, checkpoint_dtype
from cbrun.engine.core.kv_layout import KVLayout
from cbrun.engine.core.tokenizer import load_tokenizer
from cbrun.engine.model import hugepages, registry, safetensors_loader
from cbrun.engine.model.layers import attention_contract, parallel
from cbrun.engine.model.layers.attention import ATTN_IMPLEMENTATION, register_with_transformers
from cbrun.engine.model.layers.linear import pack_for_onednn, packs_for_onednn
from cbrun.engine.model.layers.quantization.fp8 import w8a8_checkpoint_refusal
from cbrun.engine.setting_error import SettingError
from cbrun.engine.spec_decode.draft_proposer import check_draft_vocab
from cbrun.engine.worker.backends import cuda_graphs_blocker, use_triton
from cbrun.engine.worker.device import select_device
from cbrun.engine.worker.threads import resolve_num_threads
from cbrun.kernels.fp8_scaled_mm import W8A8_TEMPLATE
from cbrun.kernels.tile_policy import MAX_HEAD_DIM

logger = logging.getLogger("cbrun.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(model_path: str, config: EngineConfig, shard: parallel.TensorParallelWeights | None = None):
    """The causal LM of a local directory as ``LLMEngine.from_pretrained`` loads it, torch's threads set first.

    Read by ``cbrun.engine.model.safetensors_loader`` where it applies (a ``LeanModel``, transformers not imported), else by
    transformers with cbrun's attention. ``config.num_threads``: an int is set before loading, "auto" is resolved
    after it from the model's parameter count (``cbrun.engine.worker.threads.resolve_num_threads``), None leaves torch's.
    ``shard``: a tensor-parallel rank's share; only its slices are read (``tensor_parallel_plan`` must accept the
    model). The weights the lean path will run on oneDNN are packed (``_pack_onednn_weights``), and large weights on
    the CPU are then moved to transparent huge pages (``cbrun.engine.model.hugepages``).
    ``config.dtype`` is resolved already (``resolve_engine_dtype``, where the settings enter the engine).

    Raises:
        as ``LLMEngine.from_pretrained``; ``tensor_parallel_plan``'s ValueError with a shard;
        ``check_fp8_activation_scheme``'s, before any weight is read.
    """
    assert config.dtype != "auto", "resolve_engine_dtype first: the dtype is decided once, where the settings enter"
    check_fp8_activation_scheme(model_path, config)
    select_device(config.device)
    if isinstance(config.num_threads, int):
        torch.set_num_threads(config.num_threads)
    if shard is not None:
        model = safetensors_loader.load(tensor_parallel_plan(model_path, config), config.device, shard)
    else:
        model = _load_target_model(model_path, config)
    _pack_onednn_weights(model, config)  # first: a packed weight's original is freed, not moved to the arena
    hugepages.place_on_huge_pages(model.parameters())  # the CPU's large weights; nothing on a GPU
    if config.num_threads == "auto":
        threads = resolve_num_threads("auto", sum(p.numel() for p in model.parameters()), config.device)
        if threads is not None:
            torch.set_num_threads(threads)
    return model


def _pack_onednn_weights(model, config: EngineConfig) -> None:
    """In a model the safetensors loader read (whose weights nothing else holds), each projection weight that the
    lean path will run on oneDNN (``packs_for_onednn`` under ``engine.linear_backend``) is replaced by its packed copy
    (``pack_for_onednn``) and its old pages given back (``hugepages.releasing_old_copies``). Nothing is packed under
    ``batch_invariant = on``, whose linear reads the weights as they are, nor in a transformers model, whose modules
    keep their own tensors (a packed copy would be a second one).

    Raises:
        ValueError: ``linear_backend = onednn`` where oneDNN cannot run a weight (``packs_for_onednn``).
    """
    if not isinstance(model, safetensors_loader.LeanModel) or config.batch_invariant == "on":
        return
    backend = config.linear_backend
    with hugepages.releasing_old_copies() as release:

        def packed(weight: torch.Tensor) -> torch.Tensor:
            if not packs_for_onednn(weight, backend):
                return weight
            copy = pack_for_onednn(weight)
            release(weight.data_ptr(), weight.nbytes)  # its pages in safetensors' file mapping
            return copy

        count = model.weights.replace_dense_weights(packed)
    if count:
        logger.info("oneDNN linear layers: %d weights packed at load (oneDNN's blocked layout)", count)


def check_fp8_activation_scheme(model_path: str, config: EngineConfig) -> None:
    """Refuse ``engine.fp8_activation_scheme = "dynamic"`` where it cannot run, from config.json and the settings
    (``fp8.w8a8_checkpoint_refusal``: a checkpoint with no FP8 weight, the 128 x 128 block layout, a CUDA part
    below sm_89, a dtype other than bfloat16), before any weight is read; each weight is checked again as the
    forward pass takes it (``fp8.check_w8a8``).

    Raises:
        ValueError: naming the setting and why; a quantized layout cbrun does not implement, by
            ``checkpoint_quantization``'s refusal.
    """
    if config.fp8_activation_scheme == "none":
        return
    quantization = registry.checkpoint_quantization(model_path)
    reason = w8a8_checkpoint_refusal(quantization, torch.device(config.device), _DTYPES[config.dtype])
    if reason:
        raise SettingError(W8A8_TEMPLATE + " {reason}", reason=reason)


def resolve_engine_dtype(model_path: str, config: EngineConfig) -> EngineConfig:
    """``config`` with ``dtype = "auto"`` replaced by the dtype it means for this checkpoint and device
    (``EngineConfig.resolve_dtype``: config.json's ``dtype`` / ``torch_dtype`` on CUDA, float32 on the CPU)."""
    if config.dtype != "auto":
        return config
    return replace(config, dtype=config.resolve_dtype(checkpoint_dtype(model_path)))


def tensor_parallel_plan(model_path: str, config: EngineConfig) -> safetensors_loader.LoadPlan:
    """The safetensors load plan of a model a tensor-parallel replica can split (the lean path is the only one
    split).

    Raises:
        ValueError: naming ``tensor_parallel_size`` and why, when the model would load through transformers, its
            shapes do not split over the ranks (``cbrun.engine.model.layers.parallel.unsupported_reason``: its
            heads or experts, or the first tensor whose MLP width does not split), its family is not split
            (``ModelFamily.unsupported_parallel_reason``) or a
            quantized weight's slices would not start on its layout's blocks, groups or packed words
            (``parallel.unsupported_quantized_reason``: the tensor, its size and the unit); a quantized layout
            cbrun does not implement, by ``checkpoint_quantization``'s refusal.
    """
    size = config.tensor_parallel_size
    registry.checkpoint_quantization(model_path)  # an unimplemented layout: its own refusal, as with one rank
    reason = _needs_transformers(config)
    plan = None
    if reason is None:
        plan, reason = safetensors_loader.load_plan(model_path, config.dtype)
    if plan is None:
        raise ValueError(
            f"tensor_parallel_size = {size} runs only the lean path loaded from safetensors, and this model "
            f"would load through transformers: {reason}; set tensor_parallel_size = 1"
        )
    family = registry.family_of(plan.config)
    shapes = family.checkpoint_shapes(plan.config)
    reason = family.unsupported_parallel_reason(plan.config) or parallel.unsupported_reason(
        plan.config, shapes, family.shard_style, size
    )
    if reason is None and plan.config.quantization is not None:
        weights = {name: shapes[name] for name in plan.quantized}
        reason = parallel.unsupported_quantized_reason(plan.config, weights, family.shard_style, size)
    if reason is not None:
        raise ValueError(f"tensor_parallel_size = {size} cannot split this model: {reason}")
    return plan


def _load_target_model(model_path: str, config: EngineConfig):
    """The model, read by ``cbrun.engine.model.safetensors_loader`` where it applies (a ``LeanModel``), else by
    transformers.

    Raises:
        ValueError: a quantized checkpoint whose layout cbrun does not implement
            (``cbrun.engine.model.registry.checkpoint_quantization``), or one it implements that would load
            through transformers (which dequantizes FP8 to bfloat16 at load on the CPU: not the checkpoint's
            weights as the lean path computes them).
    """
    quantization = registry.checkpoint_quantization(model_path)
    reason = _needs_transformers(config)
    plan = None
    if reason is None:
        plan, reason = safetensors_loader.load_plan(model_path, config.dtype)
    if plan is not None:
        logger.info(
            "model loader: safetensors, without transformers (engine.safetensors_loader)%s",
            f"; {quantization.method} quantized weights kept quantized" if quantization else "",
        )
        return safetensors_loader.load(plan, config.device)
    if quantization is not None:
        raise ValueError(
            f"config.json's quantization_config ({quantization.method}) runs only on cbrun's lean path loaded "
            f"from safetensors, and this model would load through transformers: {reason}"
        )
    logger.info("model loader: transformers (%s)", reason)
    return _load_model(model_path, config)


def _needs_transformers(config: EngineConfig) -> str | None:
    """Why this engine needs transformers' modules whatever the checkpoint (None: the lean pass may run alone)."""
    if config.loader == "transformers":
        return "engine.loader = transformers"
    if config.model_impl == "transformers":
        return "model_impl = transformers runs transformers' modules"
    if config.speculative == "draft":
        return "speculative = draft: the draft model runs beside transformers' target"
    if config.cuda_graphs == "emulate" or (
        config.cuda_graphs != "off" and cuda_graphs_blocker(config, use_triton(config)) is None
    ):
        return "CUDA graphs capture transformers' forward pass"
    return None


def _load_model(model_path: str, config: EngineConfig) -> torch.nn.Module:
    """A local transformers causal LM with cbrun's attention, in ``config.dtype`` on ``config.device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = "auto" if config.dtype == "auto" else _DTYPES[config.dtype]
    # Refused before any weight is read: MLA, chunked or bidirectional attention, non-attention layer kinds.
    attention_contract.check_config(AutoConfig.from_pretrained(model_path, local_files_only=True))
    register_with_transformers()
    # NOTE: on CUDA the weights are read straight onto the device in ``dtype`` (one device, so no accelerate
    # dispatch): no host copy of the whole model. The CPU keeps transformers' default placement.
    placement = {"device_map": torch.device(config.device)} if torch.device(config.device).type == "cuda" else {}
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            model_path,
            dtype=dtype,
            attn_implementation=ATTN_IMPLEMENTATION,
            local_files_only=True,
            output_loading_info=True,
            **placement,
        )
    except KeyError as exc:
        if ATTN_IMPLEMENTATION not in str(exc):
            raise _not_a_causal_lm(model_path, exc) from exc
        # Older modules pick their attention class from a table by name (GIT): they never call the registered
        # attention function, so cbrun's attention cannot run them.
        raise attention_contract.refusal(
            "token mixing other than one attention per layer",
            f"{type(exc).__name__} {exc}: the model picks its own attention classes by name, with none for cbrun's",
        ) from exc
    except (OSError, MemoryError, torch.OutOfMemoryError):  # a missing file, or no room: said as they are
        raise
    except Exception as exc:  # noqa: BLE001 - whatever transformers' own classes raise on this checkpoint
        raise _not_a_causal_lm(model_path, exc) from exc
    _check_all_weights_read(model, loading)
    _check_causal_decoder(model)
    model = model.to(config.device).eval()
    check_attention(model, config)
    return model


def _check_all_weights_read(model: torch.nn.Module, loading: dict) -> None:
    """Refuse a model some of whose weights the checkpoint does not hold: transformers leaves them at their random
    initial values (an Emu3 checkpoint read by ``Emu3ForCausalLM``, whose names lack the ``text_model.`` prefix).

    Raises:
        ValueError: naming how many weights are missing and the first few.
    """
    missing = sorted(loading.get("missing_keys") or ())
    if missing:
        raise ValueError(
            f"the checkpoint lacks {len(missing)} of {type(model).__name__}'s weights ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): transformers would run them at random initial values"
        )


def _not_a_causal_lm(model_path: str, exc: Exception) -> ValueError:
    """The refusal of a checkpoint transformers' ``AutoModelForCausalLM`` cannot build (MusicGen's whole model: its
    causal-LM class takes the decoder's config only)."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return ValueError(
        f"transformers cannot load {model_path} as a causal LM ({type(exc).__name__}: {first}); cbrun runs the "
        "decoder-only causal LMs transformers' AutoModelForCausalLM loads"
    )


def check_attention(model: torch.nn.Module, config: EngineConfig) -> None:
    """Refuse a transformers model whose attention asks for a feature cbrun does not implement
    (``cbrun.engine.model.layers.attention_contract.check_transformers_model``: one probe forward pass of four tokens).

    Raises:
        UnsupportedAttention (a ValueError): naming the feature.
    """
    text_config = attention_contract.text_config(model.config)
    attention_contract.check_transformers_model(
        model,
        KVLayout.from_model_config(text_config),
        kv_shape(text_config),
        MAX_HEAD_DIM if use_triton(config) else None,
    )


def _check_causal_decoder(model: torch.nn.Module) -> None:
    """Refuse models whose attention is not causal: the paged cache serves decoder-only generation only."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; cbrun runs decoder-only causal LMs")
    for name, module in model.named_modules():
        # Named first: a decoder's cross-attention is also non-causal, and the clearer name of the two.
        if attention_contract.is_cross_attention(name, module):
            raise attention_contract.refusal("cross-attention", f"module {name!r} of {type(model).__name__}")
    for name, module in model.named_modules():
        if getattr(module, "is_causal", True) is False:
            raise ValueError(
                f"{type(model).__name__} has bidirectional (non-causal) attention in {name!r}; "
                "cbrun runs decoder-only causal LMs"
            )


def load_draft_model(config: EngineConfig, target: torch.nn.Module, tokenizer, max_model_len: int) -> torch.nn.Module:
    """The draft model of ``config.draft_model``, checked against the target.

    Raises:
        OSError: when the directory is missing or unreadable.
        ValueError: for another vocabulary (``check_draft_vocab``) or a shorter maximum length than the target's,
            or a quantized draft (a draft loads through transformers, which would not run it as cbrun's lean path).
    """
    quantization = registry.checkpoint_quantization(config.draft_model)
    if quantization is not None:
        raise ValueError(
            f"the draft model's config.json has a quantization_config ({quantization.method}): a draft model "
            "loads through transformers, which cbrun does not run quantized checkpoints on; use an unquantized draft"
        )
    draft = _load_model(config.draft_model, config)
    check_draft_vocab(
        target.config.get_text_config().vocab_size,
        draft.config.get_text_config().vocab_size,
        tokenizer,
        load_tokenizer_or_none(config.draft_model, config.loader),
    )
    if model_max_len(draft.config) < max_model_len:
        raise ValueError(
            f"the draft model's maximum length {model_max_len(draft.config)} is below the target's "
            f"{max_model_len}: it could not propose near the end of long requests"
        )
    return draft


def load_tokenizer_or_none(model_path: str, loader: str = "auto"):
    """The model directory's tokenizer (``cbrun.engine.core.tokenizer.load_tokenizer``), or None when it has none (stop
    strings are then unavailable)."""
    try:
        return load_tokenizer(model_path, loader=loader)
    except (OSError, ValueError, TypeError, ImportError):  # ImportError: a tokenizer class's optional package
        logger.info("no tokenizer in %s: stop strings are unavailable", model_path)
        return None


def kv_shape(model_config) -> tuple[int, int]:
    num_heads = model_config.num_attention_heads
    num_kv_heads = getattr(model_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // num_heads
    return num_kv_heads, head_dim


def model_max_len(model_config) -> int:
    text_config = model_config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text_config, name, None)
        if value:
            return int(value)
    raise ValueError("the model config states no maximum length (max_position_embeddings / n_positions)")


def eos_token_ids(model_path: str, model_config) -> set[int]:
    """generation_config.json's ``eos_token_id`` (what transformers' ``GenerationConfig`` reads), else the model
    config's; a missing or unreadable file counts as stating none."""
    try:
        eos = json.loads((Path(model_path) / "generation_config.json").read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        eos = None
    if eos is None:
        # A composite (multimodal) config may state it only on its text config.
        eos = getattr(model_config, "eos_token_id", None)
        if eos is None and hasattr(model_config, "get_text_config"):
            eos = getattr(model_config.get_text_config(), "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(t) for t in eos}
