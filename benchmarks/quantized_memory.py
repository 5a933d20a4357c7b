"""Peak memory of a quantized checkpoint's run against the same weights dequantized, on the CPU.

Usage (from the repository root)::

    python -m benchmarks.quantized_memory [--model-dir DIR] [--requests 8] [--new-tokens 16]

The model is a random Llama (hidden 1024, intermediate 4096, 16 heads and 8 KV heads of 64, 4 layers, vocabulary
8000: 76M parameters, float32; ``benchmarks.tensor_parallel``'s). Its decoder projections are quantized into each
layout by the test suite's own writers (``tests/engine/model/test_int4_quantization.py``: compressed-tensors
``pack-quantized`` and GPTQ, int4 group 128; ``tests/engine/model/test_quantization.py``: FP8 128x128 blocks), each
beside a float32 checkpoint of the same weights dequantized. Each run is its own process: it imports cbrun, notes
its resident set and resets its peak (``/proc/self/clear_refs``, ``VmHWM``), loads the engine (float32, lean path, 64 blocks), generates ``--requests``
greedy requests of 32 random ids and ``--new-tokens`` tokens, and reports the peak resident set again, the bytes
its model holds (``parameters()``), and a hash of its tokens. "Run peak" is the second peak minus the first (the
interpreter and torch); the table compares it with the dequantized checkpoint's.

The ``mxfp4`` rows are a random gpt-oss instead (``GPT_OSS``: hidden 512, 4 layers, 16 experts of width 512, 4 per
token, 8 heads and 2 KV heads of 64, vocabulary 8000: 59M parameters, 50M of them in the experts, float32), its
experts stored as MXFP4 in the real checkpoint layout (``tests/engine/model/test_gpt_oss.py``'s writer) beside the
same weights dequantized; the MXFP4 run dequantizes its experts a chunk at a time in each forward pass.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.random_model import saved_random_model
from cbrun.bench.workloads import llama_shape

LAYOUTS = ("dequantized", "ct-sym", "gptq", "fp8-block", "mxfp4")
#: The random gpt-oss of the ``mxfp4`` rows.
GPT_OSS = dict(
    **llama_shape(512, 4, 8, 2, 512),
    vocab_size=8000,
    head_dim=64,
    max_position_embeddings=256,
    num_local_experts=16,
    num_experts_per_tok=4,
    sliding_window=16,
)


def one_run(model_dir: str, requests: int, new_tokens: int) -> dict:
    import torch

    from cbrun.engine import EngineConfig, LLMEngine, SamplingParams

    before = _reset_peak()
    config = EngineConfig(dtype="float32", num_blocks=64, num_threads=1, max_batch_tokens=256)
    engine = LLMEngine.from_pretrained(model_dir, config)
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    prompts = [torch.randint(0, 8000, (32,), generator=generator).tolist() for _ in range(requests)]
    outputs = {o.request_id: o.output_token_ids for o in engine.generate((i, p, params) for i, p in enumerate(prompts))}
    after = _status_kib("VmHWM")
    held = sum(t.numel() * t.element_size() for t in engine.model.parameters())
    tokens = hashlib.sha256(json.dumps([outputs[i] for i in range(requests)]).encode()).hexdigest()[:12]
    return {"base_kib": before, "peak_kib": after, "weight_bytes": held, "tokens": tokens}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> int:
    """Reset this process's peak resident set to its current one (``clear_refs`` 5); returns it in KiB.

    NOTE: ``ru_maxrss`` survives ``execve``, so a child started by a parent holding the checkpoints' tensors would
    report the parent's peak; ``VmHWM`` after a reset is this run's own."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def checkpoints(model_dir: Path, layouts: tuple[str, ...] = LAYOUTS[1:]) -> dict[str, Path]:
    """{layout: checkpoint dir} of ``layouts``, the quantized ones beside their dequantized twin (the same
    weights)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.engine.model import test_gpt_oss as mxfp4
    from tests.engine.model import test_int4_quantization as int4
    from tests.engine.model import test_quantization as fp8

    found = {}
    for layout in layouts:
        if layout == "mxfp4":
            gpt_oss = _gpt_oss(model_dir.parent / "cbrun-bench-gpt-oss")
            quantized, dequantized = mxfp4.mxfp4_pair(gpt_oss, gpt_oss.parent / "cbrun-bench-gpt-oss-mxfp4")
        else:
            writer = fp8 if layout == "fp8-block" else int4
            quantized, dequantized = writer._quantized_copy(model_dir, layout)
        found[layout], found[f"{layout} dequantized"] = quantized, dequantized
    return found


def _gpt_oss(model_dir: Path) -> Path:
    """The random gpt-oss of ``GPT_OSS`` (no special tokens) in ``model_dir`` (safetensors), built once."""
    return saved_random_model(model_dir, "GptOssForCausalLM", **GPT_OSS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/cbrun-bench-tp-llama"))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS[1:], default=list(LAYOUTS[1:]))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one, args.requests, args.new_tokens)))
        return
    from benchmarks.tensor_parallel import build_model

    runs = {}
    for name, path in checkpoints(build_model(args.model_dir), tuple(args.layouts)).items():
        command = [sys.executable, "-m", "benchmarks.quantized_memory", "--one", str(path)]
        command += ["--requests", str(args.requests), "--new-tokens", str(args.new_tokens)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        runs[name] = json.loads(out.strip().splitlines()[-1])
    print("| checkpoint | weights held (MiB) | run peak RSS (MiB) | vs its dequantized twin | tokens |")
    print("|---|---|---|---|---|")
    for layout in args.layouts:
        twin = runs[f"{layout} dequantized"]
        for name in (f"{layout} dequantized", layout):
            run = runs[name]
            peak = (run["peak_kib"] - run["base_kib"]) / 1024
            twin_peak = (twin["peak_kib"] - twin["base_kib"]) / 1024
            print(
                f"| {name} | {run['weight_bytes'] / 2**20:.1f} | {peak:.1f} | {peak - twin_peak:+.1f} MiB | "
                f"{run['tokens']} |"
            )


if __name__ == "__main__":
    main()
