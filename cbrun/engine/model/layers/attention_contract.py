"""What cbrun's attention implements, and the load-time check that refuses a model asking for anything else.

Both paths attend through ``cbrun.engine.model.layers.attention.paged_attention`` (reference, C or Triton kernel); the
lean path runs the registered families only (each refuses every config key it does not read), so the transformers
path is where a model can bring features. The contract is data: ``IMPLEMENTED`` lists what the kernels do,
``HOOK_KWARGS`` the keyword arguments the transformers hook reads and those it may ignore because they do not
change attention. Anything else is refused by name, at load (``check_transformers_model``: exit 2 in a job, before
any row runs) and again at call time in the hook (``check_hook_kwargs``), so no model ever runs with a feature
dropped.

The load check reads the config (multi-head latent attention, layer kinds, chunked or bidirectional attention),
then runs one probe forward pass of four tokens in which the hook, handed an ``AttentionProbe`` instead of the
step's metadata, records each call (layer, query/key/value shapes, keyword arguments, mask) and returns plain
causal attention. The records show what no config key says: layers whose token mixing is not attention
(state-space, recurrent, convolution: they never call the hook), a mask or bias the model built itself (ALiBi),
key and value head sizes that differ, a sliding window the config's layer kinds do not announce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: The attention features cbrun implements, in every backend (PyTorch reference, C CPU kernel, Triton kernel).
IMPLEMENTED = {
    "causal": "decoder-only causal attention over the paged KV cache",
    "grouped-query attention": "num_heads a multiple of num_key_value_heads (MQA: one KV head)",
    "scaling": "any softmax scale the module passes (`scaling`), head_dim ** -0.5 when it passes none",
    "sliding window": "per layer, from config.layer_types / sliding_window (the window includes the token itself)",
    "soft-capping": "scores become softcap * tanh(scores / softcap) (`softcap`, Gemma 2)",
    "attention sinks": "a learned per-head logit in the softmax denominator (`s_aux`, gpt-oss)",
    "head sizes": "query, key and value heads of one size; 1..256 on the Triton kernel, any on the CPU",
}

#: Hook keyword arguments cbrun reads (see ``paged_attention_forward``).
READ_KWARGS = frozenset({"scaling", "dropout", "sliding_window", "softcap", "s_aux", "cbrun_metadata"})
#: Hook keyword arguments that do not change attention as cbrun runs it (positions come from the metadata).
INERT_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "output_attentions",
        "past_key_values",
        "past_key_value",
        "position_embeddings",
        "layer_idx",
        "return_dict",
        "logits_to_keep",
        "output_hidden_states",
        "output_router_logits",  # MoE training outputs (gpt-oss passes it on to every attention call)
    }
)
#: Layer kinds of ``config.layer_types`` whose attention cbrun implements.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
#: Config keys that ask for a feature cbrun does not implement, when set (not None / False / 0).
REFUSED_CONFIG_KEYS = {
    "kv_lora_rank": "multi-head latent attention",
    "q_lora_rank": "multi-head latent attention",
    "attention_chunk_size": "chunked attention",
    "use_bidirectional_attention": "bidirectional (non-causal) attention",
    "alibi": "ALiBi position bias",
    "position_embedding_type": "position embeddings other than rotary/absolute",
    "add_cross_attention": "cross-attention",
}
#: Config keys that shape a layer's attention or its KV cache: cbrun's cache has one shape, and one sliding window,
#: for every layer.
SHAPE_KEYS = frozenset(
    {
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_size",
        "qk_rope_head_dim",
        "v_head_dim",
        "sliding_window",
    }
)
#: Module names transformers' families give cross-attention (BART's decoders, BERT's, Mllama's image layers).
CROSS_ATTENTION_NAMES = frozenset({"encoder_attn", "crossattention", "cross_attn", "cross_attention"})
MLA_MESSAGE = (
    "multi-head latent attention is not implemented (config.kv_lora_rank: DeepSeek-V2/V3, Kimi-K2 family); "
    "cbrun's KV cache holds full per-head keys and values, not the latent"
)
#: Tokens of the load-time probe forward pass.
PROBE_TOKENS = 4


class UnsupportedAttention(ValueError):
    """A model asks for an attention feature cbrun does not implement (a ValueError: exit 2 at a job's setup)."""


def refusal(feature: str, detail: str) -> UnsupportedAttention:
    """The error for one unimplemented ``feature``, with what in the model asks for it."""
    return UnsupportedAttention(
        f"attention feature not implemented: {feature} ({detail}); cbrun refuses the model rather than run it "
        "wrong (docs/models.md)"
    )


def check_config(config) -> None:
    """Refuse a config that asks for an attention feature outside the contract.

    Args:
        config: a transformers ``PretrainedConfig`` (its text config is read).

    Raises:
        UnsupportedAttention: naming the feature and the config key.
    """
    text = text_config(config)
    if any(_layer_values(text, "kv_lora_rank")):
        raise UnsupportedAttention(MLA_MESSAGE)
    _check_per_layer_shapes(text)
    if not hasattr(text, "num_attention_heads"):
        raise refusal(
            "token mixing other than one attention per layer",
            f"{type(text).__name__} has no num_attention_heads (a recurrent or state-space model)",
        )
    # MPT keeps its attention options in a sub-config (config.attn_config.alibi, on by default).
    if getattr(getattr(text, "attn_config", None), "alibi", False):
        raise refusal("ALiBi position bias", "config.attn_config.alibi = True")
    for key, feature in REFUSED_CONFIG_KEYS.items():
        value = next((v for v in _layer_values(text, key) if v), None)
        if key == "position_embedding_type" and value in (None, "absolute", "rope", "rotary"):
            continue
        if value:
            raise refusal(feature, f"config.{key} = {value!r}")
    for i, kind in enumerate(getattr(text, "layer_types", None) or ()):
        if i < text.num_hidden_layers and kind not in ATTENTION_LAYER_TYPES:
            raise refusal(
                f"{kind} layers", f"config.layer_types[{i}] = {kind!r}; cbrun runs full and sliding attention"
            )


def text_config(config):
    """The decoder's config of ``config`` (itself, or a composite model's text config).

    Raises:
        UnsupportedAttention: a composite config with more than one text config (MusicGen: a T5 text encoder beside
            its audio-codebook decoder), which is no one decoder-only causal LM.
    """
    if not hasattr(config, "get_text_config"):
        return config
    try:
        return config.get_text_config()
    except ValueError as exc:  # transformers: "Multiple valid text configs were found ..."
        raise refusal(
            "a model of several text models",
            f"{type(config).__name__}: {_first_line(exc)}; cbrun runs one decoder-only causal LM",
        ) from exc


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def is_cross_attention(name: str, module: torch.nn.Module) -> bool:
    """Whether the module ``name`` attends over another sequence (an encoder's, or an image's): transformers'
    cross-attention flag, or the names its families give such modules."""
    return bool(getattr(module, "is_cross_attention", False)) or name.rsplit(".", 1)[-1] in CROSS_ATTENTION_NAMES


def _layer_values(text, key: str) -> list:
    """``text.<key>``, once per layer where the config sets it per layer (transformers' heterogeneous configs:
    ``per_layer_config``, whose global value of such a key cannot be read), else once."""
    if key in (getattr(text, "per_layer_attributes", None) or ()):
        return [getattr(layer, key, None) for layer in text.per_layer_config]
    return [getattr(text, key, None)]


def _check_per_layer_shapes(text) -> None:
    """Refuse a config whose layers differ in an attention shape or window (``per_layer_config``: Gemma 4's wider
    full-attention heads): cbrun's KV cache holds one (KV heads, head size) and one window for every layer."""
    varying = sorted(SHAPE_KEYS & set(getattr(text, "per_layer_attributes", None) or ()))
    if varying:
        values = {key: sorted({str(v) for v in _layer_values(text, key)}) for key in varying}
        raise refusal(
            "attention shapes or windows that differ between layers",
            "config.per_layer_config sets " + "; ".join(f"{k} to {', '.join(v)}" for k, v in values.items()),
        )


def check_hook_kwargs(kwargs: dict, dropout: float) -> None:
    """Refuse, at call time, a keyword argument of transformers' attention call that the hook does not implement.

    Args:
        kwargs: the call's keyword arguments beyond those the hook names.
        dropout: the call's attention dropout (must be 0: the engine runs in eval mode).

    Raises:
        UnsupportedAttention: naming the argument.
    """
    if dropout:
        raise refusal("attention dropout", f"dropout = {dropout!r}: the model is in training mode")
    if kwargs.get("is_causal", True) is False:
        raise refusal("bidirectional (non-causal) attention", "is_causal = False")
    for name, value in kwargs.items():
        if name in INERT_KWARGS or name == "is_causal" or value is None:
            continue
        raise refusal(f"the attention argument {name!r}", f"{type(value).__name__} passed to the attention function")


@dataclass
class ProbeCall:
    """One attention call seen by the probe: the module's ``layer_idx``, (heads, head_dim) of q, k and v, the
    keyword arguments with a value, and whether a mask came with it."""

    layer_idx: int | None
    q: tuple[int, int]
    k: tuple[int, int]
    v: tuple[int, int]
    kwargs: dict
    has_mask: bool


@dataclass
class AttentionProbe:
    """Passed as ``cbrun_metadata`` for the load-time probe: the hook records its calls here instead of attending
    over the cache."""

    calls: list[ProbeCall] = field(default_factory=list)

    def attend(self, module, query, key, value, attention_mask, scaling, sinks, kwargs) -> torch.Tensor:
        """Record the call; return causal attention (1, T, H, Dv), shaped as the model expects (its values are not
        read)."""
        self.calls.append(
            ProbeCall(
                getattr(module, "layer_idx", None),
                (query.shape[1], query.shape[-1]),
                (key.shape[1], key.shape[-1]),
                (value.shape[1], value.shape[-1]),
                {k: v for k, v in kwargs.items() if v is not None},
                attention_mask is not None,
            )
        )
        heads, num_kv = query.shape[1], max(key.shape[1], 1)
        if heads % num_kv or query.shape[-1] != key.shape[-1]:
            out = query.new_zeros(query.shape[0], query.shape[2], heads, value.shape[-1])
            return out
        repeat = heads // num_kv
        k = key.repeat_interleave(repeat, dim=1)
        v = value.repeat_interleave(repeat, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
        return out.transpose(1, 2)


def check_transformers_model(model: torch.nn.Module, layout, kv_shape: tuple[int, int], max_head_dim: int | None):
    """Refuse a loaded transformers model whose attention asks for anything outside the contract.

    Args:
        model: the causal LM, loaded with cbrun's attention implementation, on its device, in eval mode.
        layout: its ``cbrun.engine.core.kv_layout.KVLayout`` (which layers slide, and the window).
        kv_shape: (num_kv_heads, head_dim) the KV cache will be built with (``loader.kv_shape``).
        max_head_dim: the largest head size the attention backend takes (None: any).

    Raises:
        UnsupportedAttention: naming the feature and where the model asks for it.
    """
    check_config(model.config)
    for name, module in model.named_modules():
        if is_cross_attention(name, module):
            raise refusal("cross-attention", f"module {name!r}")
        if isinstance(module, torch.nn.Conv1d):
            raise refusal("convolution over the sequence", f"module {name!r} ({type(module).__name__})")
    calls = _probe(model)
    _check_calls(calls, layout, kv_shape, max_head_dim, text_config(model.config).num_hidden_layers)


def _probe(model: torch.nn.Module) -> list[ProbeCall]:
    """The attention calls of one forward pass over ``PROBE_TOKENS`` tokens."""
    probe = AttentionProbe()
    device = next(model.parameters()).device
    ids = torch.arange(PROBE_TOKENS, device=device)[None] % model.config.get_text_config().vocab_size
    try:
        with torch.no_grad():
            model(
                input_ids=ids,
                position_ids=torch.arange(PROBE_TOKENS, device=device)[None],
                use_cache=False,
                logits_to_keep=1,
                cbrun_metadata=probe,
            )
    except UnsupportedAttention:
        raise
    except RuntimeError as exc:
        if "needs the engine's cbrun_metadata" in str(exc):
            raise refusal(
                "a model that passes its keyword arguments on to attention",
                "the probe's attention metadata never reached the attention call",
            ) from exc
        raise refusal("a forward pass cbrun can drive", f"{type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - whatever the model's own code raises, it is refused by name at load
        raise refusal("a forward pass cbrun can drive", f"{type(exc).__name__}: {exc}") from exc
    return probe.calls


def _check_calls(calls, layout, kv_shape, max_head_dim, num_layers) -> None:
    seen = [c.layer_idx for c in calls]
    if sorted(i for i in seen if i is not None) != list(range(num_layers)) or None in seen:
        missing = sorted(set(range(num_layers)) - set(seen))
        detail = (
            f"layers {missing} never call cbrun's attention (attention code of their own, or state-space, "
            "recurrent or convolution layers)"
            if missing
            else f"attention called {len(seen)} times for {num_layers} layers ({seen})"
        )
        raise refusal("token mixing other than one attention per layer", detail)
    num_kv_heads, head_dim = kv_shape
    for call in calls:
        where = f"layer {call.layer_idx}"
        if call.has_mask:
            raise refusal("an attention mask or bias built by the model (ALiBi, relative position)", where)
        check_hook_kwargs({k: v for k, v in call.kwargs.items() if k not in READ_KWARGS}, call.kwargs.get("dropout", 0))
        if call.v[1] != call.k[1] or call.q[1] != call.k[1]:
            raise refusal(
                "query, key and value heads of different sizes",
                f"{where}: q {call.q[1]}, k {call.k[1]}, v {call.v[1]}",
            )
        if call.k != (num_kv_heads, head_dim) or call.v != (num_kv_heads, head_dim) or call.q[0] % num_kv_heads:
            raise refusal(
                "a KV shape other than the config's",
                f"{where}: q {call.q}, k {call.k}, v {call.v} (heads, head_dim); the config says {num_kv_heads} KV "
                f"heads of {head_dim}",
            )
        if max_head_dim is not None and head_dim > max_head_dim:
            raise refusal("head sizes", f"head_dim {head_dim} > {max_head_dim}, the most the Triton kernel takes")
        window = call.kwargs.get("sliding_window")
        sliding = layout.layer_types[call.layer_idx] == "sliding"
        if bool(window) != sliding or (sliding and window != layout.sliding_window):
            raise refusal(
                "a sliding window other than the config's layer kinds",
                f"{where} passes sliding_window = {window!r}, the config makes it "
                f"{'sliding over ' + str(layout.sliding_window) if sliding else 'full'}",
            )
