"""Structured outputs in the engine: every constrained output parses and matches, greedy equals a masked-argmax
oracle, and seeds, n > 1, stop strings, speculation and async batching keep working."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from cbrun.engine import LLMEngine
from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.engine.structured_output import StructuredOutputsParams
from cbrun.engine.structured_output.bitmask import StepBitmask, _fill_entry

#: Nested objects, an enum, bounded integers, a bounded array, bounded strings: its longest compact form is under
#: 200 bytes, so 300 tokens of the byte tokenizer always reach the end.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                "city": {"type": "string", "maxLength": 6},
            },
            "required": ["zip", "city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,5}-\d{2}"
CHOICES = ["yes", "no", "maybe"]
EBNF = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-z] [a-z0-9]{0,4}'
EBNF_REGEX = r"\([a-z][a-z0-9]{0,4}(,[a-z][a-z0-9]{0,4}){0,3}\)"
LARK = 'start: "[" WORD "]"\nWORD: /[a-z]{1,6}/'

CONFIG = EngineConfig(device="cpu", num_threads=1, page_size=16, max_batch_tokens=512, max_requests_per_batch=32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from cbrun.jobs.cli.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("structured") / "model", max_position_embeddings=512)


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine.from_pretrained(str(model_dir), CONFIG)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [
        [256] + torch.randint(0, 256, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def _run(engine, params_list, prompts=None) -> dict:
    prompts = prompts or _prompts(len(params_list))
    return {
        o.request_id: o
        for o in engine.generate((i, p, params) for i, (p, params) in enumerate(zip(prompts, params_list)))
    }


def _text(engine, output) -> str:
    return (
        output.text
        if output.text is not None
        else engine.tokenizer.decode(output.output_token_ids, skip_special_tokens=True)
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_rows_all_end_by_stop_and_validate(engine, temperature):
    so = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(max_new_tokens=300, temperature=temperature, seed=i, structured_outputs=so) for i in range(12)
    ]
    outputs = _run(engine, params)
    for output in outputs.values():
        assert output.finish_reason == "stop", output.error
        jsonschema.validate(json.loads(_text(engine, output)), SCHEMA)


def test_json_rows_cut_by_max_tokens_finish_by_length(engine):
    so = StructuredOutputsParams(json=json.dumps(SCHEMA))
    outputs = _run(
        engine, [SamplingParams(max_new_tokens=10, temperature=1.0, seed=i, structured_outputs=so) for i in range(4)]
    )
    for output in outputs.values():
        assert output.finish_reason == "length" and len(output.output_token_ids) == 10
        assert _text(engine, output).startswith('{"name": "')


@pytest.mark.parametrize(
    "so, matches",
    [
        (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
        (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
        (StructuredOutputsParams(grammar=EBNF), lambda t: re.fullmatch(EBNF_REGEX, t)),
        (StructuredOutputsParams(grammar=LARK), lambda t: re.fullmatch(r"\[[a-z]{1,6}\]", t)),
        (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ],
    ids=["regex", "choice", "ebnf", "lark", "json_object"],
)
def test_regex_choice_and_grammars_match(engine, so, matches):
    outputs = _run(
        engine,
        [
            SamplingParams(max_new_tokens=120, temperature=t, seed=i, structured_outputs=so)
            for i, t in enumerate([0.0, 0.7, 1.0, 1.0, 1.0, 1.0])
        ],
    )
    for output in outputs.values():
        if so.json_object and output.finish_reason == "length":
            continue  # an object of any size: a noise model may not close it
        assert output.finish_reason == "stop", output.error
        assert matches(_text(engine, output)), _text(engine, output)


def test_greedy_equals_masked_argmax_oracle(engine, model_dir):
    """Each greedy token is the argmax of transformers' logits with the grammar's disallowed tokens at -inf."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = _prompts(3)
    outputs = _run(
        engine,
        [SamplingParams(max_new_tokens=20, structured_outputs=StructuredOutputsParams(regex=REGEX))] * 3,
        prompts,
    )
    compiled = engine._grammar_compiler.submit(StructuredOutputsParams(regex=REGEX)).result()
    for i, prompt in enumerate(prompts):
        matcher, ids = xgr.GrammarMatcher(compiled), list(prompt)
        bitmask = xgr.allocate_token_bitmask(1, model.config.vocab_size)
        while not matcher.is_terminated():
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1:].float()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            assert matcher.accept_token(token)
            ids.append(token)
        assert outputs[i].output_token_ids == ids[len(prompt) :]


def test_seeded_rows_are_independent_of_their_batch_and_n(engine):
    so = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(max_new_tokens=300, temperature=1.0, seed=7, structured_outputs=so)
    prompt = _prompts(1)[0]
    alone = _run(engine, [params], [prompt])[0].output_token_ids
    others = [
        SamplingParams(
            max_new_tokens=40, temperature=1.0, seed=i, structured_outputs=StructuredOutputsParams(regex=REGEX)
        )
        for i in range(5)
    ]
    batch = _run(engine, [*others, params, params.replace(seed=8)], [*_prompts(5), prompt, prompt])
    assert batch[5].output_token_ids == alone
    assert batch[6].output_token_ids != alone  # a second sample of the same row (n = 2) differs


def test_stop_strings_cut_a_structured_output(engine):
    so = StructuredOutputsParams(json=SCHEMA)
    outputs = _run(engine, [SamplingParams(max_new_tokens=300, stop=('"age"',), structured_outputs=so)] * 2)
    for output in outputs.values():
        assert output.finish_reason == "stop" and output.stop_reason == '"age"'
        assert output.text.startswith('{"name": "') and output.text.endswith(", ")


@pytest.mark.parametrize("speculative", [True, False], ids=["ngram", "async"])
def test_speculation_and_async_batching_keep_outputs(model_dir, engine, speculative):
    """Greedy constrained rows are the same with n-gram speculation (a mask per proposed position, the matcher
    rolled back) and with async batching; every row still validates."""
    from dataclasses import replace

    so = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(max_new_tokens=300, temperature=t, seed=i, structured_outputs=so)
        for i, t in enumerate([0.0, 0.0, 0.0, 1.0, 1.0])
    ]
    params.append(SamplingParams(max_new_tokens=30))  # free text beside them
    want = _run(engine, params)
    config = replace(CONFIG, speculative="ngram", num_speculative_tokens=4) if speculative else CONFIG
    other = LLMEngine.from_pretrained(str(model_dir), config)
    other.overlap_steps = not speculative  # the CPU runs async batching's bookkeeping when set by hand
    got = _run(other, params)
    same = [0, 1, 2, 5] if speculative else range(6)  # sampled rows draw differently when verifying proposals
    assert all(got[i].output_token_ids == want[i].output_token_ids for i in same)
    for i in range(5):
        assert got[i].finish_reason == "stop"
        jsonschema.validate(json.loads(_text(other, got[i])), SCHEMA)
    if speculative:
        assert other.stats.num_proposed_tokens > other.stats.num_accepted_tokens > 0


def test_bad_constraints_fail_their_row_only(engine):
    bad = [
        StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}),
        StructuredOutputsParams(regex="(ab"),
        StructuredOutputsParams(grammar="root ::= missing_rule"),
        StructuredOutputsParams(regex="a{2,1}"),  # xgrammar reports it from the EBNF it translates the regex to
    ]
    params = [SamplingParams(max_new_tokens=20, structured_outputs=so) for so in bad]
    params.append(SamplingParams(max_new_tokens=20, structured_outputs=StructuredOutputsParams(choice=CHOICES)))
    outputs = _run(engine, params)
    assert "minimum greater than maximum" in outputs[0].error
    assert outputs[1].error.startswith("structured outputs: invalid regex constraint: Regex parsing error")
    assert "missing_rule" in outputs[2].error
    assert outputs[3].error == (
        "structured outputs: invalid regex constraint: Lower bound is larger than upper bound: 2 > 1"
    )  # no line and column of an EBNF text the user never wrote
    assert all(outputs[i].finish_reason == "error" for i in range(4))
    assert outputs[4].finish_reason == "stop" and _text(engine, outputs[4]) in CHOICES


def test_each_distinct_constraint_compiles_once(model_dir):
    engine = LLMEngine.from_pretrained(str(model_dir), CONFIG)
    schema_a = StructuredOutputsParams(json=SCHEMA)
    schema_b = StructuredOutputsParams(json=json.dumps(SCHEMA))  # the same schema, as text
    _run(engine, [SamplingParams(max_new_tokens=5, structured_outputs=so) for so in (schema_a, schema_b, schema_a)])
    assert engine._grammar_compiler.num_compiled == 1
    assert engine.stats.grammar_compile_seconds > 0 and engine.stats.num_grammar_mask_steps > 0


def test_a_request_whose_grammar_allows_no_token_is_blocked():
    class Stuck:  # a matcher state with no allowed token (a constraint the tokenizer cannot express)
        def fill_bitmask(self, bitmask, row):
            bitmask[row] = 0
            return False

        def rollback(self, n):
            assert n == 0

    step = StepBitmask(num_rows=3, vocab_size=70)
    _fill_entry(step, Stuck(), 1, (), request_index=42)
    assert step.blocked == {42} and step.rows == [1] and step.bitmask.shape == (3, 3)
    assert not step.bitmask[1].any() and (step.bitmask[[0, 2]] == -1).all()  # the other rows allow everything


def test_params_validation_and_key():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=("a",)).validate()
    with pytest.raises(ValueError, match="not valid JSON"):
        SamplingParams(structured_outputs={"json": "{nope"}).validate()
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=("a", "b")) and params.needs_processing
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).key != StructuredOutputsParams(json={"a": 2, "b": 1}).key


def test_compiled_constraints_are_cached_least_recently_used_first():
    from cbrun.engine.structured_output.compiler import GrammarCompiler

    compiler = GrammarCompiler(tokenizer=None, vocab_size=8, eos_token_ids=frozenset({7}), max_cached=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a", "b", "c"))
    future_a = compiler.submit(a)
    compiler.submit(b)
    assert compiler.submit(a) is future_a  # a is now the most recently used
    compiler.submit(c)  # b goes
    assert compiler.submit(a) is future_a and set(compiler._cache) == {("xgrammar", *a.key), ("xgrammar", *c.key)}
    with pytest.raises(Exception, match="invalid regex constraint"):  # no tokenizer: the compile fails, as a row
        future_a.result()
    compiler.shutdown()


def test_the_samplers_bitmask_kernel_equals_the_unpacked_mask():
    from cbrun.engine.sample import sampler

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 70, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 3), dtype=torch.int32, generator=g)
    want = scores.masked_fill(~sampler.allowed_tokens(bitmask, 70), float("-inf"))
    assert torch.equal(sampler.apply_token_bitmask(scores.clone(), bitmask), want)


def test_masked_argmax_takes_the_best_allowed_token_and_leaves_bad_rows_to_the_sampler():
    from cbrun.engine.structured_output.bitmask import masked_argmax

    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [9.0, 1.0, 0.0, 3.0], [float("nan"), 1.0, 2.0, 0.0]])
    bitmask = torch.tensor([[0b1101], [0b0000], [0b1111]], dtype=torch.int32)  # row 0: tokens 0, 2, 3
    assert masked_argmax(logits, [0, 2], bitmask) == [3, None]
    assert logits[0, 1] == 5.0  # a subset of the rows: the step's logits are not changed
    assert masked_argmax(logits, [0, 1, 2], bitmask) == [3, None, None]
    so = StructuredOutputsParams(choice=CHOICES)
    assert SamplingParams(structured_outputs=so).masked_greedy
    assert not SamplingParams(structured_outputs=so, temperature=1.0).masked_greedy
    assert not SamplingParams(structured_outputs=so, logprobs=1).masked_greedy
    assert not SamplingParams().masked_greedy


def test_special_tokens_never_match_a_grammar_that_their_text_spells(engine):
    """``<unk>`` (id 258) and ``<s>`` (256) spell ``"<" [a-z]+ ">"`` as written, but decode to nothing: no row may
    draw them, whatever its seed (the byte tokenizer must spell the letters one by one)."""
    so = StructuredOutputsParams(grammar='root ::= "<" [a-z]{1,4} ">"')
    outputs = _run(
        engine, [SamplingParams(max_new_tokens=20, temperature=1.0, seed=i, structured_outputs=so) for i in range(24)]
    )
    for output in outputs.values():
        assert output.finish_reason == "stop", output.error
        assert not {256, 258} & set(output.output_token_ids), output.output_token_ids
        assert re.fullmatch(r"<[a-z]{1,4}>", _text(engine, output)), output.output_token_ids


def test_batched_fill_blocks_only_the_request_whose_tokenizer_cannot_go_on():
    import xgrammar as xgr

    from cbrun.engine.structured_output.request_state import StructuredOutputRequest, fill_bitmasks

    info = xgr.TokenizerInfo(["a", "b", "</s>", "ab"], vocab_size=4, stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info)

    def state(regex: str) -> StructuredOutputRequest:
        future = Future()
        future.set_result(compiler.compile_regex(regex))
        request = StructuredOutputRequest(StructuredOutputsParams(regex=regex), future)
        assert request.ready()
        return request

    states = [state("ab+"), state("c"), state("a")]  # no token spells "c"
    bitmask = torch.full((5, 1), -1, dtype=torch.int32)
    assert fill_bitmasks(states, bitmask, [4, 0, 2]) == [True, False, True]
    words = [w & 0b1111 for w in bitmask[:, 0].tolist()]  # the bits of the 4 tokens (the rest are unused)
    assert words == [0, 0b1111, 0b0001, 0b1111, 0b1001]  # "a" / "a" or "ab" first; rows 1 and 3 untouched


@pytest.mark.parametrize("overlap", [False, True])
def test_the_bitmask_is_filled_before_the_launch_that_applies_it(model_dir, monkeypatch, overlap):
    """Each step's bitmask is built before the step's launch returns, which applies it (so constrained rows ride in
    the step's one read-back), and with async batching before the previous step is read: on a GPU the host fills
    the masks while the device computes that step."""
    from cbrun.engine.sample.step import StepHandle

    engine = LLMEngine.from_pretrained(str(model_dir), CONFIG)
    engine.overlap_steps = overlap
    events = []
    fill, launch, token_ids = engine._fill_grammar_bitmask, engine.model_runner.launch, StepHandle.token_ids

    def recording_fill(plan):
        step = fill(plan)
        events.append(("fill", plan, step is not None))  # the plan itself: an id could be reused
        return step

    def recording_launch(plan, *args):
        handle = launch(plan, *args)
        events.append(("launch", plan, handle))
        return handle

    def recording_read(handle):
        events.append(("read", handle, None))
        return token_ids(handle)

    engine._fill_grammar_bitmask = recording_fill
    engine.model_runner.launch = recording_launch
    monkeypatch.setattr(StepHandle, "token_ids", recording_read)
    params = [SamplingParams(max_new_tokens=30, structured_outputs=StructuredOutputsParams(regex=REGEX))] * 3
    outputs = _run(engine, params)
    assert all(re.fullmatch(REGEX, _text(engine, o)) for o in outputs.values())
    filled = [(i, plan) for i, (kind, plan, built) in enumerate(events) if kind == "fill" and built]
    assert len(filled) >= 5
    for i, plan in filled:
        launched, handle = next((j, h) for j, (kind, p, h) in enumerate(events) if kind == "launch" and p is plan)
        read = next(j for j, (kind, h, _) in enumerate(events) if kind == "read" and h is handle)
        assert i < launched < read  # filled before its launch, which draws its rows; read after
    if overlap:  # the fill of step N comes before the read of step N - 1
        reads = [i for i, (kind, *_) in enumerate(events) if kind == "read"]
        assert any(reads[0] > i for i, _ in filled)


def test_without_async_batching_the_masks_are_filled_beside_the_forward_pass(model_dir):
    """On the CPU (steps not overlapped) a step's masks are filled on the grammar thread while this thread runs the
    forward pass, and the launch waits for them before drawing; a fill that fails fails the step, not silently."""
    import threading

    engine = LLMEngine.from_pretrained(str(model_dir), CONFIG)
    assert not engine.overlap_steps
    threads, fill = [], engine._fill_grammar_bitmask

    def recording_fill(plan):
        threads.append(threading.current_thread().name)
        return fill(plan)

    engine._fill_grammar_bitmask = recording_fill
    params = [SamplingParams(max_new_tokens=30, structured_outputs=StructuredOutputsParams(regex=REGEX))] * 3
    outputs = _run(engine, params)
    assert all(re.fullmatch(REGEX, _text(engine, o)) for o in outputs.values())
    assert len(threads) >= 5 and all(name.startswith("cbrun-grammar-fill") for name in threads)

    def failing_fill(plan):
        raise RuntimeError("the fill failed")

    engine._fill_grammar_bitmask = failing_fill
    engine.add_request("x", _prompts(1)[0], params[0])
    with pytest.raises(RuntimeError, match="the fill failed"):
        while engine.has_unfinished_requests():
            engine.step()
