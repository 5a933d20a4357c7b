"""The transformers-free tokenizer (``cbrun.engine.core.tokenizer``) equals transformers' ``AutoTokenizer``: encode with and
without special tokens, decode with and without skipping them, special tokens, pieces and vocabulary, over many
strings, for every tokenizer the repository builds (stories260K's, the demo model's, the scoring tests' merging
BPE, the chat model's) and for tokenizer_config.json variants; and configs it does not reproduce load
transformers' tokenizer instead."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cbrun.engine.core.tokenizer import FastTokenizer, fast_tokenizer_reason, load_tokenizer

TEXTS = [
    "",
    " ",
    "  ",
    "\n",
    "\t",
    "a",
    "Hello, world!",
    "Once upon a time, there was a little girl named Lily.",
    " leading space",
    "trailing space ",
    "two  spaces   three",
    "line one\nline two\n\n",
    "tab\tseparated\tvalues",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "0",
    "12",
    "123456789",
    "3.14159",
    "-42",
    "1,000,000",
    "2024-12-01",
    "x=30",
    "dogs 30 dog 3 0",
    "héllo wörld",
    "naïve café",
    "日本語のテキスト",
    "中文",
    "한국어",
    "Ελληνικά",
    "русский текст",
    "עברית",
    "العربية",
    "emoji 🙂🎉👍🏽",
    "🙂",
    "e\u0301 combining",
    "\u200bzero width",
    "\x00nul",
    "\x7fdel",
    "ÿþ",
    "\ufffd",
    "<s>",
    "</s>",
    "<unk>",
    "<s> Once",
    "Once</s>",
    "a<s>b</s>c",
    " <s>",
    "<s><s>",
    "<|user|>\nhi\n<|assistant|>\n",
    "<0x41>",
    "<<s>>",
    "s>",
    "<s",
    "The dog" + "s ran",
    "ALL CAPS",
    "MiXeD cAsE",
    "punctuation?!.,;:'\"()[]{}",
    "don't won't it's",
    " . , ! ?",
    "a" * 300,
    "word " * 60,
]


def _save(tokenizer, path: Path, model_type: str = "llama") -> Path:
    """A transformers tokenizer saved to ``path`` with a config.json naming ``model_type``."""
    tokenizer.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def _edit_config(path: Path, **changes) -> Path:
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_path.write_text(json.dumps(config))
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    return dst


def _merging_tokenizer_dir(path: Path) -> Path:
    from tests.jobs.test_score_boundary import merging_tokenizer

    return _save(merging_tokenizer(), path)


def _no_post_processor_dir(path: Path) -> Path:
    """The demo tokenizer with its tokenizer.json's post-processor removed (transformers adds a ``$A`` template)."""
    data = json.loads((path / "tokenizer.json").read_text())
    data["post_processor"] = None
    (path / "tokenizer.json").write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def tokenizer_dirs(stories260k_dir, tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Every tokenizer directory the equality tests run on, by name."""
    from tests.jobs.conftest import CHAT_TEMPLATE

    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {"stories260K": stories260k_dir, "demo": tiny_model_dir, "merging-bpe": _merging_tokenizer_dir(root / "m")}
    dirs["stories260K-no-split"] = _edit_config(_copy(stories260k_dir, root / "s1"), split_special_tokens=False)
    dirs["demo-split"] = _edit_config(_copy(tiny_model_dir, root / "d1"), split_special_tokens=True)
    # add_bos_token / add_eos_token are dropped with a tokenizer.json: its post-processor (BOS) stands
    dirs["demo-add-bos-false"] = _edit_config(
        _copy(tiny_model_dir, root / "d2"), add_bos_token=False, add_eos_token=True
    )
    dirs["demo-cleanup-legacy"] = _edit_config(
        _copy(tiny_model_dir, root / "d3"),
        clean_up_tokenization_spaces=True,
        legacy=False,
        add_prefix_space=True,
        padding_side="left",
        tokenizer_class="PreTrainedTokenizerFast",
    )
    demo = AutoTokenizer.from_pretrained(tiny_model_dir)
    decoder = {
        str(i): {
            "content": t.content,
            "single_word": t.single_word,
            "lstrip": t.lstrip,
            "rstrip": t.rstrip,
            "normalized": t.normalized,
            "special": t.special,
        }
        for i, t in demo.added_tokens_decoder.items()
    }
    dirs["demo-added-tokens-extra"] = _edit_config(
        _copy(tiny_model_dir, root / "d4"),
        added_tokens_decoder=decoder,
        pad_token="</s>",
        extra_special_tokens=["<unk>"],
        bos_token={"__type": "AddedToken", "content": "<s>"},
    )
    dirs["demo-no-post-processor"] = _no_post_processor_dir(_copy(tiny_model_dir, root / "d5"))
    dirs["demo-chat-template"] = _edit_config(_copy(tiny_model_dir, root / "d6"), chat_template=CHAT_TEMPLATE)
    return dirs


NAMES = [
    "stories260K",
    "demo",
    "merging-bpe",
    "stories260K-no-split",
    "demo-split",
    "demo-add-bos-false",
    "demo-cleanup-legacy",
    "demo-added-tokens-extra",
    "demo-no-post-processor",
    "demo-chat-template",
]


@pytest.mark.parametrize("name", NAMES)
def test_fast_tokenizer_equals_auto_tokenizer(name, tokenizer_dirs):
    path = tokenizer_dirs[name]
    assert fast_tokenizer_reason(path) is None
    fast, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert isinstance(fast, FastTokenizer)
    assert type(auto).__name__ == "TokenizersBackend"  # the class FastTokenizer stands for
    for text in TEXTS:
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == auto.encode(text, add_special_tokens=special), (
                text,
                special,
            )
        assert fast.encode(text) == auto.encode(text)
        ids = auto.encode(text)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip), (
                text,
                skip,
            )
    for name_ in (
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "bos_token_id",
        "eos_token_id",
        "unk_token_id",
        "pad_token_id",
    ):
        assert getattr(fast, name_) == getattr(auto, name_), name_
    assert fast.get_vocab() == auto.get_vocab()
    assert len(fast) == len(auto) and fast.vocab_size == auto.vocab_size
    assert fast.all_special_ids == auto.all_special_ids
    assert fast.name_or_path == auto.name_or_path == str(path)
    assert fast(TEXTS[7])["input_ids"] == auto(TEXTS[7])["input_ids"]
    batch = auto(TEXTS[:9], add_special_tokens=False)["input_ids"]
    assert fast(TEXTS[:9], add_special_tokens=False)["input_ids"] == batch
    vocab_ids = list(range(len(auto)))
    assert [fast.convert_ids_to_tokens(i) for i in vocab_ids] == [auto.convert_ids_to_tokens(i) for i in vocab_ids]
    assert fast.convert_ids_to_tokens(vocab_ids, skip_special_tokens=True) == auto.convert_ids_to_tokens(
        vocab_ids, skip_special_tokens=True
    )


@pytest.mark.parametrize("name", ["stories260K", "demo", "merging-bpe", "stories260K-no-split", "demo-split"])
def test_fast_tokenizer_decodes_any_ids_as_auto_tokenizer(name, tokenizer_dirs):
    """Every id alone and random id runs (special ids, split characters, byte pieces) decode the same."""
    import random

    path = tokenizer_dirs[name]
    fast, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    rng = random.Random(0)
    sequences = [[i] for i in range(len(auto))] + [
        [rng.randrange(len(auto)) for _ in range(rng.randrange(1, 40))] for _ in range(300)
    ]
    for ids in sequences:
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip), ids


def test_stories260k_byte_fallback_and_special_text_are_exercised(tokenizer_dirs):
    """The strings above reach the cases they are meant for: byte-fallback pieces, and BOS text kept as text."""
    fast = load_tokenizer(tokenizer_dirs["stories260K"])
    pieces = fast.convert_ids_to_tokens(fast.encode("日本語 🙂", add_special_tokens=False))
    assert any(p.startswith("<0x") for p in pieces)
    assert fast.encode("<s>").count(fast.bos_token_id) == 1  # split_special_tokens: the text is not BOS
    assert load_tokenizer(tokenizer_dirs["stories260K-no-split"]).encode("<s>").count(fast.bos_token_id) == 2


@pytest.mark.parametrize(
    "change,reason",
    [
        (dict(tokenizer_class="LlamaTokenizer"), "tokenizer_class 'LlamaTokenizer'"),
        (dict(fix_mistral_regex=True), "sets fix_mistral_regex"),
        (dict(sep_token="<sep>"), "special token '<sep>' is not a special added token"),
        (
            dict(
                added_tokens_decoder={
                    "256": {
                        "content": "<s>",
                        "single_word": False,
                        "lstrip": True,
                        "rstrip": False,
                        "normalized": False,
                        "special": True,
                    }
                }
            ),
            "added_tokens_decoder entry 256",
        ),
        (dict(auto_map={"AutoTokenizer": ["x", "y"]}), "sets auto_map"),
        (dict(extra_special_tokens={"image_token": "<s>"}), "extra_special_tokens is a dict"),
        (dict(image_token="<s>"), "sets image_token"),
        (dict(padding_side="middle"), "padding_side = 'middle'"),
        (dict(bos_token={"content": "<s>"}), "special token {'content': '<s>'} is not a special added token"),
        (dict(added_tokens_decoder=["<s>"]), "holds a value not read here"),
    ],
    ids=[
        "llama-class",
        "unknown-key",
        "missing-special",
        "added-token-flags",
        "auto-map",
        "named-extras",
        "model-specific-token",
        "bad-padding-side",
        "untyped-token-dict",
        "decoder-list",
    ],
)
def test_configs_it_does_not_reproduce_load_transformers_tokenizer(change, reason, tiny_model_dir, tmp_path):
    path = _edit_config(_copy(tiny_model_dir, tmp_path / "t"), **change)
    assert reason in fast_tokenizer_reason(path)
    try:
        tokenizer = load_tokenizer(path)
    except (ValueError, OSError, TypeError, AttributeError):
        return  # transformers refuses it: the error is transformers' own, as before
    assert not isinstance(tokenizer, FastTokenizer)


def test_other_files_and_model_types_fall_back(tiny_model_dir, tmp_path):
    legacy = _copy(tiny_model_dir, tmp_path / "legacy")
    (legacy / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert "special_tokens_map.json" in fast_tokenizer_reason(legacy)
    qwen = _copy(tiny_model_dir, tmp_path / "qwen")
    (qwen / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert "model_type 'qwen2'" in fast_tokenizer_reason(qwen)
    assert type(load_tokenizer(qwen)).__name__ == "Qwen2Tokenizer"  # transformers' own choice for Qwen2
    assert not isinstance(load_tokenizer(tiny_model_dir, loader="transformers"), FastTokenizer)
    assert fast_tokenizer_reason(tmp_path) == "no tokenizer.json"


def test_calls_it_does_not_make_go_to_transformers_tokenizer(tokenizer_dirs):
    """A chat template is rendered by transformers' own tokenizer, loaded only when first asked for."""
    path = tokenizer_dirs["demo-chat-template"]
    fast, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert fast._transformers is None
    messages = [{"role": "user", "content": "Hi <s> there"}]
    assert fast.chat_template == auto.chat_template is not None
    assert fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True) == auto.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    assert type(fast.transformers_tokenizer()).__name__ == "TokenizersBackend"
    assert load_tokenizer(tokenizer_dirs["demo"]).chat_template is None
    with pytest.raises(AttributeError):
        fast._missing  # private names are never looked up on transformers' tokenizer
