"""Convert a llama2.c checkpoint and tokenizer into a transformers model directory.

llama2.c's legacy (version 0) export is a 28-byte header of seven int32 followed by float32 tensors; its tokenizer
file holds every piece with a merge score. The output directory loads with ``AutoModelForCausalLM`` and
``AutoTokenizer``, offline, and encodes and greedily decodes exactly as llama2.c's ``run`` does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

HEADER = struct.Struct("<7i")
VERSIONED_MAGIC = 0x616B3432  # "ak42": llama2.c's newer versioned export, which this converter does not read
SPECIAL_PIECES = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2; the file stores BOS/EOS as "\n<s>\n", "\n</s>\n"
NUM_BYTE_PIECES = 256  # ids 3..258 are <0x00>..<0xFF>
FIRST_PIECE_ID = len(SPECIAL_PIECES) + NUM_BYTE_PIECES
BOS_ID = 1  # llama2.c prepends it, and stops generating when the model emits it


@dataclass(frozen=True)
class Llama2cHeader:
    """The model shape read from a llama2.c checkpoint header.

    Attributes:
        dim: hidden size.
        hidden_dim: SwiGLU intermediate size.
        n_layers: transformer blocks.
        n_heads: query heads.
        n_kv_heads: key/value heads (grouped-query attention when fewer than ``n_heads``).
        vocab_size: vocabulary size (the absolute value of the header field).
        seq_len: longest sequence the model was trained on.
        shared_classifier: the header's vocab_size was positive, so the output layer reuses the embedding.
    """

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def read_header(data: bytes) -> Llama2cHeader:
    """Parses and validates the 28-byte header.

    Raises:
        ValueError: if the header is short, from a versioned export, or describes an impossible shape.
    """
    if len(data) < HEADER.size:
        raise ValueError(f"llama2.c checkpoint is {len(data)} bytes, shorter than its {HEADER.size}-byte header")
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = HEADER.unpack_from(data)
    if dim == VERSIONED_MAGIC:
        raise ValueError("versioned llama2.c export (magic 'ak42') is not supported; export with version 0")
    header = Llama2cHeader(dim, hidden_dim, n_layers, n_heads, n_kv_heads, abs(vocab_size), seq_len, vocab_size > 0)
    sizes = (dim, hidden_dim, n_layers, n_heads, n_kv_heads, header.vocab_size, seq_len)
    if min(sizes) <= 0 or dim % n_heads or n_heads % n_kv_heads or header.head_dim % 2:
        raise ValueError(f"llama2.c checkpoint header describes an impossible model: {header}")
    return header


def _tensor_shapes(h: Llama2cHeader) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the float32 tensors after the header, in file order."""
    L, rope = h.n_layers, (h.seq_len, h.head_dim // 2)
    shapes = [
        ("tok_embeddings", (h.vocab_size, h.dim)), ("rms_att", (L, h.dim)),
        ("wq", (L, h.dim, h.dim)), ("wk", (L, h.kv_dim, h.dim)), ("wv", (L, h.kv_dim, h.dim)),
        ("wo", (L, h.dim, h.dim)), ("rms_ffn", (L, h.dim)), ("w1", (L, h.hidden_dim, h.dim)),
        ("w2", (L, h.dim, h.hidden_dim)), ("w3", (L, h.hidden_dim, h.dim)), ("rms_final", (h.dim,)),
        ("freq_cis_real", rope), ("freq_cis_imag", rope),
    ]  # fmt: skip
    if not h.shared_classifier:
        shapes.append(("wcls", (h.vocab_size, h.dim)))
    return shapes


def read_checkpoint(path: Path) -> tuple[Llama2cHeader, dict[str, np.ndarray]]:
    """Reads a llama2.c version-0 checkpoint.

    Returns:
        The header and the tensors by llama2.c name, float32, shapes as in ``_tensor_shapes``.

    Raises:
        ValueError: for a bad header or a file size that does not match it.
    """
    data = path.read_bytes()
    header = read_header(data)
    shapes = _tensor_shapes(header)
    expected = HEADER.size + 4 * sum(int(np.prod(shape)) for _, shape in shapes)
    if len(data) != expected:
        raise ValueError(f"llama2.c checkpoint {path} is {len(data)} bytes; its header implies {expected}")
    flat = np.frombuffer(data, dtype="<f4", offset=HEADER.size)
    tensors, offset = {}, 0
    for name, shape in shapes:
        size = int(np.prod(shape))
        tensors[name] = flat[offset : offset + size].reshape(shape)
        offset += size
    return header, tensors


def _rope_pairs_to_halves(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorders q/k projection rows from llama2.c's interleaved RoPE pairs to HF's rotate-half layout.

    Args:
        w: (n_heads * head_dim, dim) float32; within a head, rows (2j, 2j+1) form rotated pair j.

    Returns:
        (n_heads * head_dim, dim): within a head, rows j and j + head_dim/2 form pair j (same frequency).
    """
    rows, dim = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, dim).transpose(0, 2, 1, 3).reshape(rows, dim)


def _hf_state_dict(h: Llama2cHeader, t: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Maps llama2.c tensors to ``LlamaForCausalLM`` parameter names (float32 copies)."""
    embed = torch.tensor(t["tok_embeddings"])
    sd = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.tensor(t["rms_final"])}
    sd["lm_head.weight"] = embed if h.shared_classifier else torch.tensor(t["wcls"])
    for i in range(h.n_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = torch.tensor(_rope_pairs_to_halves(t["wq"][i], h.n_heads))
        sd[p + "self_attn.k_proj.weight"] = torch.tensor(_rope_pairs_to_halves(t["wk"][i], h.n_kv_heads))
        sd[p + "self_attn.v_proj.weight"] = torch.tensor(t["wv"][i])
        sd[p + "self_attn.o_proj.weight"] = torch.tensor(t["wo"][i])
        sd[p + "mlp.gate_proj.weight"] = torch.tensor(t["w1"][i])
        sd[p + "mlp.down_proj.weight"] = torch.tensor(t["w2"][i])
        sd[p + "mlp.up_proj.weight"] = torch.tensor(t["w3"][i])
        sd[p + "input_layernorm.weight"] = torch.tensor(t["rms_att"][i])
        sd[p + "post_attention_layernorm.weight"] = torch.tensor(t["rms_ffn"][i])
    return sd


def _llama_config(h: Llama2cHeader) -> LlamaConfig:
    """The LlamaConfig matching llama2.c's ``run.c`` forward pass (eps 1e-5, RoPE theta 10000)."""
    return LlamaConfig(
        vocab_size=h.vocab_size, hidden_size=h.dim, intermediate_size=h.hidden_dim,
        num_hidden_layers=h.n_layers, num_attention_heads=h.n_heads, num_key_value_heads=h.n_kv_heads,
        head_dim=h.head_dim, max_position_embeddings=h.seq_len, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=h.shared_classifier, bos_token_id=BOS_ID, eos_token_id=BOS_ID, dtype="float32",
    )  # fmt: skip


def read_tokenizer(path: Path, vocab_size: int) -> tuple[list[str], list[float]]:
    """Reads llama2.c's tokenizer file: int32 max_token_length, then per token float32 score, int32 length, bytes.

    Returns:
        pieces (with ids 0..2 renamed to ``SPECIAL_PIECES``) and their merge scores, both of length vocab_size.

    Raises:
        ValueError: if the file is truncated or too long for vocab_size, a piece is not UTF-8 or is duplicated,
            or ids 3..258 are not the byte-fallback pieces <0x00>..<0xFF>.
    """
    data, offset, pieces, scores = path.read_bytes(), 4, [], []
    try:
        for _ in range(vocab_size):
            score, length = struct.unpack_from("<fi", data, offset)
            raw = data[offset + 8 : offset + 8 + length]
            if length < 0 or len(raw) != length:
                raise ValueError("truncated")
            pieces.append(raw.decode("utf-8"))
            scores.append(score)
            offset += 8 + length
    except (struct.error, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"tokenizer {path} is not a llama2.c tokenizer of {vocab_size} pieces: {e}") from e
    if offset != len(data):
        raise ValueError(f"tokenizer {path} has {len(data) - offset} bytes left after {vocab_size} pieces")
    pieces[: len(SPECIAL_PIECES)] = SPECIAL_PIECES
    if pieces[len(SPECIAL_PIECES) : FIRST_PIECE_ID] != [f"<0x{b:02X}>" for b in range(NUM_BYTE_PIECES)]:
        raise ValueError(f"tokenizer {path}: ids 3..258 must be the byte-fallback pieces <0x00>..<0xFF>")
    if len(set(pieces)) != len(pieces):
        raise ValueError(f"tokenizer {path} has duplicate pieces")
    return pieces, scores


def _merges(pieces: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama2.c's "merge the adjacent pair whose concatenation scores highest".

    Every split of a piece into two pieces is a merge, ranked by the merged piece's score (highest first).
    NOTE: This equals llama2.c's greedy loop when scores are distinct (the leftmost pair wins in both), except
    for overlapping pairs x+y == y+z of one piece, where llama2.c takes the left one; tests check the vocabulary.
    """
    ids = {piece: i for i, piece in enumerate(pieces) if i >= FIRST_PIECE_ID}
    ranked = []
    for piece, i in ids.items():
        for k in range(1, len(piece)):
            if piece[:k] in ids and piece[k:] in ids:
                ranked.append((-scores[i], i, k, (piece[:k], piece[k:])))
    return [merge for *_, merge in sorted(ranked)]


def build_tokenizer(pieces: list[str], scores: list[float], max_length: int) -> PreTrainedTokenizerFast:
    """A fast tokenizer that encodes like llama2.c's ``encode(text, bos=1, eos=0)``.

    Pieces keep real spaces (no SentencePiece U+2581), the normalizer adds llama2.c's dummy-prefix space to
    non-empty text, BPE with byte fallback does the merging, and the post-processor prepends BOS. Special-token
    text such as "<s>" in the input is split like any other text, as llama2.c does. Decoding turns byte pieces
    back into UTF-8 and strips one leading space (the dummy prefix).
    """
    vocab = {piece: i for i, piece in enumerate(pieces)}
    bpe = models.BPE(vocab, _merges(pieces, scores), unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Prepend(" ")  # skips empty text, as llama2.c does
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in SPECIAL_PIECES])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", add_bos_token=True,
        add_eos_token=False, split_special_tokens=True, clean_up_tokenization_spaces=False,
        model_max_length=max_length,
    )  # fmt: skip


def _existing_file(path: str | Path, what: str) -> Path:
    """Returns ``path`` as a Path, or raises FileNotFoundError naming ``what`` is missing."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    return path


def convert_llama2c(checkpoint_path: str | Path, tokenizer_path: str | Path, out_dir: str | Path) -> Path:
    """Converts a llama2.c checkpoint and tokenizer into a transformers Llama model directory.

    Writes config.json, model.safetensors (float32), generation_config.json, and the fast tokenizer
    (tokenizer.json, tokenizer_config.json with the special tokens). q/k projection rows are reordered for HF's
    rotate-half RoPE. The stop token: llama2.c stops when the model emits BOS (id 1), which separates stories in
    its training data, so config.json and generation_config.json set ``eos_token_id = 1`` (and
    ``bos_token_id = 1``); the tokenizer's own ``eos_token`` stays "</s>" (id 2), which the model never emits.

    Args:
        checkpoint_path: llama2.c version-0 checkpoint (``model.bin``).
        tokenizer_path: llama2.c tokenizer (``tokenizer.bin``), with as many pieces as the checkpoint's vocab.
        out_dir: output directory, created if missing; existing files of the same names are overwritten.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        FileNotFoundError: if the checkpoint or tokenizer file does not exist.
        ValueError: if either file is malformed or they do not match each other.
    """
    checkpoint_path = _existing_file(checkpoint_path, "llama2.c checkpoint")
    tokenizer_path = _existing_file(tokenizer_path, "llama2.c tokenizer")
    header, tensors = read_checkpoint(checkpoint_path)
    pieces, scores = read_tokenizer(tokenizer_path, header.vocab_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    model = LlamaForCausalLM(_llama_config(header)).to(torch.float32)
    model.load_state_dict(_hf_state_dict(header, tensors), strict=True)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=BOS_ID)
    model.save_pretrained(out_dir)
    build_tokenizer(pieces, scores, header.seq_len).save_pretrained(out_dir)
    return out_dir
