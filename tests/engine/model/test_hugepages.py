"""The CPU weights' move to transparent huge pages (``cbrun.engine.model.hugepages``): same values and layout, huge
pages where the kernel gives them, the reason said where it does not, and at most one weight held twice."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from cbrun.engine.model import hugepages


def anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds ``address``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping of this process holds {address:#x}")


def weights() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(32, 512, 256),  # 16 MiB: experts
        torch.randn(1000, 1000, dtype=torch.bfloat16),  # 2 MB
        torch.randint(-(2**31), 2**31 - 1, (640, 512), dtype=torch.int32),  # packed int4 codes, 1.25 MiB
        torch.nn.Parameter(torch.randn(512, 1024)),  # a transformers module's parameter, 2 MiB
        torch.randn(4096),  # a norm: too small, stays
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_moved_weights_keep_values_and_layout_on_huge_pages():
    tensors = weights()
    before = [t.detach().clone() for t in tensors]
    small_ptr = tensors[-1].data_ptr()
    placement = hugepages.place_on_huge_pages(tensors, mode="madvise")
    assert placement.reason is None and placement.moved == 4
    for tensor, original in zip(tensors, before):
        assert tensor.dtype == original.dtype and tensor.shape == original.shape
        assert tensor.stride() == original.stride() and tensor.is_contiguous()
        assert torch.equal(tensor, original)  # bit for bit (no NaNs in these)
        assert tensor.data_ptr() % 64 == 0  # 16-byte rows for the C MoE kernel and torch._grouped_mm
    assert tensors[-1].data_ptr() == small_ptr
    assert tensors[0].data_ptr() == placement.address and placement.address % hugepages.HUGE_PAGE == 0
    assert isinstance(tensors[3], torch.nn.Parameter) and tensors[3].requires_grad
    if hugepages.thp_mode() in ("madvise", "always"):
        assert anon_huge_kib(placement.address) > 0
    tensors[0].add_(1)  # the arena is writable memory of its own
    assert torch.equal(tensors[0], before[0] + 1)


def test_the_kernels_mode_decides():
    mode = hugepages.thp_mode()
    tensors = weights()
    placement = hugepages.place_on_huge_pages(tensors)
    if mode == "madvise":
        assert placement.moved == 4 and anon_huge_kib(tensors[0].data_ptr()) > 0
    else:
        assert placement.moved == 0 and placement.reason == hugepages.unavailable_reason(mode)
        assert placement.reason is not None


@pytest.mark.parametrize(("mode", "says"), [("never", "'never'"), ("always", "'always'"), (None, "unreadable")])
def test_nothing_moves_where_the_kernel_has_no_madvise_mode(mode, says, tmp_path, monkeypatch):
    if mode is None:
        monkeypatch.setattr(hugepages, "THP_ENABLED", tmp_path / "missing")
    tensors = weights()
    pointers = [t.data_ptr() for t in tensors]
    placement = hugepages.place_on_huge_pages(tensors, mode=mode)
    assert placement.moved == 0 and says in placement.reason
    assert [t.data_ptr() for t in tensors] == pointers


def test_off_switch_and_views_stay(monkeypatch):
    big = torch.randn(1024, 1024)
    view = big[256:]  # part of a larger storage: moving it would keep both copies
    assert hugepages.place_on_huge_pages([view], mode="madvise").moved == 0
    monkeypatch.setenv(hugepages.OFF_SWITCH, "0")
    placement = hugepages.place_on_huge_pages([big], mode="madvise")
    assert placement.moved == 0 and hugepages.OFF_SWITCH in placement.reason


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(path) == "madvise"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("source", ["memory", "safetensors"])
def test_the_move_holds_at_most_one_weight_twice(source, tmp_path):
    # A fresh process: its peak resident memory (VmHWM) is reset after the weights are made (and read: a
    # safetensors tensor is a view of the file's mapping, resident once touched), then read after the move.
    # Sixteen 8 MiB weights: two copies would add 128 MiB, one weight at a time adds 8.
    script = textwrap.dedent(
        """
        import sys
        import torch
        from safetensors import safe_open
        from safetensors.torch import save_file
        from cbrun.engine.model import hugepages

        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1])

        tensors = [torch.full((2 << 20,), float(i)) for i in range(16)]
        if sys.argv[1] != "memory":
            save_file({f"w{i}": t for i, t in enumerate(tensors)}, sys.argv[2])
            with safe_open(sys.argv[2], framework="pt") as handle:
                tensors = [handle.get_tensor(f"w{i}") for i in range(16)]
            assert float(sum(t.sum() for t in tensors)) > 0  # every page read, resident
        before = status("VmRSS:")
        open("/proc/self/clear_refs", "w").write("5")
        placement = hugepages.place_on_huge_pages(tensors, mode="madvise")
        print((status("VmHWM:") - before) // 1024, (status("VmRSS:") - before) // 1024)
        assert placement.moved == 16, placement
        assert all(bool((t == i).all()) for i, t in enumerate(tensors))
        """
    )
    command = [sys.executable, "-c", script, source, str(tmp_path / "w.safetensors")]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    peak_growth_mib, rss_growth_mib = (int(x) for x in out.split())
    assert peak_growth_mib <= 8 + 2 + 4, out  # one weight, a partly filled huge page, slack
    assert rss_growth_mib <= 2 + 4, out


@pytest.mark.parametrize("loader", ["auto", "transformers"])
def test_engine_on_moved_weights_equals_generate(loader, monkeypatch, caplog):
    # Every weight of a tiny Qwen3-MoE moved (the threshold lowered): greedy tokens through the C kernel still equal
    # transformers' generate, on both loaders (the transformers modules' parameters rebound in place).
    from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
    from tests.model_utils import hf_greedy, random_model_dir, random_prompts

    monkeypatch.setattr(hugepages, "MIN_BYTES", 1)
    model_dir = random_model_dir("qwen3_moe", norm_topk_prob=True, mlp_only_layers=(1,))
    prompts = random_prompts(3, 128, 1, 30)
    config = EngineConfig(page_size=4, max_batch_tokens=16, num_blocks=256, loader=loader, model_impl="lean")
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        engine = LLMEngine.from_pretrained(str(model_dir), config)
    if hugepages.unavailable_reason() is None:
        assert "weights on huge pages: " in caplog.text and " tensors, " in caplog.text
        moe = next(layer.moe for layer in engine.model_runner.lean_model.layers if layer.moe is not None)
        gate_up = moe.weights.gate_up
        assert moe.backend == "cpu_kernel" and gate_up.untyped_storage().nbytes() > gate_up.nbytes  # in the arena
    params = SamplingParams(max_new_tokens=6)
    outputs = {o.request_id: o for o in engine.generate((i, p, params) for i, p in enumerate(prompts))}
    for i, prompt in enumerate(prompts):
        assert outputs[i].output_token_ids == hf_greedy(model_dir, prompt, 6), f"prompt {i}"
