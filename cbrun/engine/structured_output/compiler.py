"""Grammars compiled once per distinct constraint, on a thread pool, with xgrammar.

Why xgrammar (measured against llguidance 1.9.1 on one workload: ``benchmarks/structured_backends.py``, results in
``benchmarks/results-structured-outputs.md``): its masks are the int32 bitmask layout the batched sampler takes,
it compiles JSON schema, regex, EBNF and Lark, it caches the token-level work per grammar so the per-step mask is
a lookup over a few states, and it is vLLM's and SGLang's default, so its JSON-schema coverage is what users meet
elsewhere. We never write a schema compiler: every constraint becomes an xgrammar ``CompiledGrammar``, or, for a
JSON schema routed to llguidance (``schema_support.route``: a keyword xgrammar does not enforce, or
``structured_outputs_backend = "guidance"``), a ``GuidanceGrammar`` whose masks fill the same bitmask.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from cbrun.engine.structured_output.params import StructuredOutputsParams
from cbrun.engine.structured_output.schema_support import GUIDANCE_FORMATS, without_formats

logger = logging.getLogger("cbrun.engine")


class GrammarCompileError(ValueError):
    """A constraint xgrammar cannot compile (an invalid schema, regex or grammar): the request's own fault."""


class GuidanceGrammar:
    """A constraint compiled for llguidance: its grammar, and a matcher in its start state that every request's
    matcher is copied from.

    Building an ``llguidance.LLMatcher`` compiles the grammar into its lexer and parser (3 ms for
    ``cbrun.bench.structured.SCHEMA`` over a 32000-token vocabulary, on the step's thread if done per request);
    ``LLMatcher.deep_copy`` of a built one takes microseconds and gives the same matcher (its lexer states
    included). The copies share nothing mutable.

    Attributes:
        tokenizer: the ``llguidance.LLTokenizer`` over the model's vocabulary (one per compiler).
        grammar: the grammar (``LLMatcher.grammar_from_json_schema`` and the like), validated.
        eos_token_ids: the model's EOS ids (the end of a completed structure).
    """

    def __init__(self, tokenizer, grammar: str, eos_token_ids: frozenset[int]) -> None:
        import llguidance

        self.tokenizer = tokenizer
        self.grammar = grammar
        self.eos_token_ids = eos_token_ids
        self._start = llguidance.LLMatcher(tokenizer, grammar)
        if self._start.is_error():  # llguidance reports a grammar it cannot build this way, never by raising
            raise GrammarCompileError(f"invalid constraint (llguidance): {self._start.get_error()[:300]}")
        self._lock = threading.Lock()

    def new_matcher(self):
        """A fresh ``llguidance.LLMatcher`` at the grammar's start (a copy of the one built at compile time)."""
        with self._lock:  # copying locks the matcher's lexer; one copy at a time
            return self._start.deep_copy()


#: llguidance's JSON options: compact (the separators xgrammar's compact JSON writes, no free whitespace);
#: ``coerce_one_of`` serves a oneOf as an anyOf, which ``schema_support`` allows only for disjoint branches.
GUIDANCE_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "coerce_one_of": True,
}


#: JSON string characters (llguidance's slices use this class: no quote, backslash or control character).
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'
#: llguidance's "slices" (``LLTokenizer.general_slices``: whitespace, string runs of up to 10, up to 30, any), with
#: shorter runs first: inside a string of bounded length (``maxLength``) a slice whose strings all still fit is
#: allowed whole instead of walked token by token, so a row near its bound walks fewer tokens. The masks are the
#: same (a slice only groups tokens); on ``benchmarks.structured_engines``' workload they cost about 10% less CPU.
GUIDANCE_SLICES = [
    r"[\x20\x0A\x0D\x09]+",
    *(f"{_STRING_CHAR}{{1,{n}}}" for n in (1, 2, 3, 4, 5, 6, 8, 10, 16, 30)),
    f"{_STRING_CHAR}+",
]


class GrammarCompiler:
    """Compiles each distinct constraint once (a cache keyed by ``StructuredOutputsParams.key``), off the step loop.

    ``submit`` returns at once with a future; the scheduler keeps a request waiting until it is done
    (``RequestStatus.WAITING_FOR_GRAMMAR``), and the other requests go on. The tokenizer's vocabulary is read once,
    in the pool, on the first submit.

    Args:
        tokenizer: the model's tokenizer (``cbrun.engine.core.tokenizer.FastTokenizer`` or a transformers one).
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary: padded ids are never allowed).
        eos_token_ids: the model's EOS ids: the only tokens allowed once a structure is complete.
        max_threads: compile threads.
        max_cached: compiled constraints kept, least recently used dropped first (a job whose rows each bring
            their own schema would otherwise hold them all).
        ignore_formats: JSON schemas' unenforced ``format`` values are left out of llguidance's grammar
            (``structured_outputs_ignore_formats``; xgrammar drops formats it does not know itself).

    Attributes:
        num_compiled: distinct constraints compiled (failures included).
        compile_seconds: seconds spent compiling them, summed over the compile threads (the first compile
            includes reading the tokenizer's vocabulary).
        compile_times: ``(backend, seconds)`` of each compile, in the order they ended (llguidance compiles
            lazily: its first masks are paid at the first steps, not here).
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        max_threads: int = 2,
        max_cached: int = 1024,
        ignore_formats: bool = False,
    ) -> None:
        self.ignore_formats = ignore_formats
        self._ll_tokenizer = None
        self.max_cached = max_cached
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="cbrun-grammar")
        self._lock = threading.Lock()
        self._xgr_compiler = None
        self._cache: dict[tuple[str, str, str], Future] = {}  # (backend, kind, text)
        self.num_compiled = 0
        self.compile_seconds = 0.0
        self.compile_times: list[tuple[str, float]] = []

    def submit(self, params: StructuredOutputsParams, backend: str = "xgrammar") -> Future:
        """A future of the constraint's ``xgrammar.CompiledGrammar`` (``backend = "guidance"``: a
        ``GuidanceGrammar``); the cached one for a constraint seen before.

        The future raises ``GrammarCompileError`` for a constraint the engine refuses.
        """
        key = (backend, *params.key)
        future = self._cache.get(key)
        if future is None:
            future = self._cache[key] = self._pool.submit(self._compile, key)
            if len(self._cache) > self.max_cached:  # the oldest goes; requests keep their own future
                del self._cache[next(iter(self._cache))]
        else:
            self._cache[key] = self._cache.pop(key)  # most recently used last
        return future

    def wait_any(self, futures: list[Future], timeout: float) -> None:
        """Block until one of ``futures`` is done or ``timeout`` seconds pass (an idle engine waiting on grammars)."""
        wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, key: tuple[str, str, str]):
        start = time.perf_counter()
        backend, kind, text = key
        try:
            if backend == "guidance":
                compiled = self._compile_guidance(kind, text)
            else:
                compiled = _compile_with(self._compiler(), kind, text)
        except GrammarCompileError:
            raise
        except ImportError:
            extra = "guidance" if backend == "guidance" else "structured"
            raise GrammarCompileError(f"structured outputs need {backend}: pip install 'cbrun[{extra}]'") from None
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError subclasses for bad input
            reason = _first_line(exc)
            if kind == "regex":  # a regex is translated to EBNF first; that text's line and column mean nothing here
                reason = re.sub(r"^EBNF parser error at line \d+, column \d+: ", "", reason)
            raise GrammarCompileError(f"invalid {kind.replace('_', ' ')} constraint: {reason}") from None
        finally:
            seconds = time.perf_counter() - start
            with self._lock:
                self.num_compiled += 1
                self.compile_seconds += seconds
                self.compile_times.append((backend, seconds))
        logger.info("structured outputs: compiled a %s constraint (%s) in %.3f s", kind, backend, seconds)
        return compiled

    def _compile_guidance(self, kind: str, text: str) -> GuidanceGrammar:
        """A constraint's llguidance grammar, validated against the tokenizer (llguidance refuses there what it
        does not implement: an unknown format, a regex lookaround, a grammar it cannot read).

        JSON schemas go through ``grammar_from_json_schema`` with ``GUIDANCE_JSON_OPTIONS``; a regex is read as
        llguidance reads regexes (Rust ``regex`` syntax, matched against the whole output); a choice becomes a Lark
        alternation of its strings; a grammar is Lark, or GBNF / xgrammar's EBNF (``::=``) converted to Lark by
        ``llguidance.gbnf_to_lark``.
        """
        import llguidance

        if kind in ("json", "json_object"):
            schema = without_formats(json.loads(text), GUIDANCE_FORMATS if self.ignore_formats else None)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema,
                defaults=GUIDANCE_JSON_OPTIONS,  # type: ignore[arg-type]  # its JsonCompileOptions keys
            )
        else:
            try:
                grammar = llguidance.grammar_from("choice" if kind == "choice" else kind, text)  # type: ignore[arg-type]
            except ValueError as exc:  # a grammar the GBNF-to-Lark conversion cannot read
                raise GrammarCompileError(f"invalid {kind} constraint (llguidance): {_first_line(exc)}") from None
        tokenizer = self._guidance_tokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise GrammarCompileError(f"invalid {kind.replace('_', ' ')} constraint (llguidance): {messages[0][:300]}")
        return GuidanceGrammar(tokenizer, grammar, frozenset(self._eos_token_ids))

    def _guidance_tokenizer(self):
        """llguidance's tokenizer over the model's vocabulary, built on first use."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                tokenizer = self._tokenizer
                if hasattr(tokenizer, "transformers_tokenizer"):
                    tokenizer = tokenizer.transformers_tokenizer()
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids, slices=GUIDANCE_SLICES
                )
            return self._ll_tokenizer

    def _compiler(self):
        """xgrammar's compiler over the tokenizer, built on first use (reading the vocabulary takes a while)."""
        with self._lock:
            if self._xgr_compiler is None:
                import xgrammar as xgr

                tokenizer = self._tokenizer
                if hasattr(tokenizer, "transformers_tokenizer"):  # engine.tokenizer.FastTokenizer
                    tokenizer = tokenizer.transformers_tokenizer()
                info = _tokenizer_info(xgr, tokenizer, self.vocab_size, self._eos_token_ids)
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._xgr_compiler


def _tokenizer_info(xgr, tokenizer, vocab_size: int | None, stop_token_ids):
    """xgrammar's view of the vocabulary, with every special token (BOS, UNK, chat markers, ...) spelled as no
    text, so no grammar can match it: xgrammar takes a token's text as written, and ``<unk>`` would otherwise
    satisfy a grammar such as ``"<" [a-z]+ ">"`` while decoding to nothing. The stop tokens stay allowed where the
    grammar may end."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= {
        i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items() if getattr(t, "special", False)
    }
    special -= set(info.stop_token_ids)
    if not special:
        return info
    size = info.vocab_size
    encoded = [""] * size
    for token, index in tokenizer.get_vocab().items():
        if index < size and index not in special:
            encoded[index] = token
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=info.vocab_type,
        vocab_size=size,
        stop_token_ids=info.stop_token_ids,
        add_prefix_space=info.add_prefix_space,
    )


#: xgrammar 0.2.9's JSON string characters: a length-bounded string's (``maxLength``/``minLength``) lets raw
#: control characters through, and both let UTF-8-encoded surrogates (U+D800..U+DFFF) through, which no JSON text
#: holds (RFC 8259 sections 7 and 8.1; a byte-level tokenizer can spell them). Both become ``_JSON_STRING_CHAR``, so
#: every output decodes as UTF-8 and parses with a strict JSON parser.
_LOOSE_STRING_CHARS = (r"[^\0-\x1f\"\\\r\n]", r"[^\"\\\r\n]")
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n\uD800-\uDFFF]"


def _strict_json_strings(ebnf: str) -> str:
    for loose in _LOOSE_STRING_CHARS:
        ebnf = ebnf.replace(loose, _JSON_STRING_CHAR)
    return ebnf


def _compile_with(compiler, kind: str, text: str):
    """One constraint's ``CompiledGrammar``. JSON is compact (no free whitespace), so a bounded schema has a
    bounded longest form and a weak model cannot pad its output with blanks until ``max_tokens``."""
    if kind in ("json", "json_object"):
        import xgrammar as xgr

        ebnf = str(xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True))
        return compiler.compile_grammar(_strict_json_strings(ebnf))
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(text))
        return compiler.compile_grammar(f"root ::= {alternatives}")
    if "::=" in text:  # EBNF (xgrammar's GBNF dialect); Lark writes its rules "name: ..."
        return compiler.compile_grammar(text)
    return compiler.compile_lark(text)


def _first_line(exc: Exception) -> str:
    """The library's message without its log prefix ("[12:00:00] /project/cpp/file.cc:94: ")."""
    text = str(exc).strip() or type(exc).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0])[:300]
