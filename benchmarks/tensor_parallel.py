"""Tensor parallelism on the CPU: step time at ``tensor_parallel_size`` 1 and 2, and the all-reduce's share.

Usage (from the repository root)::

    python -m benchmarks.tensor_parallel [--rounds 3] [--requests 16] [--prompt-len 64] [--new-tokens 32]
        [--model-dir DIR] [--quantization fp8] [--jsonl FILE]

The model is a random Llama large enough that its GEMMs dominate a step (hidden 1024, intermediate 4096, 16 heads
and 8 KV heads of 64, 4 layers, vocabulary 8000: 76M parameters, float32), built once in ``--model-dir``. Each run
is its own process (``--one TP THREADS``): it loads the model with ``EngineConfig(tensor_parallel_size=TP,
num_threads=THREADS)`` (threads per rank; gloo between the ranks), adds ``--requests`` greedy requests of
``--prompt-len`` random ids and ``--new-tokens`` tokens each, and steps the engine until they are done, timing
every ``LLMEngine.step``. The settings are:

- tp 1 x 1 thread: the baseline, one core;
- tp 1 x 2 threads: both cores in one process (torch's intra-op threads);
- tp 2 x 1 thread per rank: both cores, one rank each.

A step that prefills (any prompt token in it) and a decode step are reported apart: the median step time of each
kind, and rank 0's time inside the forward pass's collectives per step (``GroupCommunicator.seconds``: the
all-reduces after o_proj and down_proj, the embedding's all-reduce, the logits' all-gather; it includes waiting for
the other rank to reach the collective, so it is an upper bound on the communication itself). The settings run
round-robin ``--rounds`` times; the table gives each one's median over rounds, and whether every run's greedy
tokens were the same (tp 2 must equal tp 1).

``--quantization fp8`` runs the same model with its projections quantized to float8 with one scale per 128 x 128
block (the ``fp8`` layout of Qwen3-FP8 and DeepSeek-V3, written by ``quantize_fp8``; embeddings, norms and LM head
stay float32), each rank reading and holding its slices of them; the table then also gives rank 0's resident weight
bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.random_model import saved_random_model
from cbrun.bench.workloads import llama_shape

SETTINGS = ((1, 1), (1, 2), (2, 1))  # (tensor_parallel_size, threads per rank)
MODEL = dict(**llama_shape(1024, 4, 16, 8, 4096), vocab_size=8000, max_position_embeddings=512)


def build_model(model_dir: Path) -> Path:
    """The random Llama of ``MODEL`` in ``model_dir`` (safetensors), built once."""
    return saved_random_model(model_dir, "LlamaForCausalLM", **MODEL)


#: The projections ``quantize_fp8`` quantizes, by module name.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_BLOCK = 128


def quantize_fp8(model_dir: Path, out_dir: Path) -> Path:
    """``model_dir`` with every projection as float8_e4m3fn and a ``weight_scale_inv`` per 128 x 128 block (each
    block's max |w| over 448, round to nearest), in ``out_dir``, built once."""
    if (out_dir / "config.json").is_file():
        return out_dir
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    fp8, block = torch.float8_e4m3fn, FP8_BLOCK
    tensors = {}
    for name, weight in load_file(str(model_dir / "model.safetensors")).items():
        if name.rsplit(".", 2)[-2] not in PROJECTIONS:
            tensors[name] = weight
            continue
        rows, cols = weight.shape
        blocks = weight.abs().view(rows // block, block, cols // block, block).amax(dim=(1, 3))
        scale = (blocks / torch.finfo(fp8).max).clamp(min=1e-12)
        expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        tensors[name] = (weight / expanded).to(fp8)
        tensors[name[: -len("weight")] + "weight_scale_inv"] = scale
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (out_dir / "config.json").write_text(json.dumps(config))
    for extra in model_dir.iterdir():
        if extra.name not in ("model.safetensors", "config.json"):
            shutil.copy(extra, out_dir / extra.name)
    return out_dir


def one_run(model_dir: Path, tp: int, threads: int, requests: int, prompt_len: int, new_tokens: int) -> dict:
    """One timed generation in this process (rank 0); returns its figures."""
    import torch

    from cbrun.engine import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(
        device="cpu",
        dtype="float32",
        tensor_parallel_size=tp,
        num_threads=threads,
        max_batch_tokens=512,
        max_requests_per_batch=requests,
        num_blocks=64,
    )
    engine = LLMEngine.from_pretrained(str(model_dir), config)
    weight_bytes = sum(t.numel() * t.element_size() for t in engine.model.parameters())  # rank 0's shard
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for i in range(requests):
        engine.add_request(
            i, torch.randint(0, MODEL["vocab_size"], (prompt_len,), generator=generator).tolist(), params
        )
    comm = engine.tp_group.comm if engine.tp_group is not None else None
    prefill, decode, prefill_comm, decode_comm, tokens = [], [], [], [], {}
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            prefilling = any(r.num_computed_tokens < len(r.prompt_token_ids) for r in _requests(engine))
            comm_before = comm.seconds if comm else 0.0
            start = time.perf_counter()
            outputs = engine.step()
            wall = time.perf_counter() - start
            spent = (comm.seconds - comm_before) if comm else 0.0
            (prefill if prefilling else decode).append(wall)
            (prefill_comm if prefilling else decode_comm).append(spent)
            for output in outputs:
                tokens[output.request_id] = output.output_token_ids
    engine.close()
    ordered = [tokens[i] for i in range(requests)]
    return dict(
        tp=tp,
        threads=threads,
        prefill_steps=len(prefill),
        decode_steps=len(decode),
        prefill_ms=1e3 * statistics.median(prefill),
        decode_ms=1e3 * statistics.median(decode),
        prefill_comm_ms=1e3 * statistics.median(prefill_comm),
        decode_comm_ms=1e3 * statistics.median(decode_comm),
        outputs=hashlib.sha256(str(ordered).encode()).hexdigest()[:12],
        weight_mib=weight_bytes / 2**20,
    )


def _requests(engine):
    """The scheduler's unfinished requests (waiting and running), read for the step kind only."""
    scheduler = engine.scheduler
    return [*scheduler.waiting, *scheduler.running]


def _table(runs: list[dict]) -> str:
    lines = [
        "| tensor_parallel_size x threads | decode step (ms) | of it in collectives | prefill step (ms) | of it in "
        "collectives | decode vs tp 1 x 1 | decode vs tp 1 x 2 | same tokens | rank 0 weights (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    median = {}
    for tp, threads in SETTINGS:
        mine = [r for r in runs if (r["tp"], r["threads"]) == (tp, threads)]
        median[(tp, threads)] = {
            k: statistics.median(r[k] for r in mine) for k in mine[0] if k.endswith(("_ms", "_mib"))
        }
    hashes = {r["outputs"] for r in runs}
    for tp, threads in SETTINGS:
        m = median[(tp, threads)]
        lines.append(
            f"| {tp} x {threads} | {m['decode_ms']:.1f} | {m['decode_comm_ms']:.1f} | {m['prefill_ms']:.1f} | "
            f"{m['prefill_comm_ms']:.1f} | {median[(1, 1)]['decode_ms'] / m['decode_ms']:.2f}x | "
            f"{median[(1, 2)]['decode_ms'] / m['decode_ms']:.2f}x | {len(hashes) == 1} | {m['weight_mib']:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/cbrun-tp-bench-llama"))
    parser.add_argument("--quantization", choices=("fp8",), help="run the model's FP8 block-quantized copy")
    parser.add_argument("--jsonl", help="also write every run here, one JSON object per line")
    parser.add_argument("--one", nargs=2, type=int, metavar=("TP", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.requests, args.prompt_len, args.new_tokens)
    if args.one:
        print(json.dumps(one_run(args.model_dir, *args.one, *shape)))
        return 0
    model_dir = build_model(args.model_dir)
    if args.quantization == "fp8":
        model_dir = quantize_fp8(model_dir, model_dir.with_name(model_dir.name + "-fp8"))
    runs = []
    for _ in range(args.rounds):
        for tp, threads in SETTINGS:
            command = [sys.executable, "-m", "benchmarks.tensor_parallel", "--one", str(tp), str(threads)]
            command += ["--requests", str(args.requests), "--prompt-len", str(args.prompt_len)]
            command += ["--new-tokens", str(args.new_tokens), "--model-dir", str(model_dir)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), file=sys.stderr)
    if args.jsonl:
        Path(args.jsonl).write_text("".join(json.dumps(r) + "\n" for r in runs))
    print(_table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
