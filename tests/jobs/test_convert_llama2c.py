"""Tests of the llama2.c converter against the real stories260K model and llama2.c's own goldens."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from cbrun.jobs.model.convert_llama2c import _merges, _rope_pairs_to_halves, convert_llama2c, read_tokenizer
from tests.conftest import require_stories260k

EXTRA_STRINGS = [
    "", " ", "   ", "a", "Once", "café 😀", " leading space", "trailing space ", "multiple   spaces  here",
    "line one\nline two\n\nthree", "\n", "tab\tand\r\nCRLF", "“curly quotes” — dash… naïve",
    "日本語のテキスト",
    "<s> and </s> and <unk> are plain text", "<0x41> is not a byte token", "aaaaaaaaaaaa", "....!!!???",
    "She said, \"Hello!\" and they played.", "\u2581 SentencePiece space mark", "zero\x00byte",
]  # fmt: skip


# --- llama2.c's encode, in plain Python: the oracle ---------------------------------------------------------------


def load_llama2c_vocab(path: Path) -> tuple[list[bytes], list[float]]:
    """Pieces exactly as stored (BOS is b"\\n<s>\\n") and their scores."""
    data, offset, pieces, scores = path.read_bytes(), 4, [], []
    while offset < len(data):
        score, length = struct.unpack_from("<fi", data, offset)
        pieces.append(data[offset + 8 : offset + 8 + length])
        scores.append(score)
        offset += 8 + length
    return pieces, scores


def _code_points(raw: bytes) -> list[bytes]:
    """Splits UTF-8 bytes as run.c does: a chunk ends before a non-continuation byte or at 4 bytes."""
    chunks, start = [], 0
    while start < len(raw):
        end = start + 1
        while end < len(raw) and raw[end] & 0xC0 == 0x80 and end - start < 4:
            end += 1
        chunks.append(raw[start:end])
        start = end
    return chunks


def llama2c_encode(text: str, pieces: list[bytes], scores: list[float]) -> list[int]:
    """run.c's ``encode(text, bos=1, eos=0)``: BOS, dummy prefix, code points or bytes + 3, best-score merges."""
    lookup = {piece: i for i, piece in enumerate(pieces)}
    raw = text.encode("utf-8")
    tokens = [1] + ([lookup[b" "]] if raw else [])
    for chunk in _code_points(raw):
        tokens.extend([lookup[chunk]] if chunk in lookup else [b + 3 for b in chunk])
    while True:
        best = None  # (position, merged id); strict ">" keeps the leftmost of equal scores, as run.c does
        for k in range(len(tokens) - 1):
            merged = lookup.get(pieces[tokens[k]] + pieces[tokens[k + 1]])
            if merged is not None and (best is None or scores[merged] > scores[best[1]]):
                best = (k, merged)
        if best is None:
            return tokens
        tokens[best[0] : best[0] + 2] = [best[1]]


def _random_strings(pieces: list[bytes], count: int, seed: int = 0) -> list[str]:
    """Random texts over the vocabulary's characters plus whitespace and characters outside it."""
    rng = random.Random(seed)
    chars = sorted({c for p in pieces[259:] for c in p.decode("utf-8")} | set(" \n\t\u00e9\U0001f600\u65e5\u2014"))
    return ["".join(rng.choices(chars, k=rng.randint(0, 40))) for _ in range(count)]


@pytest.fixture(scope="module")
def llama2c_vocab() -> tuple[list[bytes], list[float]]:
    return load_llama2c_vocab(require_stories260k() / "tok512.bin")


@pytest.fixture(scope="module")
def tokenizer(stories260k_dir: Path):
    return AutoTokenizer.from_pretrained(stories260k_dir)


# --- tokenizer ---------------------------------------------------------------------------------------------------


def test_oracle_matches_reference_prompts(reference_greedy, llama2c_vocab):
    for line in reference_greedy:
        assert llama2c_encode(line["prompt"], *llama2c_vocab) == line["prompt_token_ids"], line["prompt"]


def test_reference_prompts_encode_exactly(tokenizer, reference_greedy):
    assert len(reference_greedy) == 12
    for line in reference_greedy:
        assert tokenizer(line["prompt"])["input_ids"] == line["prompt_token_ids"], line["prompt"]
        assert tokenizer.encode(line["prompt"]) == line["prompt_token_ids"], line["prompt"]


@pytest.mark.parametrize("text", EXTRA_STRINGS)
def test_extra_strings_encode_like_llama2c(tokenizer, llama2c_vocab, text):
    assert tokenizer.encode(text) == llama2c_encode(text, *llama2c_vocab)


def test_random_strings_encode_like_llama2c(tokenizer, llama2c_vocab):
    for text in _random_strings(llama2c_vocab[0], count=300):
        assert tokenizer.encode(text) == llama2c_encode(text, *llama2c_vocab), repr(text)


def test_empty_string_is_bos_only(tokenizer):
    assert tokenizer("")["input_ids"] == [1]
    assert tokenizer.encode("", add_special_tokens=False) == []


def test_special_tokens(tokenizer):
    assert (tokenizer.unk_token, tokenizer.unk_token_id) == ("<unk>", 0)
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<s>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("</s>", 2)
    assert tokenizer.encode("hi", add_special_tokens=False) == tokenizer.encode("hi")[1:]


@pytest.mark.parametrize("text", [s for s in EXTRA_STRINGS if s])
def test_decode_round_trips(tokenizer, text):
    # Byte-fallback pieces fuse back into UTF-8, and only the dummy-prefix space is stripped.
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text


def test_decode_matches_llama2c_stdout(tokenizer, reference_greedy):
    for line in reference_greedy:
        ids = line["prompt_token_ids"] + line["output_token_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=True) == line["stdout_text"], line["prompt"]


def test_merges_have_no_overlapping_pairs_of_one_piece():
    """The converter's BPE merges equal llama2.c's loop unless a piece splits as x+y == y+z (see ``_merges``)."""
    pieces, scores = read_tokenizer(require_stories260k() / "tok512.bin", 512)
    assert len(set(scores[259:])) == len(scores) - 259, "merge scores must be distinct"
    pairs = set(_merges(pieces, scores))
    for x, y in pairs:
        z = (x + y)[len(y) :]
        assert not ((x + y).startswith(y) and (y, z) in pairs and (y, z) != (x, y)), (x, y, z)


# --- model -------------------------------------------------------------------------------------------------------


def test_written_files_and_configs(stories260k_dir):
    names = {p.name for p in stories260k_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert "tokenizer_config.json" in names
    config = json.loads((stories260k_dir / "config.json").read_text())
    expected = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=5, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, eos_token_id=1, bos_token_id=1, dtype="float32")  # fmt: skip
    assert {k: config[k] for k in expected} == expected
    generation = json.loads((stories260k_dir / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["bos_token_id"]) == (1, 1)


def test_greedy_generate_matches_llama2c(stories260k_dir, reference_greedy):
    model = AutoModelForCausalLM.from_pretrained(stories260k_dir, dtype=torch.float32).eval()
    mismatched = []
    for line in reference_greedy:
        prompt = line["prompt_token_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=line["max_positions"] - len(prompt) + 1,
                                 eos_token_id=1, pad_token_id=0)  # fmt: skip
        if out[0, len(prompt) :].tolist() != line["output_token_ids"]:
            mismatched.append(line["prompt"])
    assert not mismatched


def test_rope_rows_move_from_pairs_to_halves():
    w = np.arange(2 * 4 * 3, dtype=np.float32).reshape(8, 3)  # 2 heads, head_dim 4, dim 3
    out = _rope_pairs_to_halves(w, n_heads=2)
    assert [int(row[0]) // 3 for row in out] == [0, 2, 1, 3, 4, 6, 5, 7]


def _tiny_untied_checkpoint(path: Path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Writes a random llama2.c checkpoint with a separate classifier (negative vocab_size); returns its tensors."""
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = 16, 24, 1, 2, 1, 512, 8
    shapes = {"emb": (vocab, dim), "rms_att": (layers, dim), "wq": (layers, dim, dim), "wk": (layers, 8, dim),
              "wv": (layers, 8, dim), "wo": (layers, dim, dim), "rms_ffn": (layers, dim),
              "w1": (layers, hidden, dim), "w2": (layers, dim, hidden), "w3": (layers, hidden, dim),
              "rms_final": (dim,), "rope": (2, seq_len, 4), "wcls": (vocab, dim)}  # fmt: skip
    tensors = {name: rng.standard_normal(shape).astype("<f4") for name, shape in shapes.items()}
    header = struct.pack("<7i", dim, hidden, layers, heads, kv_heads, -vocab, seq_len)
    path.write_bytes(header + b"".join(t.tobytes() for t in tensors.values()))
    return tensors


def test_untied_classifier_and_rope_permutation(tmp_path):
    tensors = _tiny_untied_checkpoint(tmp_path / "tiny.bin", np.random.default_rng(0))
    out = convert_llama2c(tmp_path / "tiny.bin", require_stories260k() / "tok512.bin", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    weights = load_file(out / "model.safetensors")
    np.testing.assert_array_equal(weights["lm_head.weight"], tensors["wcls"])
    np.testing.assert_array_equal(weights["model.embed_tokens.weight"], tensors["emb"])
    q_proj = weights["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(q_proj, _rope_pairs_to_halves(tensors["wq"][0], n_heads=2))
    np.testing.assert_array_equal(weights["model.layers.0.self_attn.k_proj.weight"][4], tensors["wk"][0][1])


# --- bad input ---------------------------------------------------------------------------------------------------


def test_missing_files_raise(tmp_path):
    src = require_stories260k()
    with pytest.raises(FileNotFoundError, match="llama2.c checkpoint not found"):
        convert_llama2c(tmp_path / "nope.bin", src / "tok512.bin", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="llama2.c tokenizer not found"):
        convert_llama2c(src / "stories260K.bin", tmp_path / "nope.bin", tmp_path / "out")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda data: data[:1000], "header implies"),
        (lambda data: data[:20], "shorter than its 28-byte header"),
        (lambda data: struct.pack("<i", 0x616B3432) + data[4:], "versioned llama2.c export"),
        (lambda data: struct.pack("<i", 63) + data[4:], "impossible model"),
    ],
)
def test_bad_checkpoint_raises(tmp_path, edit, message):
    src = require_stories260k()
    (tmp_path / "bad.bin").write_bytes(edit((src / "stories260K.bin").read_bytes()))
    with pytest.raises(ValueError, match=message):
        convert_llama2c(tmp_path / "bad.bin", src / "tok512.bin", tmp_path / "out")


@pytest.mark.parametrize(
    ("edit", "message"),
    [(lambda data: data[:3000], "not a llama2.c tokenizer of 512 pieces"), (lambda data: data + b"xx", "bytes left")],
)
def test_bad_tokenizer_raises(tmp_path, edit, message):
    src = require_stories260k()
    (tmp_path / "bad.bin").write_bytes(edit((src / "tok512.bin").read_bytes()))
    with pytest.raises(ValueError, match=message):
        convert_llama2c(src / "stories260K.bin", tmp_path / "bad.bin", tmp_path / "out")
