"""The engine end to end on a GPU: a random ~0.35B Llama with CUDA graphs and async batching off and on.

Run on a CUDA machine, from the repository root::

    PYTHONPATH=. python -m benchmarks.gpu_engine_check            # kernel checks (kernels.gpu_check), then this
    PYTHONPATH=. python -m benchmarks.gpu_engine_check --engine-only

It prints the kernel table of ``kernels.gpu_check`` and then one row per mode: generated tokens/s, speed-up over
the plain mode, whether outputs equal the plain mode's, and the fraction of the measured copy bandwidth that
decode-only steps reach (weights plus the KV read per step / step time). Without CUDA it says so and exits 0. It
reads engine internals (the KV tensor, the scheduler's queues) to count bytes, which is why it lives here and not
in ``kernels/``.
"""

from __future__ import annotations

import sys

import torch

ENGINE_MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                    num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)  # ~0.35B params


def _engine_workload(vocab_size: int, num_requests: int, max_prompt: int, max_new_tokens: int, seed: int = 0):
    from engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max_prompt // 16, max_prompt, (num_requests,), generator=g).tolist()
    return [(i, torch.randint(3, vocab_size, (n,), generator=g).tolist(),
             SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)) for i, n in enumerate(lengths)]


def _run_engine(model_dir: str, config, workload) -> tuple[float, dict, list[float]]:
    """Generated tokens/s, outputs, and the bytes/s each decode-only step moved (weights + KV read)."""
    import time

    from engine import LLMEngine

    engine = LLMEngine.from_pretrained(model_dir, config)
    param_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv = engine.model_runner.kv_cache.kv
    kv_bytes_per_token = kv[:, 0, 0].numel() * kv.element_size() * engine.model.config.num_hidden_layers
    for request_id, prompt, params in workload:
        engine.add_request(request_id, prompt, params)
    outputs, decode_bytes_per_s = {}, []
    sync = torch.cuda.synchronize if kv.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        decode_only = not engine.scheduler.waiting and all(r.num_tokens_to_compute == 1 for r in running)
        context = sum(r.num_tokens for r in running)
        t0 = time.perf_counter()
        for out in engine.step():
            outputs[out.request_id] = out.output_token_ids
        if decode_only and running:
            decode_bytes_per_s.append((param_bytes + context * kv_bytes_per_token) / (time.perf_counter() - t0))
    sync()
    elapsed = time.perf_counter() - start
    return engine.stats.num_generated_tokens / elapsed, outputs, decode_bytes_per_s


def engine_benchmark(copy_bandwidth: float | None = None, device: str = "cuda", model: dict = ENGINE_MODEL,
                     num_requests: int = 128, max_prompt: int = 1024, max_new_tokens: int = 128) -> dict:
    """End-to-end engine throughput on a random Llama (~0.35B by default) with CUDA graphs and async batching
    off and on, and the fraction of copy bandwidth that decode-only steps reach. Prints a table; returns
    ``{(cuda_graphs, async_batching): tokens/s}``. Without CUDA only the plain mode runs.
    """
    import statistics
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM

    from engine import EngineConfig

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    workload = _engine_workload(model["vocab_size"], num_requests, max_prompt, max_new_tokens)
    modes = (("off", "off"), ("on", "off"), ("on", "on")) if device == "cuda" else (("off", "off"),)
    results = {}
    with tempfile.TemporaryDirectory(prefix="cbrun-gpu-check-") as model_dir:  # the model is removed afterwards
        LlamaForCausalLM(LlamaConfig(**model)).to(dtype).save_pretrained(model_dir)
        for graphs, overlap in modes:
            config = EngineConfig(device=device, dtype=str(dtype).removeprefix("torch."), page_size=16,
                                  max_batch_tokens=2048, max_requests_per_batch=128, cuda_graphs=graphs,
                                  async_batching=overlap, max_memory_percent=0.5 if device == "cuda" else 0.1)
            results[(graphs, overlap)] = _run_engine(model_dir, config, workload)
    base_tps, base_out, _ = results[("off", "off")]
    print()
    print("engine | cuda graphs | async | tokens/s | speed-up | outputs == plain | decode bandwidth fraction (median)")
    for (graphs, overlap), (tps, outputs, bw) in results.items():
        same = sum(outputs[k] == base_out[k] for k in base_out)
        frac = f"{statistics.median(bw) / copy_bandwidth:.2f}" if bw and copy_bandwidth else "n/a"
        print(f"cbrun  | {graphs:11} | {overlap:5} | {tps:8.0f} | {tps / base_tps:7.2f}x | "
              f"{same}/{len(base_out)} | {frac}")
    return {mode: tps for mode, (tps, _, _) in results.items()}


def main(argv: list[str] | None = None) -> int:
    """Kernel checks (unless ``--engine-only``), then the engine modes. Returns 1 when a kernel check failed."""
    argv = sys.argv[1:] if argv is None else argv
    if not torch.cuda.is_available():
        print("gpu_engine_check: no CUDA device here, nothing to run")
        return 0
    from kernels import gpu_check

    status = 0 if "--engine-only" in argv else gpu_check.main()
    engine_benchmark(gpu_check.measure_ceilings("cuda", gpu_check.cuda_bench)[0])
    return status


if __name__ == "__main__":
    sys.exit(main())
