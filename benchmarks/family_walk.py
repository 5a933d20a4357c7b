"""Walk every causal-LM family transformers ships: each equals transformers token for token or is refused by name.

For every ``model_type`` in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` this builds a tiny random model
(``tiny_config``: hidden 64, 2 layers, a 128-token vocabulary, the family's own fields from ``OVERRIDES``), saved as
the family's released checkpoints are (``checkpoint_class``), runs transformers' greedy ``generate`` on two prompts
(an argmax loop over its forward pass where ``generate`` itself fails on the model), then cbrun's engine on the same
folder, and records one outcome:

- ``equal``: cbrun's tokens are transformers' tokens;
- ``refused``: cbrun refused the model at load, and the message names the feature;
- ``not buildable``: the tiny model cannot be built here (a package that is not installed);
- ``DIFFERENT`` or ``ERROR``: a bug (cbrun ran the model wrong, ran one transformers cannot run, or failed other
  than by refusing at load).

Each family runs in a forked child process (one at a time, its memory capped), so a family that leaks memory, hangs
or crashes costs only its own row. The results table of every family is ``benchmarks/results-family-walk.md``;
``tests/engine/model/test_family_walk.py`` checks a subset of it in the suite and that the table covers every family.

Run (from the repository root; 13 to 22 minutes on two cores shared with other jobs)::

    PYTHONPATH=. nice python -m benchmarks.family_walk --out benchmarks/results-family-walk.md
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import resource
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.model_utils import TINY_DECODER

#: Fields set where a family's config (or one of its sub-configs) has them: hidden 64, 2 layers, 4 heads of 16 over
#: 2 KV heads, a 4-token sliding window, 4 experts with 2 per token.
TINY = dict(
    TINY_DECODER,
    intermediate_size=64,
    head_dim=16,
    max_position_embeddings=128,
    sliding_window=4,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    tie_word_embeddings=False,
)
#: An ``OVERRIDES`` value: leave this ``TINY`` field out of the family's config.
DROP = object()
#: Per-family config fields, over ``TINY``, where the generic fields do not make a tiny model of the family.
_MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    head_dim=8,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    n_shared_experts=1,
)
#: Sparse-attention indexers (DeepSeek-V3.2's lightning indexer and its followers).
_INDEXER = dict(index_n_heads=2, index_head_dim=16, index_topk=4)
_SPECIAL_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
#: Four layers, the last two reading the KV of the first two (num_kv_shared_layers), tiny per-layer embeddings.
_GEMMA3N_TEXT = dict(
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    num_kv_shared_layers=2,
    vocab_size_per_layer_input=128,
    hidden_size_per_layer_input=16,
    laurel_rank=8,
    activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
    **_SPECIAL_IDS,
)
#: Hybrid stacks whose own layer kinds default to linear attention on two layers (transformers' generate needs one
#: attention layer).
_LINEAR_THEN_FULL = ["linear_attention", "full_attention"]
_QWEN4_EXP_TEXT = dict(
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=16,
    indexer_budget=4,
    indexer_compress_ratio=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    hc_lowrank=8,
    ple_embed_dim=64,
    ngram_vocab_size_base=1024,
    heads_per_ngram=2,
    num_hidden_layers=4,
)
#: Per-layer embeddings (PLE) of a tiny table, and full-attention layers with twice the head size (per_layer_config).
_GEMMA4 = dict(vocab_size_per_layer_input=128, hidden_size_per_layer_input=16, global_head_dim=32, **_SPECIAL_IDS)
#: MLA with an indexer on full layers, and sliding layers of their own MLA shapes (the released ``swa_*`` keys; a
#: latent rank of their own, as released, so ``kv_lora_rank`` is a per-layer key).
_DOTS3_TEXT = dict(
    _MLA,
    **_INDEXER,
    head_dim=24,
    num_hidden_layers=4,  # two indexed-attention layers, then two sliding ones
    swa_num_attention_heads=4,
    swa_num_key_value_heads=4,
    swa_q_lora_rank=32,
    swa_kv_lora_rank=32,
    swa_head_dim=16,
    swa_qk_nope_head_dim=8,
    swa_qk_rope_head_dim=8,
    swa_v_head_dim=16,
)
#: Seq2seq families, whose causal LM is their decoder: encoder and decoder sizes of their own.
_SEQ2SEQ = dict(
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
)
OVERRIDES: dict[str, dict] = {
    **{
        name: _SEQ2SEQ
        for name in (
            "bart",
            "bigbird_pegasus",
            "blenderbot",
            "blenderbot-small",
            "marian",
            "mbart",
            "mvp",
            "pegasus",
            "plbart",
        )
    },
    "whisper": dict(_SEQ2SEQ, max_target_positions=128, max_source_positions=64, num_mel_bins=8),
    "prophetnet": dict(
        num_hidden_layers=DROP,
        num_encoder_layers=2,
        num_decoder_layers=2,
        num_encoder_attention_heads=4,
        num_decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        ngram=1,
        **_SPECIAL_IDS,  # its positions are counted from pad_token_id
    ),
    **{
        name: _MLA
        for name in (
            "deepseek_v2",
            "deepseek_v3",
            "axk1",
            "axk2",
            "glm4_moe_lite",
            "longcat_flash",
            "minicpm3",
            "sarvam_mla",
            "youtu",
        )
    },
    "deepseek_v32": {**_MLA, **_INDEXER},
    "glm_moe_dsa": {**_MLA, **_INDEXER},
    "hy_v4": {**_MLA, **_INDEXER},
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
    "falcon": dict(head_dim=DROP),
    "cwm": _SPECIAL_IDS,
    "mllama": dict(text_config=dict(_SPECIAL_IDS, cross_attention_layers=[1])),
    "emu3": dict(
        text_config=_SPECIAL_IDS,
        vocabulary_map={"<|extra_200|>": 120, "<image>": 121},
        vq_config=dict(codebook_size=64, base_channels=32, channel_multiplier=[1, 1], num_res_blocks=1),
    ),
    "modernbert-decoder": _SPECIAL_IDS,
    "dbrx": dict(
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=128,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
    ),
    "dots1": dict(n_shared_experts=1, first_k_dense_replace=1),
    "lfm2_moe": dict(layer_types=["full_attention", "full_attention"], num_dense_layers=1),
    "gpt_neo": dict(num_layers=2, attention_types=[[["global", "local"], 1]], window_size=4),
    "mamba2": dict(num_heads=4, head_dim=32, n_groups=1),
    "phimoe": dict(sliding_window=None),  # its attention reads no window: a config window is refused (see table)
    "ergo": dict(first_dense_intermediate_size=64, shared_intermediate_size=32),
    **{
        name: dict(
            unpadded_vocab_size=128,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=16,
            sliding_window_size=4,
        )
        for name in ("inkling2_text", "inkling2_loop_text")
    },
    "kimi_linear": {**_MLA, "linear_num_heads": 2, "linear_head_dim": 16, "layer_types": _LINEAR_THEN_FULL},
    "qwen4_exp_text": _QWEN4_EXP_TEXT,
    "qwen4_exp": dict(text_config=_QWEN4_EXP_TEXT),
    # Per-layer-kind RoPE (multimodal sections over head_dim 16), and NoPE full-attention layers.
    "cohere_compass_text": dict(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2]),
            "full_attention": None,
        },
    ),
    # One input, one recurrent (run twice per forward pass) and one output layer.
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_output_layers=1),
    **{name: _GEMMA4 for name in ("gemma4_text", "gemma4_unified_text")},
    **{name: dict(text_config=_GEMMA4) for name in ("gemma4", "gemma4_unified")},
    **{name: _DOTS3_TEXT for name in ("dots3_note_text",)},
    # Its vision tower's expert counts grow layer by layer (pyramid_num_routed): one dense layer, then 4 experts.
    "dots3_note": dict(
        text_config=_DOTS3_TEXT,
        vision_config=dict(pyramid_num_routed=[-1, 4], adapter_in_dim=64, adapter_out_dim=64),
        audio_config=dict(adapter_out_dim=64, adapter_input_size=64),
    ),
    "gemma3n_text": _GEMMA3N_TEXT,
    "gemma3n": dict(text_config=_GEMMA3N_TEXT),
    # Draft heads for Gemma 4 (every layer reads the target's KV): no per-layer embeddings.
    **{
        name: dict(
            text_config=dict(
                _GEMMA4, vocab_size_per_layer_input=0, hidden_size_per_layer_input=0, model_type="gemma4_text"
            )
        )
        for name in ("gemma4_assistant", "gemma4_unified_assistant")
    },
    # A T5 text encoder and EnCodec beside the decoder, whose pad and start token is its vocabulary size.
    **{
        name: dict(
            text_encoder=dict(d_ff=64, d_kv=16),
            decoder=dict(ffn_dim=64, pad_token_id=128, bos_token_id=128),
        )
        for name in ("musicgen", "musicgen_melody")
    },
    # Zamba's first three layers are fixed (two Mamba layers, then a hybrid one); no CUDA Mamba kernels here.
    "zamba": dict(num_hidden_layers=3, head_dim=DROP, mamba_dt_rank=4, use_mamba_kernels=False),
    "zamba2": dict(
        layers_block_type=["linear_attention", "hybrid"], head_dim=DROP, mamba_headdim=16, use_mamba_kernels=False
    ),
    # One sliding layer, then an indexed-attention layer that is its own indexer.
    "kolibri1_1": dict(
        layer_types=["sliding_attention", "indexed_attention"],
        index_layers=[1],
        kv_source_layers=[0, 1],
        mlp_only_layers=[0],
        index_num_heads=2,
    ),
    "reformer": dict(is_decoder=True, axial_pos_shape=[8, 16], axial_pos_embds_dim=[32, 32]),
    "xlnet": dict(max_position_embeddings=DROP, d_head=16),
    "xlm": _SPECIAL_IDS,
    "xmod": dict(default_language="en_XX"),
    # Its cache rounds the query width up to a multiple of 64 and its layers do not: a width that is one.
    "xlstm": dict(hidden_size=128, embedding_dim=128, num_heads=4),
    "llama4": dict(vision_config=dict(vision_output_dim=64, projector_input_dim=64, projector_output_dim=64)),
    "roc_bert": dict(shape_embed_dim=16, pronunciation_embed_dim=16, shape_vocab_size=64, pronunciation_vocab_size=64),
    # Byte latent transformer: local encoder and decoder over the global transformer's width.
    "blt": dict(
        encoder_hash_byte_group_vocab=64,
        encoder_config=dict(hidden_size_global=64),
        decoder_config=dict(hidden_size_global=64),
    ),
    # Hybrid stacks: enough layers that one of them is attention (transformers' own generate needs one).
    **{name: dict(num_hidden_layers=4) for name in ("qwen3_5_moe_text", "qwen3_5_text", "qwen3_next")},
    "bailing_hybrid": {**_MLA, "layer_types": _LINEAR_THEN_FULL},
    **{name: dict(text_config=dict(num_hidden_layers=4)) for name in ("qwen3_5", "qwen3_5_moe")},
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "recurrent_gemma": dict(num_hidden_layers=3),
    "zaya": dict(num_experts_per_tok=1),
}
#: The most parameters a tiny model may have: a family above it needs its own fields in ``OVERRIDES``.
MAX_PARAMS = 16_000_000
PROMPTS = [[3, 17, 5, 99, 42, 7], [11, 2]]
NEW_TOKENS = 5
#: Per family: seconds, and bytes of address space of its child process.
TIME_LIMIT_S = 120
MEMORY_LIMIT_BYTES = 6 << 30

OUTCOMES = ("equal", "refused", "not buildable", "DIFFERENT", "ERROR")


@dataclass
class Outcome:
    """One family's result: ``status`` (one of ``OUTCOMES``), ``detail`` (the refusal's feature, the reason it
    is not buildable, or what went wrong), ``seconds`` of wall time and ``reference``: where transformers' tokens
    came from (``transformers_tokens``)."""

    model_type: str
    status: str
    detail: str = ""
    seconds: float = 0.0
    reference: str = ""


class NotBuildable(Exception):
    """The tiny model of a family cannot be built here (the message says why)."""


def tiny_config(model_type: str):
    """The tiny config of ``model_type``: ``TINY``'s fields that its config class (and each sub-config) has, then
    ``OVERRIDES[model_type]``.

    Raises:
        NotBuildable: the config class rejects the fields.
    """
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    overrides = OVERRIDES.get(model_type, {})
    try:
        return config_class(**_tiny_fields(config_class, overrides))
    except Exception as exc:  # noqa: BLE001 - any config validation error makes the family not buildable
        raise NotBuildable(f"config: {type(exc).__name__}: {_first_line(exc)}") from exc


def _tiny_fields(config_class, overrides: dict) -> dict:
    default = _default_config(config_class, overrides)
    fields = {k: v for k, v in TINY.items() if _has_field(default, k)}
    sub_names = set()
    for name in getattr(config_class, "sub_configs", None) or {}:
        sub = getattr(default, name, None)
        if not hasattr(sub, "to_dict"):
            continue
        # The default's own sub-config class (a sub-config typed AutoConfig is resolved by its model_type), with
        # the family's overrides of that sub-config.
        fields[name] = {**_tiny_fields(type(sub), overrides.get(name, {})), "model_type": sub.model_type}
        sub_names.add(name)
    fields.update({k: v for k, v in overrides.items() if v is not DROP and k not in sub_names})
    for key in [k for k, v in overrides.items() if v is DROP]:
        fields.pop(key, None)
    return fields


def _default_config(config_class, overrides: dict):
    """``config_class()``; where its own defaults do not validate (Gemma 4's assistant: its default text config has
    per-layer embeddings it refuses), with the family's sub-config overrides."""
    try:
        return config_class()
    except Exception:  # noqa: BLE001 - transformers' strict validation errors
        sub_names = getattr(config_class, "sub_configs", None) or {}
        return config_class(**{k: v for k, v in overrides.items() if k in sub_names})


def _has_field(config, name: str) -> bool:
    """Whether ``config`` has the field ``name``; a per-layer field (Gemma 4's ``per_layer_config``: reading its
    global value raises) counts."""
    try:
        getattr(config, name)
    except AttributeError:
        return False
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError: the field exists per layer
        return True
    return True


def build(model_type: str, path: Path):
    """Build the tiny random model of ``model_type`` (seed 0, weights spread as the oracle tests spread them) and
    save it to ``path`` as the family's released checkpoints are saved (``checkpoint_class``).

    Raises:
        NotBuildable: no tiny config, too many parameters, a package that is not installed, or transformers cannot
            build or save it.
    """
    import torch

    from tests.model_utils import save_spread_weights

    config = tiny_config(model_type)
    try:
        model_class = checkpoint_class(config)
        with torch.device("meta"):
            meta = model_class.from_config(config)
    except ImportError as exc:
        raise NotBuildable(f"needs a package that is not installed: {_first_line(exc)}") from exc
    except Exception as exc:  # noqa: BLE001
        raise NotBuildable(f"model: {_error(exc)}") from exc
    num_params = sum(p.numel() for p in meta.parameters())
    del meta
    if num_params > MAX_PARAMS:
        raise NotBuildable(f"{num_params / 1e6:.0f}M parameters with the tiny fields (needs its own OVERRIDES)")
    torch.manual_seed(0)
    try:
        model = model_class.from_config(config, attn_implementation="eager").eval()
        save_spread_weights(model, path)
    except Exception as exc:  # noqa: BLE001
        raise NotBuildable(f"model: {_error(exc)}") from exc
    return model


def checkpoint_class(config):
    """The auto class a released checkpoint of ``config``'s family is saved from: ``AutoModelForCausalLM``, unless
    the causal LM it builds keeps only the text config, or cannot take the whole config (Emu3, Mllama, MusicGen:
    their ``ForCausalLM`` is the text decoder alone, and its checkpoint would name another ``model_type``); then the
    family's whole model, whose checkpoint holds the family's own config, as released ones do."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForTextToWaveform
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES,
    )

    try:
        with torch.device("meta"):
            causal = AutoModelForCausalLM.from_config(config)
        if type(causal.config) is type(config):
            return AutoModelForCausalLM
    except (AttributeError, TypeError):  # MusicGen's causal LM cannot take the whole config
        pass
    for mapping, auto in (
        (MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, AutoModelForImageTextToText),
        (MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES, AutoModelForTextToWaveform),
    ):
        if config.model_type in mapping:
            return auto
    return AutoModelForCausalLM


def walk(model_type: str, path: Path) -> Outcome:
    """Build ``model_type``'s tiny model in ``path``, run transformers and cbrun on it, and compare.

    transformers' tokens come from ``generate``; where ``generate`` itself fails on the built model (a transformers
    fault: the row's ``reference`` says which), from an argmax loop over its forward pass. Where transformers cannot
    run the model at all, cbrun must refuse it at load.
    """
    start = time.perf_counter()
    try:
        build(model_type, path)
    except NotBuildable as exc:
        return Outcome(model_type, "not buildable", str(exc), time.perf_counter() - start, reference="")
    gc.collect()
    expected, reference = transformers_tokens(path)
    gc.collect()
    status, detail = cbrun_outcome(path, expected)
    return Outcome(model_type, status, detail, time.perf_counter() - start, reference)


def transformers_tokens(path: Path) -> tuple[list[list[int]] | None, str]:
    """transformers' greedy tokens for ``PROMPTS`` on the model in ``path``, and where they came from:
    ``"generate"``, ``"forward (generate: <error>)"`` or, with None, ``"fails (...)"``."""
    from transformers import AutoModelForCausalLM

    from tests.model_utils import greedy_generate

    try:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    except Exception as exc:  # noqa: BLE001 - transformers cannot load its own checkpoint
        return None, f"fails (load: {_error(exc)})"
    try:
        return [greedy_generate(model, p, NEW_TOKENS) for p in PROMPTS], "generate"
    except Exception as exc:  # noqa: BLE001 - transformers' generate fails on the model: try its forward pass
        generate_error = _error(exc)
    try:
        return [argmax_loop(model, p, NEW_TOKENS) for p in PROMPTS], f"forward (generate: {generate_error})"
    except Exception as exc:  # noqa: BLE001
        return None, f"fails (generate: {generate_error}; forward: {_error(exc)})"


def argmax_loop(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from ``model``'s forward pass over the whole sequence at each step (no cache): the reference
    where transformers' ``generate`` fails on a model its forward pass runs."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            input_ids = torch.tensor([ids])
            logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def cbrun_outcome(path: Path, expected: list[list[int]] | None) -> tuple[str, str]:
    """cbrun's engine on the model in ``path`` against transformers' ``expected`` tokens (None: transformers cannot
    run it): ``(status, detail)``."""
    import torch

    from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
    from cbrun.engine.model.layers.attention_contract import UnsupportedAttention

    config = EngineConfig(page_size=4, max_batch_tokens=16, num_blocks=64)
    try:
        engine = LLMEngine.from_pretrained(str(path), config)
    except UnsupportedAttention as exc:
        return "refused", feature(str(exc))
    except ValueError as exc:  # the loader's other refusals at load (encoder-decoder, non-causal)
        return "refused", _first_line(exc)
    except Exception as exc:  # noqa: BLE001
        return "ERROR", f"load: {_error(exc)}"
    if expected is None:
        return "ERROR", "cbrun loaded a model transformers cannot run"
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        with torch.no_grad():
            outputs = {o.request_id: o for o in engine.generate((i, p, params) for i, p in enumerate(PROMPTS))}
        got = [outputs[i].output_token_ids for i in range(len(PROMPTS))]
    except Exception as exc:  # noqa: BLE001
        return "ERROR", f"generate: {_error(exc)}"
    if got != expected:
        return "DIFFERENT", f"cbrun {got} transformers {expected}"
    return "equal", ""


def feature(message: str) -> str:
    """The feature an ``UnsupportedAttention`` message names ("attention feature not implemented: <feature> (...")."""
    prefix = "attention feature not implemented: "
    if message.startswith(prefix):
        return message[len(prefix) :].split(" (", 1)[0]
    return message.split(" (", 1)[0]


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


def _child(model_type: str, conn) -> None:
    """Run one family in a forked child: capped memory and time, the outcome sent back as a dict."""
    import torch

    torch.set_num_threads(1)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))

    def on_alarm(signum, frame):
        raise TimeoutError(f"over {TIME_LIMIT_S} s")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(TIME_LIMIT_S)
    with tempfile.TemporaryDirectory(prefix=f"cbrun-walk-{model_type}-") as tmp:
        try:
            outcome = walk(model_type, Path(tmp))
        except BaseException as exc:  # noqa: BLE001 - MemoryError, TimeoutError: the row says so
            outcome = Outcome(model_type, "ERROR", f"{type(exc).__name__}: {_first_line(exc)}")
    conn.send(asdict(outcome))
    conn.close()


def walk_isolated(model_type: str) -> Outcome:
    """``walk`` in a forked child process (memory capped at ``MEMORY_LIMIT_BYTES``, ``TIME_LIMIT_S``)."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    start = time.perf_counter()
    proc = ctx.Process(target=_child, args=(model_type, child))
    proc.start()
    child.close()
    result = parent.recv() if parent.poll(TIME_LIMIT_S + 30) else None
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if result is None:
        return Outcome(model_type, "ERROR", f"child process died (exit {proc.exitcode})", time.perf_counter() - start)
    return Outcome(**result)


def families() -> list[str]:
    """Every ``model_type`` of transformers' causal-LM mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def table(outcomes: list[Outcome]) -> str:
    """The results as markdown: a count per outcome, then one row per family."""
    import platform

    import torch
    import transformers

    counts = {s: sum(o.status == s for o in outcomes) for s in OUTCOMES}
    lines = [
        "# Every transformers causal-LM family against cbrun",
        "",
        f"transformers {transformers.__version__}, torch {torch.__version__}, {platform.machine()}, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}. Command: "
        "`PYTHONPATH=. nice python -m benchmarks.family_walk --out benchmarks/results-family-walk.md`",
        "",
        ", ".join(f"{s}: {n}" for s, n in counts.items()) + f" (of {len(outcomes)})",
        "",
        "`transformers` says where its tokens came from: `generate`, or an argmax loop over its `forward` where "
        "`generate` itself fails on the model (the error given), or `fails` where transformers cannot run the model "
        "at all (cbrun must then refuse it).",
        "",
        "| family | outcome | detail | transformers | s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for o in outcomes:
        detail, reference = (text.replace("|", "\\|") for text in (o.detail, o.reference))
        lines.append(f"| {o.model_type} | {o.status} | {detail} | {reference} | {o.seconds:.1f} |")
    return "\n".join(lines) + "\n"


def read_table(path: Path) -> dict[str, tuple[str, str, str]]:
    """A results file's rows: ``model_type -> (status, detail, reference)``."""
    rows = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        cells = [c.strip().replace("\\|", "|") for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 5 and cells[1] in OUTCOMES:
            rows[cells[0]] = (cells[1], cells[2], cells[3])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", help="comma-separated model types (default: every causal-LM family)")
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--jsonl", type=Path, help="append one JSON line per family here as it finishes")
    args = parser.parse_args(argv)
    names = args.families.split(",") if args.families else families()
    # Imported once here, so every forked child starts with them.
    import transformers

    import cbrun.engine  # noqa: F401
    import tests.model_utils  # noqa: F401

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    outcomes = []
    for name in names:
        outcome = walk_isolated(name)
        outcomes.append(outcome)
        print(
            f"{name:28s} {outcome.status:14s} {outcome.seconds:5.1f}s {outcome.detail} [{outcome.reference}]",
            flush=True,
        )
        if args.jsonl:
            with args.jsonl.open("a", encoding="utf-8") as f:
                f.write(json.dumps(asdict(outcome)) + "\n")
    if args.out:
        args.out.write_text(table(outcomes), encoding="utf-8")
    bugs = [o.model_type for o in outcomes if o.status in ("DIFFERENT", "ERROR")]
    if bugs:
        print(f"wrong or failing: {', '.join(bugs)}", file=sys.stderr)
    return 1 if bugs else 0


if __name__ == "__main__":
    raise SystemExit(main())
