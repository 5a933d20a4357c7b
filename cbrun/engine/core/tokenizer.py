"""The model's tokenizer, without importing transformers where that gives exactly transformers' tokenizer.

A model directory with a ``tokenizer.json`` loads in transformers 5 as a ``TokenizersBackend`` (the class
``PreTrainedTokenizerFast`` names): the ``tokenizers`` library's ``Tokenizer`` over that file, with what
``tokenizer_config.json`` adds on top. ``FastTokenizer`` wraps the same ``Tokenizer`` with the calls cbrun makes
(``encode``, ``decode``, special tokens and their ids, ``convert_ids_to_tokens``, ``get_vocab``), reproducing what
transformers 5.24 does with the config:

- ``add_bos_token`` / ``add_eos_token`` are dropped when tokenizer.json is loaded (``_from_pretrained`` pops them),
  so tokenizer.json's post-processor stands; a file without one gets transformers' ``$A:0`` template.
- ``split_special_tokens`` sets the backend's ``encode_special_tokens`` (special-token text is then encoded as
  ordinary text).
- ``clean_up_tokenization_spaces`` is ignored for a BPE model (transformers skips it there, with a warning).
- truncation and padding stored in tokenizer.json are off for ``encode`` (it never truncates or pads).
- named special tokens (``bos_token``, ...) and extra special tokens must already be special added tokens of
  tokenizer.json, and ``added_tokens_decoder`` must repeat tokenizer.json's added tokens: then transformers adds
  nothing, and the vocabulary is the file's.

``fast_tokenizer_reason`` refuses everything else (another tokenizer class, a model type whose tokenizer
transformers builds another way (Qwen2's ``Qwen2Tokenizer``), ``special_tokens_map.json`` or ``added_tokens.json``
beside the config, a config key not listed here, an AddedToken that differs, a cleanup that would apply);
``load_tokenizer`` then takes transformers' ``AutoTokenizer``. A chat template is never rendered here: its calls
go to transformers' tokenizer (see ``FastTokenizer``). The tests (``tests/engine/test_tokenizer.py``) compare both
on many strings for every tokenizer the repository builds.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("cbrun.engine")

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: tokenizer_config.json's ``tokenizer_class`` values that load as ``TokenizersBackend``.
BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
#: config.json model types whose tokenizer_config class AutoTokenizer takes as given (Qwen2's it replaces).
MODEL_TYPES = ("llama",)
#: tokenizer_config.json keys with no effect on encode / decode here (bookkeeping, padding, the chat template).
_INERT_KEYS = frozenset(
    {
        "tokenizer_class",
        "backend",
        "model_max_length",
        "legacy",
        "add_prefix_space",
        "add_bos_token",
        "add_eos_token",
        "chat_template",
        "model_input_names",
        "name_or_path",
        "processor_class",
        "padding_side",
        "truncation_side",
        "clean_up_tokenization_spaces",
        "split_special_tokens",
        "added_tokens_decoder",
        "additional_special_tokens",
        "extra_special_tokens",
        *NAMED_SPECIAL_TOKENS,
    }
)
_ADDED_TOKEN_FLAGS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
_LOGGED: set[tuple[str, str]] = set()


class FastTokenizer:
    """A ``tokenizers.Tokenizer`` with transformers' ``TokenizersBackend`` calls that cbrun uses.

    Anything else (``apply_chat_template``, ``chat_template``, ``batch_decode``, ...) is answered by transformers'
    own tokenizer of the same directory, loaded (and transformers imported) on first use: a chat job gets
    exactly transformers' chat template, and a job that needs none never imports it.

    Attributes:
        name_or_path: the model directory, as given.
        bos_token, eos_token, unk_token, pad_token, ...: the named special tokens' text, or None; ``*_id``: the id.
    """

    def __init__(
        self,
        backend: Tokenizer,
        name_or_path: str,
        special_tokens: dict[str, str | None],
        extra_special_tokens: list[str],
        split_special_tokens: bool,
    ) -> None:
        from tokenizers import processors

        self._backend = backend
        self.name_or_path = name_or_path
        self._special = {name: special_tokens.get(name) for name in NAMED_SPECIAL_TOKENS}
        self._extra_special_tokens = list(extra_special_tokens)
        self._transformers: PreTrainedTokenizerBase | None = None
        backend.no_truncation()  # as transformers' encode sets them for every call
        backend.no_padding()
        backend.encode_special_tokens = split_special_tokens
        if backend.post_processor is None:  # TokenizersBackend.update_post_processor, no BOS or EOS added
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])

    def __getattr__(self, name: str) -> Any:
        """``bos_token``, ``eos_token_id``, ...: a named special token's text, or its id (None when unset); any
        other public name: transformers' tokenizer's."""
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        base = name.removesuffix("_id")
        if base in NAMED_SPECIAL_TOKENS:
            token = self._special[base]
            return token if token is None or base == name else self.convert_tokens_to_ids(token)
        return getattr(self.transformers_tokenizer(), name)

    def transformers_tokenizer(self) -> PreTrainedTokenizerBase:
        """transformers' ``AutoTokenizer`` of the same directory (imports transformers on the first call)."""
        if self._transformers is None:
            from transformers import AutoTokenizer

            logger.info(
                "tokenizer: loading transformers' AutoTokenizer of %s for a call engine.tokenizer does not make itself",
                self.name_or_path,
            )
            self._transformers = AutoTokenizer.from_pretrained(self.name_or_path, local_files_only=True)
        return self._transformers

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **kwargs: Any) -> Any:
        """``{"input_ids": ..., "attention_mask": ...}`` of a text or a list of texts, as transformers' call
        returns them without padding; with any other option, transformers' tokenizer's call."""
        if kwargs:
            return self.transformers_tokenizer()(text, add_special_tokens=add_special_tokens, **kwargs)
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        rows = [self.encode(t, add_special_tokens) for t in text]
        return {"input_ids": rows, "attention_mask": [[1] * len(i) for i in rows]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with the post-processor's special tokens (e.g. BOS) unless told not to.

        Raises:
            ValueError: when ``text`` is not a string (as transformers does).
        """
        if not isinstance(text, str):
            raise ValueError("text input must be of type `str` (single example)")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids`` (a list of ids or one id); special tokens left out when asked."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> Any:
        """A token's id (the unknown token's when it has none), or the ids of a list of tokens."""
        if isinstance(tokens, str):
            index = self._backend.token_to_id(tokens)
            return index if index is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(
        self, ids: int | list[int], skip_special_tokens: bool = False
    ) -> str | None | list[str | None]:
        """The vocabulary piece of one id, or of each of a list of ids (special ones skipped when asked)."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens' text, then the extra ones, each once."""
        tokens = [t for t in self._special.values() if t is not None] + self._extra_special_tokens
        return list(dict.fromkeys(tokens))

    @property
    def all_special_ids(self) -> list[int]:
        ids: list[int] = self.convert_tokens_to_ids(self.all_special_tokens)
        return ids

    def get_vocab(self) -> dict[str, int]:
        """Token -> id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary (without added tokens)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)


def fast_tokenizer_reason(model_dir: str | Path) -> str | None:
    """Why ``FastTokenizer`` would not equal transformers' tokenizer for ``model_dir`` (None: it does)."""
    _, reason = _fast_tokenizer(str(model_dir))
    return reason


def load_tokenizer(model_dir: str | Path, *, loader: str = "auto") -> FastTokenizer | PreTrainedTokenizerBase:
    """The model directory's tokenizer: a ``FastTokenizer`` where it equals transformers', else ``AutoTokenizer``'s.

    Args:
        model_dir: the model directory (nothing is downloaded).
        loader: ``EngineConfig.loader``: "transformers" always takes ``AutoTokenizer``.

    Raises:
        OSError, ValueError, TypeError: from ``AutoTokenizer`` when the directory has no usable tokenizer.
    """
    model_dir = str(model_dir)
    reason = "engine.loader = transformers" if loader == "transformers" else None
    tokenizer: FastTokenizer | None = None
    if reason is None:
        tokenizer, reason = _fast_tokenizer(model_dir)
    if tokenizer is not None:
        _log_once(model_dir, "tokenizer: tokenizer.json through tokenizers, without transformers (engine.tokenizer)")
        return tokenizer
    _log_once(model_dir, f"tokenizer: transformers' AutoTokenizer ({reason})")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def _log_once(model_dir: str, line: str) -> None:
    """Log which tokenizer loads, once per directory and choice (a job and its engine both load one)."""
    if (model_dir, line) not in _LOGGED:
        _LOGGED.add((model_dir, line))
        logger.info("%s", line)


def _fast_tokenizer(model_dir: str) -> tuple[FastTokenizer | None, str | None]:
    from tokenizers import Tokenizer

    settings, reason = _read_files(Path(model_dir))
    if settings is None:
        return None, reason
    try:
        backend = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    except Exception as exc:  # tokenizers raises plain Exceptions; transformers then reports the file its own way
        return None, f"tokenizer.json does not load ({exc})"
    try:
        reason = _added_tokens_differ(backend, settings)
        specials = {name: _content(settings.get(name)) for name in NAMED_SPECIAL_TOKENS}
        extras = [_content(t) for t in _extra_special_tokens(settings)]
    except (AttributeError, TypeError, ValueError) as exc:  # a value of an unexpected type: transformers' to judge
        return None, f"tokenizer_config.json holds a value not read here ({exc})"
    if reason:
        return None, reason
    if settings.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return None, "clean_up_tokenization_spaces = true on a non-BPE model"
    return FastTokenizer(backend, model_dir, specials, extras, bool(settings.get("split_special_tokens", False))), None


def _extra_special_tokens(settings: dict[str, Any]) -> list[Any]:
    """The extra special tokens, as transformers reads them (``additional_special_tokens`` is the old name)."""
    return list(settings.get("extra_special_tokens") or settings.get("additional_special_tokens") or [])


def _read_files(model_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """tokenizer_config.json when the files are ones ``FastTokenizer`` reads exactly, else ``(None, why not)``."""
    if not (model_dir / "tokenizer.json").is_file():
        return None, "no tokenizer.json"
    for legacy in ("special_tokens_map.json", "added_tokens.json"):
        if (model_dir / legacy).is_file():
            return None, f"{legacy} beside tokenizer_config.json (legacy special tokens)"
    try:
        settings = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        model_type = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        return None, f"tokenizer_config.json or config.json is unreadable ({exc})"
    if not isinstance(settings, dict):
        return None, "tokenizer_config.json is not a JSON object"
    if settings.get("tokenizer_class") not in BACKEND_CLASSES or settings.get("backend", "tokenizers") != "tokenizers":
        return None, f"tokenizer_class {settings.get('tokenizer_class')!r} is not one of {', '.join(BACKEND_CLASSES)}"
    if model_type not in MODEL_TYPES:
        return None, f"model_type {model_type!r}: transformers may build its tokenizer another way"
    unknown = sorted(set(settings) - _INERT_KEYS)
    if unknown:
        return None, f"tokenizer_config.json sets {', '.join(unknown)}"
    for side in ("padding_side", "truncation_side"):
        if settings.get(side, "right") not in ("right", "left"):
            return None, f"{side} = {settings[side]!r}"
    if isinstance(settings.get("extra_special_tokens"), dict):
        return None, "extra_special_tokens is a dict (model-specific named tokens)"
    return settings, None


def _content(token: Any) -> Any:
    """A special token's text from tokenizer_config.json: a string, or a serialized AddedToken's content (another
    value comes back as it is, and is refused)."""
    if isinstance(token, dict) and token.get("__type") == "AddedToken":
        return token.get("content")
    return token


def _added_tokens_differ(backend: Tokenizer, settings: dict[str, Any]) -> str | None:
    """Why transformers would change the backend's added tokens (None: it adds and changes nothing)."""
    added = backend.get_added_tokens_decoder()
    for index, token in (settings.get("added_tokens_decoder") or {}).items():
        have = added.get(int(index))
        # NOTE: transformers re-adds every entry; tokenizers then replaces a token whose flags differ in any way
        if (
            not isinstance(token, dict)
            or have is None
            or any(getattr(have, flag) != token.get(flag) for flag in _ADDED_TOKEN_FLAGS)
        ):
            return f"added_tokens_decoder entry {index} differs from tokenizer.json's added tokens"
    special_added = {t.content for t in added.values() if t.special}
    names = [_content(settings.get(name)) for name in NAMED_SPECIAL_TOKENS]
    for token in [t for t in names if t is not None] + [_content(t) for t in _extra_special_tokens(settings)]:
        if not isinstance(token, str) or token not in special_added:
            return f"special token {token!r} is not a special added token of tokenizer.json"
    return None
