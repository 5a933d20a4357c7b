"""The lean path's linear layers on oneDNN (``cbrun.engine.model.layers.linear``): the per-weight choice, the op against
``F.linear``, and whole runs with every projection forced onto oneDNN against transformers."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from cbrun.engine import EngineConfig, LLMEngine
from cbrun.engine.model.layers.linear import (
    ONEDNN_MIN_WEIGHT_ELEMENTS,
    batch_invariant_linear,
    fixed_tile_linear,
    onednn_linear,
    onednn_unavailable_reason,
    select_linear,
)
from cbrun.engine.model.models.llama import LeanLlama
from cbrun.engine.model.registry import weights_from_module
from tests.engine.model.test_lean_llama import ENGINE_CONFIG, _random_model

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
