"""Mixture of experts on the CPU: cbrun's lean MoE path against transformers' MoE modules, same engine, same model.

Usage (from the repository root)::

    python -m benchmarks.moe_lean [--rounds 2] [--requests 16] [--prompt-len 32] [--new-tokens 32]
        [--threads auto|N] [--model-dir DIR]
        [--impls lean,lean-grouped,transformers,transformers-eager,lean-invariant,lean-4k,transformers-4k]

The model is a random Qwen3-MoE (hidden 512, 8 heads and 4 KV heads of 64, 4 layers, 32 experts of width 256,
4 per token, vocabulary 4096: 54M parameters, float32), built once in ``--model-dir``. Each setting loads it in
one ``LLMEngine`` (``lean``: ``cbrun.engine.model.layers.moe``'s default on the CPU, the C kernel
``cbrun.kernels.cpu_moe`` at decode and the grouped GEMM for prefill; ``lean-grouped``: the lean path with the C
kernel held off, ``torch._grouped_mm`` for every step (the lean path before the kernel); ``transformers``:
``model_impl = "transformers"``, transformers' own Qwen3-MoE blocks under cbrun's attention, with transformers 5's
default ``grouped_mm`` experts; ``transformers-eager``: the same with ``set_experts_implementation("eager")``, the
per-expert loop over the experts a step hits; ``lean-invariant``: the lean path under ``engine.batch_invariant =
"on"``, each expert over its own rows through the batch-invariant linear; a ``-4k`` suffix (``lean-4k``,
``transformers-4k``): that setting with its weights left on 4 KiB pages, ``CBRUN_HUGE_PAGES=0`` while it loads,
the others' weights being moved to transparent huge pages at load, ``cbrun.engine.model.hugepages``), adds ``--requests`` greedy requests
of ``--prompt-len`` random ids and ``--new-tokens`` tokens each and steps until they finish, timing every step.
Decode tok/s is the rows of the steps with no prompt token over their time. The settings alternate ``--rounds``
times; the table gives each one's best round (the machine is shared) and whether both gave the same tokens.

Host read-backs per decode step in the forward: one decode step's forward pass (``ModelRunner._forward``) runs under
a ``TorchDispatchMode`` that counts the ops that read a value back to the host or make a data-dependent shape
(``_local_scalar_dense``: ``item`` / ``bool``; ``nonzero``, ``unique``, ``masked_select``, ``bincount``,
``repeat_interleave`` with tensor repeats; indexing by a boolean mask), named in the table.

The roofline line under the table: a decode step cannot run faster than the time to read the weights it needs once
from memory. The streaming read bandwidth is measured here (``torch.sum`` over a 256 MiB float32 tensor at
``--threads``, best of 5 each round; the best round's; the tensor on transparent huge pages where the kernel gives
them, as the weights); the bytes are every weight but the embedding table (of
which a step reads only its rows) and the experts, plus the experts a decode step's tokens hit in each MoE layer
(counted in the ``lean`` runs' decode steps, averaged), each read once. KV-cache reads and activations are left out
(under 1 MB a step here), so the ceiling is an upper bound: ``--requests`` rows / (bytes / bandwidth). The same line
gives the step's arithmetic (2 flops a weight a row: every dense weight on every row, ``k`` experts a row a layer)
at the rate ``torch.mm`` reaches on 1024 x 1024 float32 matrices: where that time nears the memory time, the
projections that see all the step's rows (attention, LM head) are bound by arithmetic, not bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections import Counter
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.random_model import saved_random_model
from cbrun.bench.workloads import llama_shape

MODEL = dict(
    **llama_shape(512, 4, 8, 4, 1024),
    vocab_size=4096,
    moe_intermediate_size=256,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    head_dim=64,
    max_position_embeddings=512,
)
SYNCING = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "bincount", "repeat_interleave")


class HostReads(TorchDispatchMode):
    """Counts, by op name, the dispatched ops that read a value back to the host or give a data-dependent shape."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        masked = func in (torch.ops.aten.index.Tensor,) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        )
        if masked or any(name.startswith(s) for s in SYNCING):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def build_model(model_dir: Path) -> Path:
    """The random Qwen3-MoE of ``MODEL`` in ``model_dir`` (safetensors), built once."""
    return saved_random_model(model_dir, "Qwen3MoeForCausalLM", **MODEL)


@contextlib.contextmanager
def _grouped_experts_only():
    """The lean MoE blocks built inside take ``torch._grouped_mm`` for every step (the C kernel held off)."""
    from cbrun.engine.model.layers import moe

    blocker = moe._cpu_kernel_blocker
    moe._cpu_kernel_blocker = lambda weights: "held off by the benchmark's lean-grouped setting"
    try:
        yield
    finally:
        moe._cpu_kernel_blocker = blocker


def _small_pages():
    """The engine loaded inside leaves its weights on 4 KiB pages (``cbrun.engine.model.hugepages.OFF_SWITCH``)."""
    from cbrun.engine.model import hugepages

    return mock.patch.dict(os.environ, {hugepages.OFF_SWITCH: "0"})


@contextlib.contextmanager
def _recorded_routes(routes: list[torch.Tensor]):
    """Each lean MoE block's expert ids (T, k), appended to ``routes`` as the blocks route."""
    from cbrun.engine.model.layers import moe

    route = moe.route

    def recording(x, weights):
        out = route(x, weights)
        routes.append(out[1].clone())
        return out

    moe.route = recording
    try:
        yield
    finally:
        moe.route = route


def one_run(model_dir: Path, model_impl: str, args) -> dict:
    """One timed generation; returns decode tok/s, the forward's host reads in one decode step, the tokens, and
    (``lean``) the number of experts each decode step's tokens hit in each MoE layer."""
    from cbrun.engine import EngineConfig, LLMEngine

    small_pages = model_impl.endswith("-4k")
    model_impl = model_impl.removesuffix("-4k")
    config = EngineConfig(
        dtype="float32",
        model_impl="lean" if model_impl.startswith("lean") else "transformers",
        loader="auto" if model_impl.startswith("lean") else "transformers",
        batch_invariant="on" if model_impl == "lean-invariant" else "off",
        num_threads=args.threads,
        max_batch_tokens=512,
        max_requests_per_batch=args.requests,
        num_blocks=256,
    )
    with (
        _grouped_experts_only() if model_impl == "lean-grouped" else contextlib.nullcontext(),
        _small_pages() if small_pages else contextlib.nullcontext(),
    ):
        engine = LLMEngine.from_pretrained(str(model_dir), config)
    if model_impl == "transformers-eager":  # transformers' per-expert loop, its default before grouped_mm
        engine.model.set_experts_implementation("eager")
    routes: list[torch.Tensor] = []
    with _recorded_routes(routes) if model_impl == "lean" else contextlib.nullcontext():
        return _timed_generation(engine, args, routes)


def _timed_generation(engine, args, routes: list[torch.Tensor]) -> dict:
    """``one_run``'s requests and step loop over a loaded engine."""
    from cbrun.engine import SamplingParams

    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(
            i, torch.randint(0, MODEL["vocab_size"], (args.prompt_len,), generator=generator).tolist(), params
        )
    counted: dict[str, int] = {}
    last: dict[str, object] = {}
    _watch_forward_and_plan(engine.model_runner, counted, last)
    decode_rows, decode_seconds, outputs, hits = 0, 0.0, {}, []
    while engine.has_unfinished_requests():
        last.clear()
        del routes[:]
        start = time.perf_counter()
        finished = engine.step()
        elapsed = time.perf_counter() - start
        for out in finished:
            outputs[out.request_id] = out.output_token_ids
        if last.get("decode"):
            decode_rows += int(last["rows"])  # type: ignore[call-overload]
            decode_seconds += elapsed
            hits += [len(set(ids.flatten().tolist())) for ids in routes]
    counted.pop("(none)", None)
    return {
        "decode_tok_s": decode_rows / decode_seconds,
        "reads": sum(counted.values()),
        "read_ops": dict(counted),
        "tokens": [outputs[i] for i in range(args.requests)],
        "experts_hit": sum(hits) / len(hits) if hits else None,
    }


def _watch_forward_and_plan(runner, counted: dict[str, int], last: dict[str, object]) -> None:
    """Counts one decode step's host reads into ``counted``; sets ``last["decode"]`` (every scheduled request has
    one query token) and ``last["rows"]`` at each launch."""
    forward, launch = runner._forward, runner.launch

    def counting_forward(input_ids, positions, md, logits_indices):
        if counted or md.max_seqlen_q != 1:  # count one decode step's forward
            return forward(input_ids, positions, md, logits_indices)
        with HostReads() as reads:
            out = forward(input_ids, positions, md, logits_indices)
        counted.update(reads.ops)
        counted.setdefault("(none)", 0)
        return out

    def watched_launch(plan, *rest, **kwargs):
        last["decode"] = bool(plan.scheduled) and all(s.num_tokens == 1 for s in plan.scheduled)
        last["rows"] = len(plan.scheduled)
        return launch(plan, *rest, **kwargs)

    runner._forward, runner.launch = counting_forward, watched_launch


def stream_bandwidth(threads: int) -> float:
    """Bytes a second ``torch.sum`` reads from a 256 MiB float32 tensor at ``threads`` threads, best of 5."""
    from cbrun.engine.model import hugepages

    torch.set_num_threads(threads)
    values = torch.ones(64 << 20)
    hugepages.place_on_huge_pages([values])
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        values.sum()
        best = min(best, time.perf_counter() - start)
    return values.numel() * values.element_size() / best


def resolve_threads(setting: str, model_dir: Path) -> int:
    """``--threads`` as a count: "auto" resolved as the engine resolves ``engine.num_threads = "auto"`` for the
    saved model (``cbrun.engine.worker.threads.resolve_num_threads``), said on stdout."""
    if setting != "auto":
        return int(setting)
    from safetensors import safe_open

    from cbrun.engine.worker.threads import resolve_num_threads

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        params = sum(torch.Size(f.get_slice(name).get_shape()).numel() for name in f.keys())
    threads = resolve_num_threads("auto", params, "cpu")
    assert threads is not None  # the CPU always gets a count
    print(f"threads: {threads} (auto: the engine's default num_threads for this {params / 1e6:.0f}M model here)")
    return threads


def weight_bytes(model_dir: Path) -> tuple[int, int]:
    """(bytes of the weights a decode step reads whole: all but the experts and the embedding table, bytes of one
    layer's one expert) of the saved model."""
    from safetensors import safe_open

    dense = 0
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if "experts" not in name and "embed_tokens" not in name:
                part = f.get_slice(name)
                dense += torch.Size(part.get_shape()).numel() * 4  # float32
    return dense, 3 * MODEL["hidden_size"] * MODEL["moe_intermediate_size"] * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--threads",
        default="auto",
        help="torch threads of every setting: a count, or auto (the default): what the engine's own default, "
        'engine.num_threads = "auto", gives this model on this machine (every physical core)',
    )
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/cbrun-bench-qwen3-moe"))
    parser.add_argument(
        "--impls",
        default="lean,lean-grouped,transformers,transformers-eager",
        help="comma-separated settings, of lean, lean-grouped, transformers, transformers-eager, lean-invariant; "
        "any with -4k: its weights on 4 KiB pages",
    )
    args = parser.parse_args()
    impls = args.impls.split(",")
    model_dir = build_model(args.model_dir)
    args.threads = resolve_threads(args.threads, model_dir)
    best: dict[str, dict] = {}
    bandwidth = 0.0
    for _ in range(args.rounds):
        bandwidth = max(bandwidth, stream_bandwidth(args.threads))  # the best round's, as the settings'
        for impl in impls:
            run = one_run(model_dir, impl, args)
            if impl not in best or run["decode_tok_s"] > best[impl]["decode_tok_s"]:
                best[impl] = run
    print_table(best)
    print_roofline(best, model_dir, bandwidth, args)


def print_table(best: dict[str, dict]) -> None:
    """The settings' best rounds, with ratios to each baseline that ran."""
    same = len({str(run["tokens"]) for run in best.values()}) == 1
    names = {
        "transformers": "transformers (grouped_mm)",
        "transformers-4k": "transformers (grouped_mm) 4 KiB pages",
        "transformers-eager": "transformers eager",
        "lean-grouped": "lean-grouped",
        "lean": "lean",
    }
    # the lean path is the baseline only where none of the others ran (``--impls lean,lean-invariant``)
    bases = [impl for impl in names if impl in best and impl != "lean"] or [b for b in ("lean",) if b in best]
    print(
        "| model_impl | decode tok/s | "
        + "".join(f"vs {names[b]} | " for b in bases)
        + "host read-backs in one decode step's forward | ops | same tokens |"
    )
    print("|---|---|" + "---|" * len(bases) + "---|---|---|")
    for impl, run in best.items():
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(run["read_ops"].items())) or "none"
        ratios = "".join(f"{run['decode_tok_s'] / best[b]['decode_tok_s']:.2f}x | " for b in bases)
        print(f"| {impl} | {run['decode_tok_s']:.1f} | {ratios}{run['reads']} | {ops} | {same} |")


def gemm_flops(threads: int) -> float:
    """Float32 multiply-adds x 2 a second of ``torch.mm`` on two 1024 x 1024 matrices at ``threads`` threads, best
    of 3: the arithmetic rate the machine reaches (a compute roof)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * 1024**3 / best


def print_roofline(best: dict[str, dict], model_dir: Path, bandwidth: float, args) -> None:
    """The decode tok/s the machine's streaming read bandwidth (bytes a second) allows, and the step's arithmetic
    at ``torch.mm``'s rate (see the module docstring)."""
    hit = next((run["experts_hit"] for run in best.values() if run.get("experts_hit")), None)
    if hit is None:
        print("\nroofline: needs the lean setting (it counts the experts a decode step hits)")
        return
    dense, expert = weight_bytes(model_dir)
    step = dense + hit * expert * MODEL["num_hidden_layers"]
    ceiling = args.requests * bandwidth / step
    # 2 flops a weight a row: the dense weights on every row, each row's k experts in every layer
    flops = 2 * args.requests * (dense + MODEL["num_experts_per_tok"] * expert * MODEL["num_hidden_layers"]) / 4
    rate = gemm_flops(args.threads)
    print(
        f"\nroofline ({args.threads} thread{'s' * (args.threads > 1)}): streaming read {bandwidth / 1e9:.1f} GB/s; "
        f"a decode step of {args.requests} rows reads {step / 1e6:.1f} MB of weights ({dense / 1e6:.1f} MB dense + "
        f"{hit:.1f} experts hit a layer on average x {MODEL['num_hidden_layers']} layers x {expert / 1e6:.2f} MB): "
        f"{step / bandwidth * 1e3:.2f} ms -> at most {ceiling:.0f} tok/s. Its arithmetic, {flops / 1e6:.0f} MFLOP, "
        f"takes {flops / rate * 1e3:.2f} ms at torch.mm's {rate / 1e9:.0f} GFLOP/s (1024^3)"
    )
    for impl, run in best.items():
        print(f"- {impl}: {run['decode_tok_s'] / ceiling:.0%} of the ceiling")
    if "transformers" in best:
        target = 3 * best["transformers"]["decode_tok_s"]
        print(f"- 3x transformers (grouped_mm) = {target:.0f} tok/s = {target / ceiling:.0%} of the ceiling")


if __name__ == "__main__":
    main()
