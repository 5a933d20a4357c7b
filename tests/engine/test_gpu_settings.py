"""GPU settings checked on the CPU: dtype "auto", cache sizing from a (fake) device memory reading, the device
guard, and the swap-out copy."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from cbrun.engine.config import EngineConfig, checkpoint_dtype
from cbrun.engine.core import cache_sizing
from cbrun.engine.model.loader import resolve_engine_dtype
from cbrun.engine.worker import device as device_module
from cbrun.engine.worker.kv_cache import device_to_host

GiB = 2**30
MODEL = SimpleNamespace(hidden_size=4096, intermediate_size=14336, vocab_size=128256)  # Llama-3-8B


@pytest.mark.parametrize(
    "device, setting, checkpoint, expected",
    [
        ("cuda", "auto", "bfloat16", "bfloat16"),
        ("cuda:1", "auto", "float16", "float16"),
        ("cuda", "auto", None, "float32"),
        ("cpu", "auto", "bfloat16", "float32"),
        ("cuda", "float32", "bfloat16", "float32"),
        ("cpu", "bfloat16", "float32", "bfloat16"),
    ],
)
def test_dtype_auto(device, setting, checkpoint, expected):
    assert EngineConfig(device=device, dtype=setting).resolve_dtype(checkpoint) == expected


def test_dtype_auto_is_the_default_and_reads_config_json(tmp_path):
    assert EngineConfig().dtype == "auto"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(str(tmp_path)) == "bfloat16"
    assert resolve_engine_dtype(str(tmp_path), EngineConfig(device="cuda")).dtype == "bfloat16"
    assert resolve_engine_dtype(str(tmp_path), EngineConfig(device="cpu")).dtype == "float32"
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"dtype": "float16"}}))
    assert checkpoint_dtype(str(tmp_path)) == "float16"
    assert checkpoint_dtype(str(tmp_path / "missing")) is None


def _cuda_blocks(monkeypatch, free, total, bytes_per_block=2 * GiB // 1024, **settings):
    monkeypatch.setattr(cache_sizing, "cuda_memory_bytes", lambda device: (free, total))
    config = EngineConfig(device="cuda", **settings)
    return cache_sizing.resolve_num_blocks(
        config, max_model_len=10**7, bytes_per_block=bytes_per_block, model_config=MODEL
    ), config


def test_cuda_cache_is_a_fraction_of_total_memory(monkeypatch):
    """80 GiB device, 16 GiB in use (weights): the cache gets 0.9 * 80 - 16 GiB less the step's workspace and the
    graph pool, whatever the free memory's 0.5 used to give."""
    blocks, config = _cuda_blocks(monkeypatch, free=64 * GiB, total=80 * GiB)
    budget = (
        int(80 * GiB * 0.9)
        - 16 * GiB
        - cache_sizing.step_workspace_bytes(config, MODEL)
        - cache_sizing.graph_pool_bytes(config, MODEL)
    )
    assert blocks == budget // (2 * GiB // 1024)
    assert blocks * 2 * GiB // 1024 > 50 * GiB
    assert cache_sizing.graph_pool_bytes(config, MODEL) >= 256 * MODEL.vocab_size * 4  # the logits of 256 rows


def test_cuda_cache_counts_other_memory_and_the_setting(monkeypatch):
    base, _ = _cuda_blocks(monkeypatch, free=64 * GiB, total=80 * GiB)
    busier, _ = _cuda_blocks(monkeypatch, free=54 * GiB, total=80 * GiB)  # another 10 GiB in use
    assert base - busier == 10 * 1024 // 2
    lower, _ = _cuda_blocks(monkeypatch, free=64 * GiB, total=80 * GiB, gpu_memory_utilization=0.5)
    assert base - lower == int(0.4 * 80 * 1024) // 2
    no_graphs, _ = _cuda_blocks(monkeypatch, free=64 * GiB, total=80 * GiB, cuda_graphs="off")
    assert no_graphs > base


def test_cuda_cache_without_room_names_the_setting(monkeypatch):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        _cuda_blocks(monkeypatch, free=8 * GiB, total=80 * GiB)


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
def test_gpu_memory_utilization_range(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)


def test_select_device_sets_the_indexed_cuda_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    device_module.select_device("cuda:1")
    assert calls == [torch.device("cuda:1")]
    device_module.select_device("cuda")  # no index: the current device stays
    device_module.select_device("cpu")
    assert len(calls) == 1
    with pytest.raises(ValueError, match="2 CUDA device"):
        device_module.select_device("cuda:2")


def test_device_to_host_returns_the_values():
    pages = torch.arange(24.0).reshape(2, 3, 4)
    assert torch.equal(device_to_host(pages[:, [2, 0]]), pages[:, [2, 0]])


@pytest.mark.parametrize("device, placed", [("cuda:1", True), ("cpu", False)])
def test_transformers_loads_straight_onto_a_cuda_device(device, placed, monkeypatch):
    """On CUDA the checkpoint is read onto the device in the engine's dtype (``device_map``), no host copy."""
    import transformers

    from cbrun.engine.model import loader

    calls = []

    class Loaded(torch.nn.Module):
        config = SimpleNamespace()

        def to(self, *args, **kwargs):
            return self

    def from_pretrained(path, **kwargs):
        calls.append(kwargs)
        return Loaded(), {"missing_keys": set()}

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    # The attention contract's load checks read a config and run a probe forward; this stand-in model has
    # neither, and placement is what this test is about (tests/engine/model/test_attention_contract.py checks them).
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: transformers.LlamaConfig())
    monkeypatch.setattr(loader, "check_attention", lambda model, config: None)
    loader._load_model("unused", EngineConfig(device=device, dtype="bfloat16"))
    assert calls[0]["dtype"] is torch.bfloat16
    assert ("device_map" in calls[0]) is placed
    if placed:
        assert calls[0]["device_map"] == torch.device("cuda:1")


def test_job_fingerprint_records_the_resolved_dtype(tmp_path):
    """dtype "auto" is float32 on the CPU and the checkpoint's on CUDA: a run records the one it uses, so an
    output started on a GPU in bf16 is not continued on the CPU in float32 (the fingerprints differ)."""
    from cbrun.jobs.config.manifest import manifest_from_dict
    from cbrun.jobs.output.fingerprint import job_fingerprint

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n')
    manifest = manifest_from_dict(
        {
            "model": {"path": str(tmp_path)},
            "input": {"path": str(tmp_path / "in.jsonl")},
            "output": {"path": str(tmp_path / "out")},
        }
    )
    assert manifest.engine.dtype == "auto"
    on = {
        device: EngineConfig(device=device).resolve_dtype(checkpoint_dtype(str(tmp_path))) for device in ("cuda", "cpu")
    }
    prints = {
        device: job_fingerprint(manifest, 1, engine_dtype=dtype)["model"]["dtype"] for device, dtype in on.items()
    }
    assert prints == {"cuda": "bfloat16", "cpu": "float32"}
