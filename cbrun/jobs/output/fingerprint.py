"""A job's fingerprint: the settings and the content that determine its outputs, cheap to take on big inputs.

It is written to the output's ``_cbrun/job.json`` when a job starts; a run whose fingerprint differs is refused (a
resume would mix the rows of two jobs), naming what changed, e.g. ``model.weights.model.safetensors`` or
``input.files.train-00001.parquet``.

What it reads:
  - the model's config, generation config, tokenizer and chat template files: all their bytes (they are small);
  - each weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``): its size, its safetensors
    header (every tensor's name, dtype, shape and offsets) or first 64 KiB, and ``NUM_SAMPLES`` byte ranges of
    64 KiB spread evenly over the file (a 100 GB checkpoint costs a few MB of reads);
  - each input object in an object store: its size, ETag and Parquet footer (the store's own checksum of the
    bytes; nothing else is read);
  - each input file: its size, its Parquet footer (schema, row groups and their column statistics: min, max, null
    count) or first 64 KiB (Arrow), and the same sampled byte ranges;
  - a Hub model (``cbrun.jobs.model.source``): its repo id as the path, the revision asked for and the commit sha it
    resolved to (a resume asking for the same revision runs that commit: ``cbrun.jobs.run.resolve.resolve_job_model``);
  - the settings that change a row's output (prompt, mode, sampling, seed, n, dtype), the cbrun version and the
    sampler's version (``cbrun.engine.config.SAMPLER_VERSION``: which token a seeded row draws);
  - with speculation on, its settings (mode, k, n-gram range, switch and row cost: they decide which proposals a
    sampled row's verify steps draw against, so they change its tokens, never a greedy row's), and with
    ``speculative = "draft"`` the draft model as the model (its proposals and probabilities enter the draws).

What it can miss: an edit in place that keeps every file's size and touches none of the bytes read. For weights,
that is a change to tensor values outside the sampled ranges that keeps the header (e.g. a fine-tune written over
the same file); for Parquet, new values that keep the size, the footer statistics and the sampled pages (files
written without statistics are weaker). Modification times are not read, so a copied or re-downloaded but equal
file is the same job. Engine settings that only change speed (page_size, max_batch_tokens, ...), ``input.limit``
(raising it extends a job) and ``input.order_window`` (it changes the order of work, never a row's output) are
left out.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from cbrun.engine.config import SAMPLER_VERSION, SPECULATION_RULE_VERSION
from cbrun.jobs.store.files import basename, is_uri, object_digest, parquet_footer_size

#: Files of the model directory whose bytes define the model's outputs besides the weights (hashed whole).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BYTES = 64 * 1024
NUM_SAMPLES = 4


def cbrun_version() -> str:
    try:
        return metadata.version("cbrun")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _read_at(f, offset: int, size: int) -> bytes:
    f.seek(offset)
    return f.read(size)


def sampled_digest(path: Path, head: bytes | None = None) -> str:
    """sha256 of a file's size, ``head`` (its header or footer; else its first ``SAMPLE_BYTES``) and
    ``NUM_SAMPLES`` ranges of ``SAMPLE_BYTES`` at evenly spaced offsets (the whole file when it is small)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode() + b"\0")
    with open(path, "rb") as f:
        if size <= (NUM_SAMPLES + 1) * SAMPLE_BYTES:
            digest.update(f.read())
            return digest.hexdigest()
        digest.update(head if head is not None else _read_at(f, 0, SAMPLE_BYTES))
        for k in range(1, NUM_SAMPLES + 1):
            digest.update(_read_at(f, (size - SAMPLE_BYTES) * k // NUM_SAMPLES, SAMPLE_BYTES))
    return digest.hexdigest()


def safetensors_header(path: Path) -> bytes | None:
    """The 8-byte length and the JSON header of a safetensors file; None when it is not one."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return None
        length = int.from_bytes(prefix, "little")
        if length > path.stat().st_size - 8 or length > 100 * 2**20:
            return None
        return prefix + f.read(length)


def parquet_footer(path: Path) -> bytes | None:
    """A Parquet file's footer (metadata, row-group statistics) with its length and magic; None when it is not one."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        tail = _read_at(f, max(size - 8, 0), 8)
        if len(tail) < 8 or tail[4:] != b"PAR1":
            return None
        length = int.from_bytes(tail[:4], "little")
        if length > size - 12:
            return None
        return _read_at(f, size - 8 - length, length + 8)


def model_fingerprint(model_path: str | Path) -> dict[str, Any]:
    """{"files": {name: sha256 of its bytes}, "weights": {name: sampled digest}} of a model directory."""
    model_path = Path(model_path)
    files, weights = {}, {}
    if not model_path.is_dir():
        return {"files": files, "weights": weights}
    names = list(MODEL_FILES) + sorted(
        p.relative_to(model_path).as_posix() for p in model_path.glob("additional_chat_templates/*.jinja")
    )
    for name in names:
        path = model_path / name
        if path.is_file():
            files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    for path in sorted(model_path.iterdir()):
        if path.is_file() and path.suffix in WEIGHT_SUFFIXES:
            head = safetensors_header(path) if path.suffix == ".safetensors" else None
            weights[path.name] = sampled_digest(path, head)
    return {"files": files, "weights": weights}


def input_fingerprint(input_path: str | Path, endpoint_url: str | None = None) -> dict[str, str]:
    """{file name relative to the input path: sampled digest (Parquet: footer-led)} of the input's files; {} when
    the input cannot be listed."""
    from cbrun.jobs.input.discovery import list_input_files
    from cbrun.jobs.input.errors import InputError

    try:
        kind, paths = list_input_files(input_path, endpoint_url)
    except InputError:
        return {}
    if kind == "objects":
        return object_fingerprints(str(input_path), [str(p) for p in paths], endpoint_url)
    root = Path(input_path)
    digests = {}
    for path in paths:
        name = path.name if root.is_file() else path.relative_to(root).as_posix()
        try:
            head = parquet_footer(path) if _is_parquet(path) else None
        except InputError:
            head = None
        digests[name] = sampled_digest(path, head)
    return digests


def _is_parquet(path: str | Path) -> bool:
    """Whether an input file (an object: by name alone) is Parquet, whose footer leads its digest.

    Raises:
        InputError: from ``input_file_format``, for a local file its format refuses.
    """
    from cbrun.jobs.input.discovery import input_file_format, object_file_format

    fmt = object_file_format(path) if isinstance(path, str) else input_file_format(path)
    return fmt is not None and fmt.name == "parquet"


def object_fingerprints(root: str, uris: list[str], endpoint_url: str | None = None) -> dict[str, str]:
    """{object name relative to ``root``: digest of its size, ETag and (Parquet) footer} of input objects: an
    object's metadata stands for its bytes, so nothing but the footers is read."""
    root = root.rstrip("/")
    digests = {}
    for uri in uris:
        name = uri[len(root) + 1 :] if uri != root else basename(uri)
        tail = parquet_footer_size(uri, endpoint_url) if _is_parquet(uri) else 0
        digests[name] = object_digest(uri, tail, endpoint_url)
    return digests


def _resolved(path: str | Path) -> str:
    """A path as recorded: an object-store URI as given, a local path made absolute."""
    return str(path).rstrip("/") if is_uri(path) else str(Path(path).resolve())


def job_fingerprint(
    manifest,
    num_input_rows: int,
    num_shards: int = 1,
    engine_dtype: str | None = None,
    may_sample: bool = True,
    batch_invariant: bool = False,
    model_source=None,
) -> dict[str, Any]:
    """The settings and content that determine a job's outputs, as a JSON-ready dict.

    Keys added in later versions are recorded only when set, so the jobs of earlier versions keep their fingerprint.

    Args:
        manifest: the ``JobManifest`` (a job's resolved one: ``cbrun.jobs.run.resolve.ResolvedJob.fingerprint``).
        num_input_rows: rows in the whole input, so that a replaced input file of another length is noticed.
        num_shards: N of a sharded run (``--shard I/N``), 1 otherwise: the split of the rows and the part names
            depend on it, so an output is continued with the same N only.
        engine_dtype: the dtype the engine runs in (``EngineConfig.resolve_dtype``: "auto" resolved for the
            device); None records ``manifest.engine.dtype`` as written.
        may_sample: whether any row may be sampled (the job's settings, per-row setting columns, OpenAI batch
            bodies): only then is the sampler's version recorded, so a greedy job of an earlier version resumes.
        batch_invariant: whether the engine runs ``engine.batch_invariant`` (resolved): recorded with the sampler
            when a row may be sampled, since a sampled row's tokens depend on it (an output is not continued in the
            other mode).
        model_source: a Hub model's ``ModelSource`` (its repo id, revision and commit are recorded); None: a folder.
    """
    fingerprint = {
        "cbrun_version": cbrun_version(),
        "model": _model_part(manifest, engine_dtype, model_source),
        "input": _input_part(manifest.input, num_input_rows, manifest.storage.endpoint_url),
        "sampling": _sampling_part(manifest, may_sample, batch_invariant),
        "shards": {"count": num_shards},
    }
    if manifest.output.keep_columns:
        fingerprint["output"] = {"keep_columns": list(manifest.output.keep_columns)}
    fingerprint.update(_speculation_parts(manifest.engine))
    # NOTE: a JSON round trip (tuples become lists) so it compares equal to the job.json it is written to.
    return json.loads(json.dumps(fingerprint))


def _model_part(manifest, engine_dtype: str | None, model_source) -> dict[str, Any]:
    """The model's files and weights, the dtype it runs in, a Hub model's repo id, revision and commit, an fp8 KV
    cache and W8A8 linears (``fp8_activation_scheme``): lossy, they change greedy tokens too."""
    model = model_fingerprint(manifest.model.path)
    part = {
        "path": _resolved(manifest.model.path),
        "files": model["files"],
        "weights": model["weights"],
        "dtype": engine_dtype or manifest.engine.dtype,
    }
    if model_source is not None:  # a Hub model: its repo id as the path (``ModelSource.fingerprint_fields``)
        part.update(model_source.fingerprint_fields())
    if manifest.engine.kv_cache_dtype != "auto":
        part["kv_cache_dtype"] = manifest.engine.kv_cache_dtype
    if manifest.engine.fp8_activation_scheme != "none":
        part["fp8_activation_scheme"] = manifest.engine.fp8_activation_scheme
    return part


def _input_part(inp, num_input_rows: int, endpoint_url: str | None) -> dict[str, Any]:
    """The input's files and every setting that makes a row's prompt."""
    part = {
        "path": _resolved(inp.path),
        "num_rows": num_input_rows,
        "files": input_fingerprint(inp.path, endpoint_url),
        **{name: getattr(inp, name) for name in PROMPT_SETTINGS},
    }
    if inp.format != "auto":
        part["format"] = inp.format
    return part


#: The ``[input]`` settings that make a row's prompt (or its candidates), recorded as they are.
PROMPT_SETTINGS = (
    "prompt_column",
    "prompt_ids_column",
    "id_column",
    "template",
    "mode",
    "candidates_column",
    "corruptions",
    "chat",
    "messages_column",
    "system_prompt",
    "per_row_settings",
    "boundary",
)


def _sampling_part(manifest, may_sample: bool, batch_invariant: bool) -> dict[str, Any]:
    """The job's sampling settings (the seed as ``job_seed``, the constraint in one spelling), and what decides a
    sampled row's draws: the sampler's version, batch invariance, the rank count, the structured-outputs engine."""
    sampling = asdict(manifest.sampling)
    sampling.pop("seed")
    # NOTE: the constraint only when set (earlier jobs keep their fingerprint), in one spelling (a schema as text
    # or as a table is one job)
    constraint = sampling.pop("structured_outputs")
    if constraint is not None:
        sampling["structured_outputs"] = manifest.sampling.structured_outputs.to_dict()
    part = {**sampling, "job_seed": manifest.seed, "n": manifest.n}
    engine = manifest.engine
    if may_sample:  # the random stream decides a sampled row's tokens, never a greedy row's
        part["sampler"] = SAMPLER_VERSION
        part["batch_invariant"] = batch_invariant
        # NOTE: a sampled row's logits differ in their last bits between rank counts (the all-reduce sums the
        # partial products in another order), so its draws can too; recorded only above 1 (earlier jobs unchanged)
        if engine.tensor_parallel_size > 1:
            part["tensor_parallel_size"] = engine.tensor_parallel_size
    if engine.structured_outputs_backend != "auto":  # which engine serves a schema decides its masks
        part["structured_outputs_backend"] = engine.structured_outputs_backend
    if engine.structured_outputs_ignore_formats:
        part["structured_outputs_ignore_formats"] = True
    return part


def _speculation_parts(engine) -> dict[str, Any]:
    """With speculation on, its settings (they decide which proposals a sampled row's verify steps draw against);
    with ``speculative = "draft"`` the draft model too (its proposals and q enter every sampled row's draws)."""
    if engine.speculative == "off":
        return {}
    parts: dict[str, Any] = {
        "speculative": {
            "mode": engine.speculative,
            "num_speculative_tokens": engine.num_speculative_tokens,
            "ngram_min": engine.ngram_min,
            "ngram_max": engine.ngram_max,
            "speculative_max_batch": engine.speculative_max_batch,
            "speculative_row_cost": engine.speculative_row_cost,
            "rule": SPECULATION_RULE_VERSION,
        }
    }
    if engine.speculative == "draft":
        draft = model_fingerprint(engine.draft_model)
        parts["draft_model"] = {
            "path": str(Path(engine.draft_model).resolve()),
            "files": draft["files"],
            "weights": draft["weights"],
        }
    return parts


#: Keys that job.json files written by earlier cbrun versions lack (this version records them) or hold (this version
#: no longer records them): such a key on one side only is not a difference, so those jobs still resume.
CHANGED_KEYS = frozenset(
    {"model.files", "model.weights", "input.files", "model.files_sha256", "sampling.batch_invariant"}
)


#: Keys derived from other settings: they differ only because a setting did, so they are named only when nothing
#: else is (a greedy job resumed at a temperature gains ``sampling.sampler``; the temperature is what changed).
DERIVED_KEYS = frozenset({"sampling.sampler", "sampling.batch_invariant"})


def fingerprint_differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted names of what differs between two fingerprints (a key that only one side has, too, except the
    ``CHANGED_KEYS`` of earlier versions; the ``DERIVED_KEYS`` only when nothing else differs)."""
    names = _differences(old, new, prefix)
    settings = [name for name in names if name not in DERIVED_KEYS]
    return settings or names


def _differences(old: dict, new: dict, prefix: str) -> list[str]:
    names = []
    for key in sorted(set(old) | set(new)):
        name = f"{prefix}{key}"
        if (key not in old or key not in new) and name in CHANGED_KEYS:
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            names += _differences(a, b, f"{name}.")
        elif a != b:
            names.append(name)
    return names
