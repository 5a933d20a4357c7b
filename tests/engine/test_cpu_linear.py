"""The lean path's linear layers on oneDNN (``cbrun.engine.model.cpu_linear``): the per-weight choice, the op against
``F.linear``, and whole runs with every projection forced onto oneDNN against transformers."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from cbrun.engine import EngineConfig, LLMEngine
from cbrun.engine.model.cpu_linear import (
    ONEDNN_MIN_WEIGHT_ELEMENTS,
    onednn_linear,
    onednn_unavailable_reason,
    select_linear,
)
from cbrun.engine.model.lean_llama import LeanLlama
from tests.engine.test_lean_llama import ENGINE_CONFIG, _random_model

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
        assert LeanLlama(model).num_onednn_linears == 5
    assert "linear layers: 5 of 8 on oneDNN" in caplog.text
    assert LeanLlama(model, linear_backend="torch").num_onednn_linears == 0
    assert LeanLlama(model, linear_backend="onednn").num_onednn_linears == 8


def test_onednn_needs_the_lean_path():
    model = _random_model()
    with pytest.raises(ValueError, match="linear_backend = onednn runs only on the lean forward pass"):
        LLMEngine(
            model,
            EngineConfig(**ENGINE_CONFIG, model_impl="transformers", linear_backend="onednn"),
            (),
            model.config.max_position_embeddings,
        )
