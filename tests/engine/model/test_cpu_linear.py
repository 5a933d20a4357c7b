"""The lean path's linear layers on oneDNN (``cbrun.engine.model.layers.linear``): the per-weight choice, the op against
``F.linear``, and whole runs with every projection forced onto oneDNN against transformers."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
import torch.nn.functional as F

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.model import loader, safetensors_loader
from cbrun.engine.model.layers.linear import (
    ONEDNN_MIN_WEIGHT_ELEMENTS,
    ONEDNN_PACKED_MIN_WEIGHT_ELEMENTS,
    batch_invariant_linear,
    fixed_tile_linear,
    onednn_linear,
    onednn_unavailable_reason,
    pack_for_onednn,
    packs_for_onednn,
    select_linear,
)
from cbrun.engine.model.models.llama import LeanLlama
from cbrun.engine.model.registry import weights_from_module
from tests.engine.model.test_lean_llama import ENGINE_CONFIG, _random_model
from tests.model_utils import hf_greedy, random_model_dir, random_prompts, run_engine

#: A one-layer Llama whose q and o (512 x 512) and k and v (256 x 512) reach ``ONEDNN_PACKED_MIN_WEIGHT_ELEMENTS``,
#: and whose LM head (128 x 512) and MLP (96 wide) do not.
_WIDE = dict(hidden_size=512, num_attention_heads=4, head_dim=128, num_key_value_heads=2, num_hidden_layers=1)

pytestmark = pytest.mark.skipif(
    onednn_unavailable_reason(torch.zeros(1, 1)) is not None, reason="this torch build has no oneDNN linear op"
)


@pytest.mark.parametrize(
    "rows,in_features,out_features,bias,strided",
    [(1, 64, 32, False, False), (17, 96, 130, True, False), (64, 512, 1408, True, False), (9, 64, 40, True, True)],
)
def test_onednn_linear_equals_f_linear_up_to_rounding(rows, in_features, out_features, bias, strided):
    torch.manual_seed(0)
    x = torch.randn(rows, 2 * in_features)[:, ::2] if strided else torch.randn(rows, in_features)
    weight, b = torch.randn(out_features, in_features), torch.randn(out_features) if bias else None
    got, want = onednn_linear(x, weight, b), F.linear(x, weight, b)
    assert got.shape == want.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_auto_takes_onednn_for_large_float32_cpu_weights_only():
    rows = ONEDNN_MIN_WEIGHT_ELEMENTS // 512
    small, large = torch.zeros(rows - 1, 512), torch.zeros(rows, 512)
    assert select_linear(small, "auto") is F.linear
    assert select_linear(large, "auto") is onednn_linear
    assert select_linear(large.bfloat16(), "auto") is F.linear  # oneDNN here is float32 only
    assert select_linear(large, "torch") is F.linear
    assert select_linear(small, "onednn") is onednn_linear
    with pytest.raises(ValueError, match="linear_backend = onednn cannot run: the weight is torch.bfloat16"):
        select_linear(small.bfloat16(), "onednn")
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        select_linear(small, "blas")
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        EngineConfig(linear_backend="blas")


def test_a_packed_weight_holds_its_values_and_runs_only_on_onednn():
    torch.manual_seed(0)
    weight, bias = torch.randn(640, 512), torch.randn(640)
    packed = pack_for_onednn(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape and torch.equal(packed.to_dense(), weight)
    assert select_linear(packed, "auto") is onednn_linear and select_linear(packed, "onednn") is onednn_linear
    for rows in (1, 2, 16, 100):
        x = torch.randn(rows, 512)
        torch.testing.assert_close(onednn_linear(x, packed, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    for backend, invariant in (("torch", False), ("auto", True)):
        with pytest.raises(ValueError, match="a weight packed for oneDNN cannot run"):
            select_linear(packed, backend, batch_invariant=invariant)


def test_the_loader_packs_the_weights_oneDNN_will_run():
    rows = ONEDNN_PACKED_MIN_WEIGHT_ELEMENTS // 512
    small, large = torch.zeros(rows - 1, 512), torch.zeros(rows, 512)
    assert packs_for_onednn(large, "auto") and not packs_for_onednn(small, "auto")
    assert not packs_for_onednn(large.bfloat16(), "auto") and not packs_for_onednn(large, "torch")
    assert packs_for_onednn(small, "onednn")
    with pytest.raises(ValueError, match="linear_backend = onednn cannot run: the weight is torch.bfloat16"):
        packs_for_onednn(small.bfloat16(), "onednn")


def _loaded(model_dir) -> safetensors_loader.LeanModel:
    plan, reason = safetensors_loader.load_plan(model_dir, "float32")
    assert plan is not None, reason
    return safetensors_loader.load(plan, "cpu")


@pytest.mark.parametrize("tied", [False, True])
def test_packing_replaces_each_weight_and_keeps_no_second_copy(tied):
    model = _loaded(random_model_dir("llama", tie_word_embeddings=tied, **_WIDE))
    layer = model.weights.layers[0]
    originals = [weakref.ref(p[0]) for p in layer.linears()]
    loader._pack_onednn_weights(model, EngineConfig(**ENGINE_CONFIG, linear_backend="onednn"))
    gc.collect()
    assert all(p[0].is_mkldnn for p in layer.linears()) and all(ref() is None for ref in originals)
    head = model.weights.lm_head[0]
    assert (head is model.weights.embed and not head.is_mkldnn) if tied else head.is_mkldnn
    assert sum(1 for t in model.parameters() if t.is_mkldnn) == 7 + (not tied)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_packing_holds_at_most_one_weight_twice():
    # A fresh process reads an 8-layer model from safetensors (its tensors views of the file's mapping, resident
    # once read), then packs: 56 weights of 0.5 to 2 MiB, 72 MiB in all. Two copies would add 72 MiB to the peak and
    # to what stays resident; one weight at a time adds 2, and oneDNN's and malloc's working memory 4 to 13 more
    # (measured alone and beside other test runs). The bounds sit between: a third and a quarter of a second copy.
    model_dir = random_model_dir("llama", **dict(_WIDE, num_hidden_layers=8, intermediate_size=1024))
    script = textwrap.dedent(
        """
        import sys
        from cbrun.engine import EngineConfig
        from cbrun.engine.model import loader, safetensors_loader

        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1])

        plan, reason = safetensors_loader.load_plan(sys.argv[1], "float32")
        model = safetensors_loader.load(plan, "cpu")
        assert all(t.float().sum() == t.float().sum() for t in model.parameters())  # every page read
        before = status("VmRSS:")
        open("/proc/self/clear_refs", "w").write("5")
        loader._pack_onednn_weights(model, EngineConfig())
        print((status("VmHWM:") - before) // 1024, (status("VmRSS:") - before) // 1024)
        assert sum(t.is_mkldnn for t in model.parameters()) == 56, "q, k, v, o, gate, up, down in 8 layers"
        """
    )
    out = subprocess.run([sys.executable, "-c", script, str(model_dir)], capture_output=True, text=True, check=True)
    peak_growth_mib, rss_growth_mib = (int(x) for x in out.stdout.split())
    assert peak_growth_mib <= 72 // 3, out.stdout
    assert rss_growth_mib <= 72 // 4, out.stdout


@pytest.mark.parametrize(
    "settings,packed",
    [(dict(), ["q", "k", "v", "o"]), (dict(linear_backend="torch"), []), (dict(batch_invariant="on"), [])],
    ids=["auto", "torch", "batch-invariant"],
)
def test_packing_follows_the_backend_each_weight_gets(settings, packed):
    model = _loaded(random_model_dir("llama", **_WIDE))
    loader._pack_onednn_weights(model, EngineConfig(**ENGINE_CONFIG, **settings))
    layer = model.weights.layers[0]
    assert [name for name in ("q", "k", "v", "o", "gate", "up", "down") if getattr(layer, name)[0].is_mkldnn] == packed
    assert not model.weights.lm_head[0].is_mkldnn


def test_packed_weights_give_generate_s_greedy_tokens(caplog):
    model_dir = random_model_dir("llama", **_WIDE)
    prompts = random_prompts(6, 128, 1, 30)
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        got = run_engine(model_dir, prompts, EngineConfig(**ENGINE_CONFIG), SamplingParams(max_new_tokens=8))
    assert "oneDNN linear layers: 4 weights packed at load" in caplog.text
    for i, prompt in enumerate(prompts):
        assert got[i].output_token_ids == hf_greedy(model_dir, prompt, 8), f"prompt {i}"


def test_the_lean_model_puts_each_projection_on_the_backend_its_size_picks(caplog):
    # hidden 512, 4 heads of 128, 2 KV heads: q, o, gate, up, down hold 2^18 elements each; k, v and the
    # 128-token LM head hold less.
    model = _random_model(hidden_size=512, intermediate_size=512, num_hidden_layers=1, num_key_value_heads=2)
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        assert LeanLlama(weights_from_module(model)).num_onednn_linears == 5
    assert "linear layers: 5 of 8 on oneDNN" in caplog.text
    assert LeanLlama(weights_from_module(model), linear_backend="torch").num_onednn_linears == 0
    assert LeanLlama(weights_from_module(model), linear_backend="onednn").num_onednn_linears == 8


def test_onednn_needs_the_lean_path():
    model = _random_model()
    with pytest.raises(ValueError, match="linear_backend = onednn runs only on the lean forward pass"):
        LLMEngine(
            model,
            EngineConfig(**ENGINE_CONFIG, model_impl="transformers", linear_backend="onednn"),
            (),
            model.config.max_position_embeddings,
        )


@pytest.mark.parametrize("shape", [(128, 64), (1408, 512), (512, 1408), (96, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_batch_invariant_linear_rows_equal_for_every_row_count(shape, threads):
    # Each row's bits alone equal its bits among 2..150 rows at any offset; the default GEMMs do not promise it
    # (a 1-row call takes a GEMV: checked on torch's, so the test shows the difference it removes).
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(1)
        weight, bias = torch.randn(shape, generator=gen), torch.randn(shape[0], generator=gen)
        x = torch.randn(150, shape[1], generator=gen)
        for run in (batch_invariant_linear(weight), fixed_tile_linear):
            full = run(x, weight, bias)
            for start, count in ((0, 1), (3, 1), (0, 2), (9, 17), (70, 65), (1, 149)):
                assert torch.equal(run(x[start : start + count], weight, bias), full[start : start + count])
        assert not torch.equal(F.linear(x[:1], weight, bias), F.linear(x[:64], weight, bias)[:1])
        torch.testing.assert_close(full, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(previous)


def test_batch_invariant_linear_is_onednn_here():
    assert batch_invariant_linear(torch.zeros(64, 32)) is not fixed_tile_linear  # the check held on this machine
    assert batch_invariant_linear(torch.zeros(64, 32, dtype=torch.float64)) is fixed_tile_linear
