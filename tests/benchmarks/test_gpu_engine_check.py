"""The GPU engine check (benchmarks.gpu_engine_check), shrunk to run on the CPU."""


def test_gpu_check_engine_benchmark_runs_on_a_tiny_cpu_model(capsys, tmp_path, monkeypatch):
    """The GPU check's engine part, shrunk to a tiny model on the CPU, so its first GPU run is not its first run;
    it leaves no model directory behind."""
    import tempfile

    from benchmarks.gpu_engine_check import engine_benchmark

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128)
    result = engine_benchmark(None, device="cpu", model=tiny, num_requests=4, max_prompt=32, max_new_tokens=4)
    assert set(result) == {("off", "off")} and result[("off", "off")] > 0
    out = capsys.readouterr().out
    assert "cuda graphs | async" in out and "4/4" in out
    assert not list(tmp_path.glob("cbrun-gpu-check-*"))
