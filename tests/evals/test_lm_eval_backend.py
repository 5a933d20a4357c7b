"""cbrun as an lm-eval backend: the same numbers as lm-eval's own ``hf`` backend on the same model and tasks.

Tasks are the local YAMLs under ``tests/evals/tasks`` (Parquet files built from GSM8K, no hub): multiple choice
(acc, acc_norm), generate_until (exact match) and loglikelihood_rolling (perplexities over texts longer than the
model's context). Every per-request result is compared: log-likelihoods within 1e-4 (rolling sums of thousands of
tokens are float32 sums, as ``hf`` makes them: within 1e-4 or one part in 1e7), generations equal, metrics equal.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets is imported: the tasks read local files only
pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's hf backend imports it

import torch  # noqa: E402
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from cbrun.jobs.integrations.lm_eval_backend import CbrunLM  # noqa: E402
from cbrun.jobs.integrations.lm_eval_requests import loglikelihood_request, scoring_order  # noqa: E402
from tests.conftest import REPO_ROOT  # noqa: E402

TASKS_DIR = REPO_ROOT / "tests" / "evals" / "tasks"
MC, GEN, PPL = "cbrun_gsm8k_mc", "cbrun_gsm8k_gen", "cbrun_gsm8k_ppl"


@pytest.fixture(autouse=True)
def _offline_from_repo_root(monkeypatch):
    """The task YAMLs name their data relative to the repo root; datasets must not reach a hub."""
    import datasets

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)


def evaluate(model, model_args, tasks, limit, **kwargs) -> dict:
    task_manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        limit=limit,
        task_manager=task_manager,
        log_samples=True,
        **kwargs,
    )


def responses(results: dict, task: str) -> list:
    """Per document, in document order, the backend's response to each of its requests."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [[resp[0] for resp in s["resps"]] for s in samples]


def metrics(results: dict, task: str) -> dict:
    return {k: v for k, v in results["results"][task].items() if "," in k and "stderr" not in k}


def assert_same_results(cbrun: dict, hf: dict, task: str) -> None:
    ours, theirs = responses(cbrun, task), responses(hf, task)
    assert len(ours) == len(theirs) > 0
    for doc, (a, b) in enumerate(zip(ours, theirs)):
        assert len(a) == len(b), doc
        for x, y in zip(a, b):
            if isinstance(y, str):
                assert x == y, f"doc {doc}: generations differ"
            elif isinstance(y, (tuple, list)):  # (loglikelihood, is_greedy)
                assert x[0] == pytest.approx(y[0], abs=1e-4), f"doc {doc}"
                assert x[1] == y[1], f"doc {doc}: is_greedy differs"
            else:  # a rolling loglikelihood
                assert x == pytest.approx(y, abs=1e-4, rel=1e-7), f"doc {doc}"
    ours_m, theirs_m = metrics(cbrun, task), metrics(hf, task)
    assert ours_m.keys() == theirs_m.keys() and ours_m
    for name, value in theirs_m.items():
        assert ours_m[name] == pytest.approx(value, rel=1e-6), name


# ---- the request rule ----------------------------------------------------------------------------------------
def test_loglikelihood_request_is_hf_window():
    # hf runs (ctx + cont)[-(max_length + 1):][:-1] and scores the last len(cont) positions.
    request = loglikelihood_request([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12], max_length=5)
    assert request.prompt_token_ids == (7, 8, 9, 10, 11, 12)
    assert request.prompt_logprobs_from == 4 and request.num_continuation_tokens == 2
    short = loglikelihood_request([1, 2], [3], max_length=5)
    assert short.prompt_token_ids == (1, 2, 3) and short.prompt_logprobs_from == 2
    with pytest.raises(ValueError, match="more than max_length"):
        loglikelihood_request([1], [2] * 6, max_length=5)
    with pytest.raises(ValueError, match="at least one token"):
        loglikelihood_request([1], [], max_length=5)


def test_scoring_order_puts_one_request_per_context_first():
    a = [loglikelihood_request([1, 2, 3], [c], 16) for c in (7, 5, 6)]
    b = [loglikelihood_request([4, 4], [c], 16) for c in (9, 8)]
    order = scoring_order(a + b)
    assert order[:2] == [a[1], b[1]]  # the longest context first; within a context, by tokens
    assert sorted(order[2:], key=lambda r: r.prompt_token_ids) == [a[2], a[0], b[0]]


# ---- stories260K against hf --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stories_runs(stories260k_dir):
    """(cbrun model, {backend: results of the MC + perplexity tasks}, {backend: results of the generation task},
    cbrun's engine stats after the MC task alone)."""
    cbrun = CbrunLM(pretrained=str(stories260k_dir), num_threads=1)
    hf_args = f"pretrained={stories260k_dir},device=cpu,dtype=float32"
    scoring = {"cbrun": evaluate(cbrun, None, [MC], limit=24)}
    mc_stats = cbrun.engine.stats.as_dict()
    ppl = evaluate(cbrun, None, [PPL], limit=24)
    scoring["cbrun"]["samples"][PPL], scoring["cbrun"]["results"][PPL] = ppl["samples"][PPL], ppl["results"][PPL]
    scoring["hf"] = evaluate("hf", hf_args, [MC, PPL], limit=24)
    generation = {
        "cbrun": evaluate(cbrun, None, [GEN], limit=12, gen_kwargs="max_gen_toks=48"),
        "hf": evaluate("hf", hf_args, [GEN], limit=12, gen_kwargs="max_gen_toks=48"),
    }
    return cbrun, scoring, generation, mc_stats


def test_multiple_choice_matches_hf(stories_runs):
    _, scoring, _, stats = stories_runs
    assert_same_results(scoring["cbrun"], scoring["hf"], MC)
    assert {"acc,none", "acc_norm,none"} <= metrics(scoring["cbrun"], MC).keys()
    # The 4 choices of a question share its context: 3 of them find its full blocks in the prefix cache.
    assert stats["num_cached_prompt_tokens"] > 0 and stats["prefix_hit_rate"] > 0.5


def test_rolling_perplexity_matches_hf(stories_runs):
    _, scoring, _, _ = stories_runs
    assert_same_results(scoring["cbrun"], scoring["hf"], PPL)
    assert {"word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"} <= metrics(
        scoring["cbrun"], PPL
    ).keys()


def test_rolling_texts_exceed_the_context(stories_runs):
    cbrun, scoring, _, _ = stories_runs
    texts = [s["doc"]["text"] for s in scoring["cbrun"]["samples"][PPL]]
    assert min(len(cbrun.tok_encode(t)) for t in texts) > 2 * cbrun.max_length  # three windows or more each


def test_generate_until_matches_hf(stories_runs):
    _, _, generation, _ = stories_runs
    assert_same_results(generation["cbrun"], generation["hf"], GEN)
    assert all(len(r[0]) > 0 for r in responses(generation["cbrun"], GEN))


def test_sampled_generation_is_seeded_and_stops(stories260k_dir, stories_runs):
    from lm_eval.api.instance import Instance

    cbrun = stories_runs[0]
    gen_kwargs = {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "until": ["."], "max_gen_toks": 20}
    requests = [
        Instance("generate_until", {}, (prompt, dict(gen_kwargs)), 0)
        for prompt in ("Once upon a time", "Tom had a dog", "The sun")
    ]
    first = cbrun.generate_until(requests, disable_tqdm=True)
    again = CbrunLM(pretrained=str(stories260k_dir), num_threads=1).generate_until(requests, disable_tqdm=True)
    assert first == again  # each request's seed derives from the backend's seed and its index, not the history
    assert all("." not in text and len(cbrun.tok_encode(text, add_special_tokens=False)) <= 21 for text in first)
    other_seed = CbrunLM(pretrained=str(stories260k_dir), num_threads=1, seed=7).generate_until(
        requests, disable_tqdm=True
    )
    assert other_seed != first
    with pytest.raises(ValueError, match="not supported by cbrun"):
        cbrun.generate_until([Instance("generate_until", {}, ("Hi", {"typical_p": 0.5}), 0)], disable_tqdm=True)


def test_request_cache_serves_a_rerun(stories260k_dir, tmp_path):
    cbrun = CbrunLM(pretrained=str(stories260k_dir), num_threads=1)
    first = evaluate(cbrun, None, [MC], limit=3, use_cache=str(tmp_path / "cache"))
    num_requests = cbrun.engine.stats.num_requests
    second = evaluate(cbrun, None, [MC], limit=3, use_cache=str(tmp_path / "cache"))
    assert num_requests == 12 and cbrun.engine.stats.num_requests == num_requests  # nothing recomputed
    assert responses(second, MC) == responses(first, MC)


def test_continuation_on_page_and_chunk_boundaries(stories260k_dir):
    """Windows that end on a page (4 tokens) or whose continuation starts on a chunk (8 tokens) boundary score as
    those that do not, and as hf."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    small = CbrunLM(
        pretrained=str(stories260k_dir), num_threads=1, page_size=4, max_batch_tokens=8, max_requests_per_batch=1
    )
    words = "She liked to play in the park with her red ball every day".split(" ")
    requests = [
        Instance("loglikelihood", {}, (context, " " + " ".join(words[:n])), 0)
        for context in ("Once upon a time, there was a little girl named Lily.", "One day, Tom")
        for n in range(1, len(words))
    ]
    pairs = [small._encode_pair(*r.args) for r in requests]
    windows = [loglikelihood_request(ctx, cont, small.max_length) for ctx, cont in pairs]
    assert {len(w.prompt_token_ids) % 4 == 0 for w in windows} == {True, False}
    assert {w.prompt_logprobs_from % 8 == 0 for w in windows} == {True, False}
    ours = small.loglikelihood(requests, disable_tqdm=True)
    hf = HFLM(pretrained=str(stories260k_dir), device="cpu", dtype="float32").loglikelihood(requests, disable_tqdm=True)
    for (a, greedy_a), (b, greedy_b) in zip(ours, hf):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b


def test_tokenization_matches_hf(stories260k_dir, stories_runs):
    from lm_eval.models.huggingface import HFLM

    cbrun = stories_runs[0]
    hf = HFLM(pretrained=str(stories260k_dir), device="cpu", dtype="float32")
    for text in ("Once upon a time", "<s>Once upon a time", ""):
        assert cbrun.tok_encode(text) == hf.tok_encode(text)
    for context, continuation in (("Question: why?\nAnswer: ", "because"), ("Lily ", " ran"), ("A", "B")):
        assert cbrun._encode_pair(context, continuation) == hf._encode_pair(context, continuation)
    assert (cbrun.prefix_token_id, cbrun.eot_token_id, cbrun.max_length) == (
        hf.prefix_token_id,
        hf.eot_token_id,
        hf.max_length,
    )


def test_loglikelihood_encodes_every_string_in_one_batch(stories_runs, monkeypatch):
    """``loglikelihood`` encodes its strings up front (one tokenizer call); lm-eval's own encoding loop then finds
    every one of them, and the requests are those of the string-by-string encoding."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import TemplateLM

    cbrun = stories_runs[0]
    pairs = [
        ("Question: why?\nAnswer: ", "because"),
        ("Lily  ", " ran"),
        ("", "Once upon"),
        ("<s>A", "B"),
        ("Question: why?\nAnswer: ", "so"),
    ]
    requests = [Instance("loglikelihood", {}, pair, 0) for pair in pairs]
    seen = []
    monkeypatch.setattr(
        type(cbrun),
        "_loglikelihood_tokens",
        lambda self, reqs, disable_tqdm=False: (
            seen.append([(ctx, cont) for _, ctx, cont in reqs]) or [(0.0, True)] * len(reqs)
        ),
    )
    TemplateLM.loglikelihood(cbrun, requests, disable_tqdm=True)  # string by string
    encode = type(cbrun.tokenizer).encode
    calls = []
    monkeypatch.setattr(type(cbrun.tokenizer), "encode", lambda self, *a, **k: calls.append(a) or encode(self, *a, **k))
    cbrun.loglikelihood(requests, disable_tqdm=True)
    assert calls == [] and seen[1] == seen[0] and len(seen[0]) == len(pairs)
    assert cbrun._encodings == {}  # nothing kept past the call


def test_model_args(stories260k_dir):
    lm = CbrunLM.create_from_arg_string(
        f"pretrained={stories260k_dir},page_size=8,max_length=256,num_threads=1",
        {"batch_size": 16, "max_batch_size": 64, "device": "cuda:0"},
    )
    assert lm.engine.config.page_size == 8 and lm.max_length == 256 and lm.engine.config.num_threads == 1
    assert lm.engine.config.device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown cbrun model argument"):
        CbrunLM(pretrained=str(stories260k_dir), pagesize=8)
    with pytest.raises(ValueError, match="page_size"):
        CbrunLM(pretrained=str(stories260k_dir), page_size=0)


def test_default_model_args_load_and_score_as_one_thread(stories260k_dir, stories_runs):
    """No model args but ``pretrained``: ``num_threads = "auto"`` is resolved (it once reached
    ``torch.set_num_threads`` as a string), the checkpoint loads as ``cbrun run`` loads it (the safetensors loader:
    transformers' model classes not needed), and the scores equal those of ``num_threads=1``."""
    cbrun_one_thread = stories_runs[0]
    threads = torch.get_num_threads()
    try:
        lm = CbrunLM(pretrained=str(stories260k_dir))
        assert lm.engine.config.num_threads == "auto"
        assert torch.get_num_threads() == 1  # a tiny model keeps one thread (engine.threads.resolve_num_threads)
        assert type(lm.engine.model).__name__ == "LeanModel"
        requests = [
            Instance("loglikelihood", {}, ("Once upon a time", " there was a girl"), 0),
            Instance("loglikelihood", {}, ("Tom had a dog.", " The dog was big"), 1),
        ]
        assert lm.loglikelihood(requests, disable_tqdm=True) == cbrun_one_thread.loglikelihood(
            requests, disable_tqdm=True
        )
    finally:
        torch.set_num_threads(threads)


# ---- a grouped-query-attention model with a sliding window -------------------------------------------------------
@pytest.fixture(scope="module")
def sliding_window_dir(tmp_path_factory):
    """A random Mistral (4 query heads, 2 KV heads, sliding window 24, 96 positions) with the byte tokenizer."""
    from transformers import GenerationConfig, MistralConfig, MistralForCausalLM

    from cbrun.jobs.cli.demo import build_byte_tokenizer
    from tests.model_utils import TINY_DECODER

    tokenizer = build_byte_tokenizer()
    config = MistralConfig(
        **dict(
            TINY_DECODER,
            vocab_size=len(tokenizer),
            max_position_embeddings=96,
            sliding_window=24,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=False,
        )
    )
    out = tmp_path_factory.mktemp("mistral_sliding")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MistralForCausalLM(config)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(3.0)  # well-separated logits: a greedy tie is not a coin flip
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_sliding_window_gqa_model_matches_hf(sliding_window_dir):
    """Contexts longer than the 96-token model are left-truncated, texts run in many rolling windows, and every
    position attends to its last 24 positions only, in both backends."""
    cbrun = CbrunLM(pretrained=str(sliding_window_dir), num_threads=1)
    hf_args = f"pretrained={sliding_window_dir},device=cpu,dtype=float32"
    for tasks, limit, gen_kwargs in (([MC, PPL], 6, None), ([GEN], 4, "max_gen_toks=16")):
        ours = evaluate(cbrun, None, tasks, limit=limit, gen_kwargs=gen_kwargs)
        theirs = evaluate("hf", hf_args, tasks, limit=limit, gen_kwargs=gen_kwargs)
        for task in tasks:
            assert_same_results(ours, theirs, task)


@pytest.mark.slow
def test_cbrun_lm_eval_command(stories260k_dir, monkeypatch, capsys, tmp_path):
    """``cbrun lm-eval`` is lm-eval's own CLI with ``--model cbrun`` registered (lm-eval 0.4.13 loads no plugins),
    with lm-eval's index of its built-in tasks cached (``cbrun.jobs.integrations.lm_eval_task_index``)."""
    import sys

    from cbrun.jobs.cli import main
    from cbrun.jobs.integrations.lm_eval_task_index import CACHE_DIR_ENV

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main hands lm-eval its arguments through sys.argv
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    assert (
        main(
            [
                "lm-eval",
                "run",
                "--model",
                "cbrun",
                "--model_args",
                f"pretrained={stories260k_dir},num_threads=1",
                "--device",
                "cpu",
                "--include_path",
                str(TASKS_DIR),
                "--tasks",
                MC,
                "--limit",
                "2",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "cbrun (" in table and "|cbrun_gsm8k_mc|" in table.replace(" ", "") and "acc_norm" in table
    assert [p.name.startswith("task-index-") for p in (tmp_path / "lm_eval").iterdir()] == [True]


@pytest.mark.parametrize("model", ["stories260k", "mistral_sliding"])
def test_tokenizer_is_the_one_auto_tokenizer_loads(model, stories260k_dir, sliding_window_dir):
    """The backend's tokenizer (``TokenizersBackend`` built directly where ``generic_tokenizer_class`` allows it)
    is AutoTokenizer's: the same class, and the same ids with and without special tokens, and with
    ``add_bos_token`` forced either way."""
    from transformers import AutoTokenizer

    from cbrun.jobs.integrations.lm_eval_loading import load_tokenizer

    path = str(stories260k_dir if model == "stories260k" else sliding_window_dir)
    texts = ["Once upon a time, there was a girl.", " a leading space", "", "Tom ran.\n\nThe end"]
    for add_bos_token in (None, True, False):
        kwargs = {} if add_bos_token is None else {"add_bos_token": add_bos_token}
        ours, auto = load_tokenizer(path, add_bos_token), AutoTokenizer.from_pretrained(path, **kwargs)
        assert type(ours) is type(auto)
        for special in (True, False):
            assert (
                ours(texts, add_special_tokens=special)["input_ids"]
                == auto(texts, add_special_tokens=special)["input_ids"]
            )
        assert (ours.bos_token_id, ours.eos_token_id, ours.name_or_path) == (
            auto.bos_token_id,
            auto.eos_token_id,
            auto.name_or_path,
        )
