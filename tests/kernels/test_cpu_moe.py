"""The C MoE experts kernel (``cbrun.kernels.cpu_moe``) against the PyTorch reference over ragged widths, token
counts, expert counts and dtypes; a row's result independent of its batch and of the thread count; bad input
refused by name; and no host read-back in the wrapper."""

from __future__ import annotations

import pytest
import torch

from benchmarks.moe_lean import HostReads
from cbrun.engine.model.layers.moe import MoEWeights, experts_reference, route
from cbrun.kernels import cpu_moe
from tests.model_utils import random_moe_weights

pytestmark = pytest.mark.skipif(cpu_moe.unavailable_reason() is not None, reason="no C compiler")


def _kernel(x: torch.Tensor, moe: MoEWeights, num_threads: int = 1) -> torch.Tensor:
    weights, expert_ids = route(x, moe)
    assert isinstance(moe.gate_up, torch.Tensor) and isinstance(moe.down, torch.Tensor)
    return cpu_moe.moe_experts(x, weights, expert_ids, moe.gate_up, moe.down, num_threads)


@pytest.mark.parametrize("num_tokens", [1, 2, 5, 16, 70])
@pytest.mark.parametrize(
    "experts,top_k,hidden,width",
    [(4, 2, 64, 32), (8, 3, 72, 40), (16, 4, 19, 7), (3, 3, 128, 96), (32, 1, 33, 17)],
    ids=["aligned", "hidden-72", "tiny-tails", "every-expert", "top-1"],
)
def test_float32_equals_the_reference(num_tokens, experts, top_k, hidden, width):
    moe = random_moe_weights(experts, top_k, hidden, width, torch.float32, seed=num_tokens)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(num_tokens))
    got = _kernel(x, moe)
    want = experts_reference(x, *route(x, moe), moe)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.abs().sum() > 0


@pytest.mark.parametrize("cast", [False, True], ids=["float32-weights", "bfloat16-weights"])
@pytest.mark.parametrize(
    "num_tokens,experts,top_k,hidden,width", [(1, 4, 2, 64, 32), (9, 8, 3, 72, 40), (40, 4, 2, 19, 7)]
)
def test_bfloat16_follows_the_grouped_path(cast, num_tokens, experts, top_k, hidden, width):
    """bfloat16 experts, the routing weights float32 (Mixtral) or bfloat16 (Qwen3-MoE): the roundings of torch's
    grouped path, so the results are within a bfloat16 ulp or two of the reference's."""
    moe = random_moe_weights(experts, top_k, hidden, width, torch.bfloat16, cast=cast)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    weights, expert_ids = route(x, moe)
    assert weights.dtype == (torch.bfloat16 if cast else torch.float32)
    got = _kernel(x, moe)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, experts_reference(x, weights, expert_ids, moe), rtol=2e-2, atol=2e-2)
    assert got.float().abs().sum() > 0


def test_the_slots_are_added_in_slot_order():
    """Experts whose outputs are exact (silu(64) is 64 in float32, powers of two): 2^24, 1 and -2^24 added in slot
    order give 0 (2^24 + 1 rounds to 2^24), the other way round 1. transformers' sum over the slots gives 0."""
    hidden, width = 16, 16
    gate_up = torch.zeros(3, 2 * width, hidden)
    gate_up[:, :width, 0] = 64.0  # gate = 64 for every column
    gate_up[:, width:, 0] = torch.tensor([2.0**18, 2.0**-6, -(2.0**18)])[:, None]  # up
    down = torch.zeros(3, hidden, width)
    down[:, 0, 0] = 1.0  # y[0] = 64 * up
    moe = MoEWeights(torch.zeros(3, hidden), gate_up, down, 3, False, False)
    x = torch.zeros(2, hidden)
    x[:, 0] = 1.0
    expert_ids = torch.tensor([[0, 1, 2], [2, 1, 0]])
    weights = torch.ones(2, 3)
    got = cpu_moe.moe_experts(x, weights, expert_ids, gate_up, down)
    assert got[:, 0].tolist() == [0.0, 1.0]
    assert torch.equal(got, experts_reference(x, weights, expert_ids, moe))


def test_a_row_does_not_depend_on_its_batch_or_the_thread_count():
    moe = random_moe_weights(8, 2, 72, 40, torch.float32)
    x = torch.randn(23, 72, generator=torch.Generator().manual_seed(5))
    weights, expert_ids = route(x, moe)
    whole = cpu_moe.moe_experts(x, weights, expert_ids, moe.gate_up, moe.down, 1)
    for row in (0, 7, 22):
        alone = cpu_moe.moe_experts(
            x[row : row + 1], weights[row : row + 1], expert_ids[row : row + 1], moe.gate_up, moe.down
        )
        assert torch.equal(alone[0], whole[row])
    assert torch.equal(cpu_moe.moe_experts(x, weights, expert_ids, moe.gate_up, moe.down, 2), whole)


def test_strided_experts_are_read_through_their_strides():
    """Experts that are a slice of a larger stack (an expert stride that is not 2I * hidden)."""
    moe = random_moe_weights(6, 2, 40, 24, torch.float32)
    assert isinstance(moe.gate_up, torch.Tensor) and isinstance(moe.down, torch.Tensor)
    every_other = MoEWeights(
        router=moe.router[::2].clone(), gate_up=moe.gate_up[::2], down=moe.down[::2], top_k=2, norm_topk_prob=True,
        weights_in_model_dtype=False,
    )  # fmt: skip
    assert every_other.gate_up.stride(0) == 2 * 48 * 40
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(2))
    want = experts_reference(x, *route(x, every_other), every_other)
    torch.testing.assert_close(_kernel(x, every_other), want, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_by_name():
    moe = random_moe_weights(4, 2, 32, 16, torch.float32)
    x = torch.randn(3, 32)
    weights, expert_ids = route(x, moe)
    with pytest.raises(RuntimeError, match="expert id outside"):
        cpu_moe.moe_experts(x, weights, expert_ids + 4, moe.gate_up, moe.down)
    with pytest.raises(ValueError, match="x must be a"):
        cpu_moe.moe_experts(x.double(), weights, expert_ids, moe.gate_up, moe.down)
    with pytest.raises(ValueError, match="expert_ids must be"):
        cpu_moe.moe_experts(x, weights, expert_ids.int(), moe.gate_up, moe.down)
    with pytest.raises(ValueError, match="float16"):
        cpu_moe.moe_experts(x.half(), weights, expert_ids, moe.gate_up.half(), moe.down.half())
    assert "not contiguous" in cpu_moe.unsupported_reason(moe.gate_up.transpose(1, 2), moe.down)


def test_the_wrapper_reads_nothing_back():
    moe = random_moe_weights(8, 2, 64, 32, torch.float32)
    x = torch.randn(6, 64)
    weights, expert_ids = route(x, moe)
    with HostReads() as reads:
        cpu_moe.moe_experts(x, weights, expert_ids, moe.gate_up, moe.down)
    assert not reads.ops
    with HostReads() as reads:  # the check itself can fail
        expert_ids.max().item()
    assert reads.ops


def test_runs_step_is_the_mean_rows_per_expert():
    assert cpu_moe.runs_step(128, 4, 32)  # 16 rows an expert
    assert not cpu_moe.runs_step(129, 4, 32)
    assert cpu_moe.runs_step(1, 8, 4)
