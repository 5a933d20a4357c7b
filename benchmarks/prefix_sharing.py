"""Prefix sharing on a GSM8K few-shot workload (stories260K): prefill tokens computed, prefix hit rate, tokens/s.

Usage (from the repo root, after ``cbrun convert-llama2c ../shared/models/stories260K/stories260K.bin
../shared/models/stories260K/tok512.bin models/stories260K``):

    python -m benchmarks.prefix_sharing [--rows 1319] [--max-new-tokens 32] [--num-blocks 4096]
    python -m benchmarks.prefix_sharing --measure-k        # prompt lengths for k = 0..3 exemplars
    python -m benchmarks.prefix_sharing --write-manifest   # (re)write manifests/gsm8k-fewshot.toml

Each run goes through ``run_job`` (so the job's own ordering is what is measured) on a fresh engine (an empty
prefix cache), one CPU thread, greedy. Template A puts train exemplars 0..k-1 before each test question, template
B exemplars k..2k-1:

    a    sharing off (engine.allow_block_sharing = false), arrival order, template A
    b    sharing on, arrival order, template A
    b'   sharing on, arrival order, a shuffled mix of A and B rows (50/50)
    bs   sharing on, arrival order, the same mix sorted by template (all A rows, then all B rows)
    c    sharing on, prefix-aware ordering (input.order_window = 4096), the shuffled mix

and, beyond the issue's four, where ordering should matter: many templates and a cache too small to keep all their
prefixes (``--templates`` 1-shot templates from the shortest of the first 256 train exemplars, ``--tight-blocks``):

    d'   sharing on, arrival order, shuffled many-template mix, tight cache
    d    sharing on, prefix-aware ordering, the same input and cache

Columns: prefill computed = tokens run through the model minus decode tokens (prompt tokens minus cached ones, plus
any recomputation); exemplar computed = per row, the tokens of its template's shared prefix (the longest common
prefix of all its prompts' token ids) that were not served from the prefix cache, summed; hit rate = cached prompt
tokens / prompt tokens; gen tok/s = generated tokens / wall seconds of the job.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cbrun.bench.workloads import fewshot_template, gsm8k_path
from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.config.manifest import JobManifest
from cbrun.jobs.config.settings import InputSettings, ModelSettings, OutputSettings

REPO = Path(__file__).resolve().parents[1]
#: GSM8K from the shared folder ($CBRUN_SHARED, else shared/ beside the checkout).
TRAIN = gsm8k_path("train")
TEST = gsm8k_path("test")
MODEL = REPO / "models" / "stories260K"
MANIFEST = REPO / "manifests" / "gsm8k-fewshot.toml"
K = 1  # exemplars per template; see --measure-k


# ---- the few-shot template ------------------------------------------------------------------------------------
def exemplars(first: int, k: int) -> list[dict]:
    return pq.read_table(TRAIN, columns=["question", "answer"]).slice(first, k).to_pylist()


def toml_multiline(text: str) -> str:
    """``text`` as a TOML multi-line basic string (backslashes, quotes and control characters escaped)."""
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch == "\n":
            out.append("\n")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"""\n' + "".join(out) + '"""'


def measure_k(max_new_tokens: int, tokenizer) -> list[dict]:
    """Prompt lengths of the GSM8K test rows under template A for k = 0..3 exemplars."""
    from os.path import commonprefix

    questions = pq.read_table(TEST, columns=["question"]).column(0).to_pylist()
    limit = _max_model_len()
    results = []
    for k in range(4):
        template = fewshot_template(exemplars(0, k))
        ids = [tokenizer.encode(template.format(question=q)) for q in questions]
        lengths = [len(i) for i in ids]
        results.append(
            {
                "k": k,
                "shared_prefix": len(commonprefix(ids)),
                "longest_prompt": max(lengths),
                "fit": sum(n + max_new_tokens <= limit for n in lengths),
                "cut_by_context": sum(n < limit < n + max_new_tokens for n in lengths),
                "too_long": sum(n >= limit for n in lengths),
            }
        )
    return results


def write_manifest(k: int, max_new_tokens: int, tokenizer) -> None:
    rows = {r["k"]: r for r in measure_k(max_new_tokens, tokenizer)}
    longest_question = max(
        len(tokenizer.encode(q)) for q in pq.read_table(TEST, columns=["question"]).column(0).to_pylist()
    )
    template = fewshot_template(exemplars(0, k))
    r = rows[k]
    limit, prefix, fit = _max_model_len(), r["shared_prefix"], r["fit"]
    cut, too_long = r["cut_by_context"], r["too_long"]
    text = f"""# GSM8K test questions after a {k}-shot prompt (exemplars 0..{k - 1} of gsm8k_train.parquet, question and
# answer) through the tiny stories260K model (greedy), on CPU. Every prompt shares the exemplar prefix, which the
# engine's prefix cache serves; input.order_window orders rows by prompt so that shared prefixes run together.
#
# Generated by `python -m benchmarks.prefix_sharing --write-manifest`. Why k = {k}: stories260K reads {limit} tokens
# (prompt + completion) and the longest test question alone is {longest_question} tokens, so no k >= 1 fits every
# row. With k = {k} the shared prefix is {prefix} tokens; with max_new_tokens = {max_new_tokens}, {fit:,} of 1,319
# rows fit whole, {cut} stop early at the {limit}-token context and {too_long} prompts are too long (error
# rows; the job goes on). k = {k + 1} would make {rows[k + 1]["too_long"]:,} prompts too long.
#
# Run from the repository root, after creating the model directory once with
#   cbrun convert-llama2c ../shared/models/stories260K/stories260K.bin \\
#       ../shared/models/stories260K/tok512.bin models/stories260K
# then
#   cbrun run manifests/gsm8k-fewshot.toml

[model]
path = "models/stories260K"

[input]
path = "../shared/data/gsm8k_test.parquet"
id_column = "id"
order_window = 4096
template = {toml_multiline(template)}

[sampling]
max_new_tokens = {max_new_tokens}
temperature = 0.0
seed = 0

[engine]
page_size = 16
max_batch_tokens = 512
max_requests_per_batch = 64
allow_block_sharing = true
device = "cpu"
num_threads = 1  # a 260K-parameter model runs fastest on one core

[output]
path = "out/gsm8k-fewshot"
commit_every_rows = 256
commit_every_seconds = 30.0
"""
    import tomllib

    assert tomllib.loads(text)["input"]["template"] == template, "the TOML string does not round-trip"
    MANIFEST.write_text(text)
    print(f"wrote {MANIFEST.relative_to(REPO)} (k = {k}, shared prefix {r['shared_prefix']} tokens)")


def _max_model_len() -> int:
    return json.loads((MODEL / "config.json").read_text())["max_position_embeddings"]


# ---- the runs -------------------------------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    description: str
    rows_run: int
    prompt_tokens: int
    cached_tokens: int
    prefill_computed: int
    exemplar_tokens: int
    exemplar_computed: int
    generated: int
    soft_resets: int
    evicted_blocks: int
    wall_s: float
    input_name: str = ""
    same_outputs: str = ""

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def write_input(path: Path, questions: list[str], ids: list[str], templates: list[str]) -> None:
    prompts = [t.format(question=q) for t, q in zip(templates, questions)]
    pq.write_table(pa.table({"id": ids, "prompt": prompts}), path, row_group_size=256)


def shared_prefix_lengths(tokenizer, templates: dict[str, str], questions: list[str]) -> dict[str, int]:
    """Per template: the longest common prefix of the token ids of all its prompts (all test questions)."""
    from os.path import commonprefix

    return {
        name: len(commonprefix(tokenizer([t.format(question=q) for q in questions])["input_ids"]))
        for name, t in templates.items()
    }


def short_exemplar_templates(tokenizer, count: int) -> dict[str, str]:
    """1-shot templates "T0".."T{count-1}" from the ``count`` shortest of the first 256 train exemplars."""
    pool = exemplars(0, 256)
    lengths = tokenizer([e["question"] + e["answer"] for e in pool])["input_ids"]
    chosen = sorted(range(len(pool)), key=lambda i: (len(lengths[i]), i))[:count]
    return {f"T{j}": fewshot_template([pool[i]]) for j, i in enumerate(chosen)}


def run_one(
    name: str,
    description: str,
    input_path: Path,
    work: Path,
    *,
    sharing: bool,
    order_window: int,
    max_new_tokens: int,
    num_blocks: int,
    prefix_of: dict[str, int],
) -> Result:
    """One job on a fresh engine; per-row cached tokens are read off the engine's finished requests."""
    import torch

    from cbrun.engine import LLMEngine
    from cbrun.jobs.run.job import run_job

    torch.set_num_threads(1)
    config = EngineConfig(
        page_size=16,
        max_batch_tokens=512,
        max_requests_per_batch=64,
        num_blocks=num_blocks,
        allow_block_sharing=sharing,
        device="cpu",
        num_threads=1,
    )
    engine = LLMEngine.from_pretrained(str(MODEL), config)
    cached_by_row: dict[int, int] = {}
    finish = engine._finish

    def recording_finish(request):  # benchmark-only instrumentation: each request's cached prompt tokens
        cached_by_row[request.request_id[0]] = request.num_cached_tokens
        return finish(request)

    engine._finish = recording_finish
    manifest = JobManifest(
        model=ModelSettings(path=str(MODEL)),
        input=InputSettings(path=str(input_path), prompt_column="prompt", id_column="id", order_window=order_window),
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
        engine=config,
        output=OutputSettings(path=str(work / name), commit_every_rows=256, overwrite=True),
    )
    start = time.perf_counter()
    run_job(manifest, progress=False, engine=engine)
    wall = time.perf_counter() - start
    stats = engine.stats
    ok = stats.num_requests - stats.num_failed_requests
    prefill = stats.num_computed_tokens - (stats.num_generated_tokens - ok)
    ids = pq.read_table(input_path, columns=["id"]).column(0).to_pylist()
    exemplar_tokens = exemplar_computed = 0
    for row_index, cached in cached_by_row.items():
        shared = prefix_of[ids[row_index].split(":")[0]]
        exemplar_tokens += shared
        exemplar_computed += shared - min(cached, shared)
    return Result(
        name,
        description,
        len(cached_by_row),
        stats.num_prompt_tokens,
        stats.num_cached_prompt_tokens,
        prefill,
        exemplar_tokens,
        exemplar_computed,
        stats.num_generated_tokens,
        stats.num_soft_resets,
        stats.num_evicted_blocks,
        wall,
    )


def run_all(args, tokenizer) -> list[Result]:
    test = pq.read_table(TEST, columns=["id", "question"]).slice(0, args.rows).to_pylist()
    questions = [r["question"] for r in test]
    templates = {"A": fewshot_template(exemplars(0, args.k)), "B": fewshot_template(exemplars(args.k, args.k))}
    prefix_of = shared_prefix_lengths(tokenizer, templates, questions)
    print(
        f"shared prefix: A (exemplars 0..{args.k - 1}) {prefix_of['A']} tokens, "
        f"B (exemplars {args.k}..{2 * args.k - 1}) {prefix_of['B']} tokens",
        flush=True,
    )
    rng = random.Random(0)
    mix = [rng.choice("AB") for _ in test]
    work = Path(tempfile.mkdtemp(prefix="cbrun-prefix-sharing-"))
    # Row ids carry the template ("A:<gsm8k id>") so each row's shared prefix is known afterwards.
    single = [(f"A:{r['id']}", r["question"], "A") for r in test]
    shuffled = [(f"{t}:{r['id']}", r["question"], t) for r, t in zip(test, mix)]
    rng.shuffle(shuffled)
    by_template = sorted(shuffled, key=lambda row: row[2])  # stable: A rows, then B rows
    for name, rows in (("single", single), ("shuffled", shuffled), ("sorted", by_template)):
        write_input(
            work / f"{name}.parquet",
            [q for _, q, _ in rows],
            [i for i, _, _ in rows],
            [templates[t] for _, _, t in rows],
        )
    plan = [
        ("a", "sharing off, arrival order, template A", "single", False, 0),
        ("b", "sharing on, arrival order, template A", "single", True, 0),
        ("b'", "sharing on, arrival order, shuffled A/B mix", "shuffled", True, 0),
        ("bs", "sharing on, arrival order, A/B mix sorted by template", "sorted", True, 0),
        (
            "c",
            f"sharing on, prefix-aware order (window {args.order_window}), shuffled A/B mix",
            "shuffled",
            True,
            args.order_window,
        ),
    ]
    if args.templates:
        many = short_exemplar_templates(tokenizer, args.templates)
        templates.update(many)
        prefix_of.update(shared_prefix_lengths(tokenizer, many, questions))
        names = sorted(many)
        rows = [(f"{t}:{r['id']}", r["question"], t) for r in test for t in [rng.choice(names)]]
        rng.shuffle(rows)
        write_input(
            work / "many.parquet", [q for _, q, _ in rows], [i for i, _, _ in rows], [templates[t] for _, _, t in rows]
        )
        what = f"{args.templates}-template shuffled mix, {args.tight_blocks} blocks"
        plan += [
            ("d'", f"sharing on, arrival order, {what}", "many", True, 0),
            (
                "d",
                f"sharing on, prefix-aware order (window {args.order_window}), {what}",
                "many",
                True,
                args.order_window,
            ),
        ]
    results = []
    for name, description, data, sharing, window in plan:
        num_blocks = args.tight_blocks if data == "many" else args.num_blocks
        result = run_one(
            name.replace("'", "p"),
            description,
            work / f"{data}.parquet",
            work,
            sharing=sharing,
            order_window=window,
            max_new_tokens=args.max_new_tokens,
            num_blocks=num_blocks,
            prefix_of=prefix_of,
        )
        result.name, result.input_name = name, data
        results.append(result)
        print(f"  {name}: {result.wall_s:.1f} s", flush=True)
    check_outputs(results, work)
    return results


def check_outputs(results: list[Result], work: Path) -> None:
    """Sets ``same_outputs``: whether each run's completions, by row id, equal those of the first run on the same
    rows (the sorted mix holds the shuffled mix's rows in another order)."""
    from cbrun.jobs.output.output_dir import read_output

    first: dict[str, tuple[str, dict]] = {}
    for r in results:
        table = read_output(work / r.name.replace("'", "p"), columns=["id", "completion_token_ids"])
        outputs = dict(zip(table.column("id").to_pylist(), table.column("completion_token_ids").to_pylist()))
        rows = "shuffled" if r.input_name == "sorted" else r.input_name
        if rows not in first:
            first[rows] = (r.name, outputs)
            r.same_outputs = "(reference)"
        else:
            name, reference = first[rows]
            r.same_outputs = f"{'yes' if outputs == reference else 'NO'} (vs {name})"


def table(results: list[Result]) -> str:
    lines = [
        "| run | what | rows run | prompt tokens | prefill computed | exemplar computed (% of exemplar tokens) | "
        "hit rate | gen tokens | gen tok/s | wall s | evicted blocks | same outputs |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        share = 100 * r.exemplar_computed / r.exemplar_tokens if r.exemplar_tokens else 0.0
        lines.append(
            f"| {r.name} | {r.description} | {r.rows_run} | {r.prompt_tokens:,} | {r.prefill_computed:,} | "
            f"{r.exemplar_computed:,} ({share:.1f}%) | {r.hit_rate:.1%} | {r.generated:,} | "
            f"{r.generated / r.wall_s:,.0f} | {r.wall_s:.1f} | {r.evicted_blocks:,} | {r.same_outputs} |"
        )
    return "\n".join(lines)


def targets(results: list[Result]) -> list[str]:
    by = {r.name: r for r in results}
    a, b, bs, c = by["a"], by["b"], by["bs"], by["c"]
    share = b.exemplar_computed / a.exemplar_computed
    return [
        f"(b) computes {share:.1%} of the exemplar tokens (a) computes (target < 5%): "
        f"{'met' if share < 0.05 else 'NOT met'}",
        f"(c) computes {c.prefill_computed:,} prefill tokens on the shuffled mix vs {bs.prefill_computed:,} for "
        f"arrival order on the sorted mix (target: no more): "
        f"{'met' if c.prefill_computed <= bs.prefill_computed else 'NOT met'}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1319)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--k", type=int, default=K, help="exemplars per template")
    parser.add_argument("--num-blocks", type=int, default=4096, help="KV-cache blocks of 16 tokens")
    parser.add_argument("--order-window", type=int, default=4096)
    parser.add_argument("--templates", type=int, default=64, help="templates of runs d' and d (0: skip them)")
    parser.add_argument("--tight-blocks", type=int, default=1024, help="KV-cache blocks of runs d' and d")
    parser.add_argument("--measure-k", action="store_true")
    parser.add_argument("--write-manifest", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    if args.measure_k:
        for row in measure_k(args.max_new_tokens, tokenizer):
            print(row)
        return
    if args.write_manifest:
        write_manifest(args.k, args.max_new_tokens, tokenizer)
        return
    print(
        f"{platform.node()} | {platform.processor() or platform.machine()} | {os.cpu_count()} CPUs | "
        f"torch {__import__('torch').__version__} | {time.strftime('%Y-%m-%d')} | rows {args.rows}, "
        f"max_new_tokens {args.max_new_tokens}, k {args.k}, num_blocks {args.num_blocks}",
        flush=True,
    )
    results = run_all(args, tokenizer)
    print(table(results))
    for line in targets(results):
        print(line)


if __name__ == "__main__":
    main()
