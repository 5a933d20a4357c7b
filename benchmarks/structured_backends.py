"""xgrammar against llguidance on one workload: compile time and per-step mask time at 256 rows.

Both libraries get the same tokenizer (``cbrun bench --workload structured``'s 32000-token byte-level BPE, trained
on GSM8K train) and the same schema (``cbrun.bench.structured.SCHEMA``, compact separators ", " and
": ", no free whitespace). Per library:

- compile: the tokenizer's one-time preparation (xgrammar ``TokenizerInfo``; llguidance ``LLTokenizer``), then the
  schema's grammar (xgrammar ``compile_grammar`` of the schema's EBNF; llguidance ``LLMatcher``, which compiles
  lazily, so its first mask is timed with it);
- mask: 256 matchers decode together; each step fills every unfinished row's bitmask (xgrammar: a loop over
  ``fill_next_token_bitmask``, as ``cbrun.engine.structured_output.bitmask`` does; llguidance: the same loop, and its
  parallel ``fill_next_token_bitmask_par``), then each row takes a random allowed token (one seeded generator,
  uniform over the mask) and its matcher accepts it. The time per step is the fill alone, averaged over steps.

Run: ``python -m benchmarks.structured_backends [--rows 256] [--steps 60] [--model-dir DIR]``; prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cbrun.bench.structured import SCHEMA, build_model


def xgrammar_run(tokenizer, vocab: int, eos: int, rows: int, steps: int) -> dict:
    import xgrammar as xgr

    from cbrun.engine.structured_output.compiler import _strict_json_strings

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
    prepare = time.perf_counter() - start
    start = time.perf_counter()
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False, strict_mode=True))
    compiled = compiler.compile_grammar(_strict_json_strings(ebnf))
    compile_s = time.perf_counter() - start
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    bitmask = xgr.allocate_token_bitmask(rows, vocab)

    def fill(live):
        for i in live:
            matchers[i].fill_next_token_bitmask(bitmask, i)

    times = _decode(
        fill,
        lambda i, t: matchers[i].accept_token(t),
        lambda i: matchers[i].is_terminated(),
        bitmask,
        vocab,
        rows,
        steps,
    )
    return {"prepare_s": prepare, "compile_s": compile_s, "mask_ms": times}


def llguidance_run(tokenizer, vocab: int, eos: int, rows: int, steps: int, parallel: bool) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
    prepare = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    )
    bitmask = lt.allocate_token_bitmask(rows, vocab)
    start = time.perf_counter()
    first = llguidance.LLMatcher(ll_tokenizer, grammar)
    lt.fill_next_token_bitmask(first, bitmask, 0)
    compile_s = time.perf_counter() - start
    assert not first.is_error(), first.get_error()
    matchers = [first] + [llguidance.LLMatcher(ll_tokenizer, grammar) for _ in range(rows - 1)]
    executor = llguidance.LLExecutor()

    def fill(live):
        if parallel:
            lt.fill_next_token_bitmask_par(executor, [(matchers[i], i) for i in live], bitmask)
        else:
            for i in live:
                lt.fill_next_token_bitmask(matchers[i], bitmask, i)

    times = _decode(
        fill, lambda i, t: matchers[i].consume_token(t), lambda i: matchers[i].is_stopped(), bitmask, vocab, rows, steps
    )
    return {"prepare_s": prepare, "compile_s": compile_s, "mask_ms": times}


def _decode(fill, accept, finished, bitmask, vocab: int, rows: int, steps: int) -> list[float]:
    """Step every unfinished row; returns the fill time of each step (ms)."""
    generator = torch.Generator().manual_seed(0)
    bits = torch.arange(32, dtype=torch.int32)
    times = []
    for _ in range(steps):
        live = [i for i in range(rows) if not finished(i)]
        if not live:
            break
        start = time.perf_counter()
        fill(live)
        times.append(1000 * (time.perf_counter() - start))
        allowed = ((bitmask[live, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]
        tokens = torch.multinomial(allowed.float(), 1, generator=generator)[:, 0].tolist()
        for i, token in zip(live, tokens):
            assert accept(i, token), (i, token)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--model-dir", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="cbrun-structured-")) / "model"
    tokenizer = build_model(model_dir)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    results = {
        "xgrammar": xgrammar_run(tokenizer, vocab, eos, args.rows, args.steps),
        "llguidance": llguidance_run(tokenizer, vocab, eos, args.rows, args.steps, parallel=False),
        "llguidance (parallel fill)": llguidance_run(tokenizer, vocab, eos, args.rows, args.steps, True),
    }
    print(f"{args.rows} rows, up to {args.steps} steps, vocab {vocab}")
    print("| library | tokenizer prep s | schema compile s | mask ms/step (median) | mask ms/step (mean) | steps |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['prepare_s']:.3f} | {r['compile_s']:.3f} | {statistics.median(r['mask_ms']):.2f} | "
            f"{statistics.fmean(r['mask_ms']):.2f} | {len(r['mask_ms'])} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
