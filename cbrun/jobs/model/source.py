"""Where a job's model comes from: a local directory, an object-store URI, or a Hugging Face Hub repo id.

``resolve_model`` decides which, once, where ``model.path`` enters the job, and returns a ``ModelSource``: the
directory on this machine that every later step reads (config, tokenizer, weights), and for a Hub id the commit sha
the revision resolved to. The rule (vLLM's and transformers' too): an existing local path is a directory; an
object-store URI is copied by ``cbrun.jobs.store.cache``; anything else of the form ``ORG/NAME`` is a Hub repo id.

A Hub model is read from the Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``: the ``models--ORG--NAME/{blobs,refs,snapshots}`` layout) through
``huggingface_hub.snapshot_download``, limited to the files cbrun reads (``HUB_PATTERNS``). A commit sha is looked up
in the cache before the Hub is asked; a branch or tag is resolved by the Hub when it can be reached (so ``main``
means the newest commit), else from the cache's ``refs/``. ``HF_HUB_OFFLINE=1`` never goes online. A download shows
huggingface_hub's progress bars and resumes where an interrupted one stopped; ``HF_TOKEN`` (or a stored login) is
sent for gated and private repos by huggingface_hub itself, and cbrun never logs or records it.

NOTE: huggingface_hub reads ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` once, at import; cbrun reads them at each
resolution (``hub_cache_dir``, ``hub_offline``) and passes them explicitly, so the job's environment is the one
that counts.
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cbrun.jobs.output.fingerprint import MODEL_FILES
from cbrun.jobs.store.cache import local_model
from cbrun.jobs.store.files import is_uri

logger = logging.getLogger("cbrun")

#: The files of a Hub repo that cbrun reads (``huggingface_hub`` fnmatch patterns; ``*`` matches ``/`` too): the
#: files the fingerprint hashes whole (but the index of ``.bin`` weights, which cbrun does not download), the extra
#: chat templates, and the safetensors weights.
HUB_PATTERNS = (
    *(name for name in MODEL_FILES if name != "pytorch_model.bin.index.json"),
    "additional_chat_templates/*.jinja",
    "*.safetensors",
)
#: NOTE: the loader reads the top folder's weights only; some repos carry a second copy in a subfolder
#: (``original/``, ``metal/``), which would double the download.
HUB_IGNORED = ("*/*.safetensors",)
DEFAULT_REVISION = "main"
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_REPO_ID_RE = re.compile(r"[\w.-]+/[\w.-]+")
_TRUE = ("1", "ON", "YES", "TRUE")


class ModelSourceError(ValueError):
    """The model cannot be found or fetched; the message says what to change (the job exits 2, before any work)."""


@dataclass(frozen=True)
class ModelSource:
    """A job's model as named and as found on this machine.

    Attributes:
        name: ``model.path`` as given: a directory, an object-store URI or a Hub repo id.
        local_path: the directory on this machine holding config.json, the tokenizer files and the weights.
        repo_id: the Hub repo id (``ORG/NAME``); None for a directory or a URI.
        revision: Hub models: the revision asked for (branch, tag or commit; ``main`` when none was given).
        commit: Hub models: the 40-hex commit sha ``revision`` resolved to; the job runs this commit throughout.
    """

    name: str
    local_path: str
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None

    @property
    def display_name(self) -> str:
        """The model's name in outputs (an OpenAI batch line's ``model``): the repo id, else the folder's name."""
        return self.repo_id or Path(self.name.rstrip("/")).name

    def fingerprint_fields(self) -> dict[str, str]:
        """What the job's fingerprint records of a Hub model (``cbrun.jobs.output.fingerprint``): the repo id as its
        path (not this machine's cache folder), the revision asked for and the commit; {} for other sources."""
        if self.repo_id is None:
            return {}
        return {"path": self.repo_id, "revision": self.revision, "commit": self.commit}


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is read as a Hub repo id: ``ORG/NAME``, not an existing path, not a URI, not written as a
    path (``/``, ``./``, ``../``, ``~``)."""
    if is_uri(name) or name.startswith(("/", "./", "../", "~")) or Path(name).exists():
        return False
    return _REPO_ID_RE.fullmatch(name) is not None and ".." not in name and "--" not in name


def hub_cache_dir() -> Path:
    """The Hugging Face cache folder, as huggingface_hub picks it: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub`` (default ``~/.cache/huggingface/hub``), read now from the environment."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids network calls (``1``, ``ON``, ``YES``, ``TRUE``), read now."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


def resolve_model(
    name: str,
    revision: str | None = None,
    *,
    pinned_commit: str | None = None,
    progress: bool = True,
    endpoint_url: str | None = None,
) -> ModelSource:
    """Find the model ``name`` names on this machine, downloading a Hub model's files when the cache lacks them.

    Args:
        name: ``model.path``: a local directory, an object-store URI, or a Hub repo id (``is_hub_id``).
        revision: ``model.revision``: a branch, tag or commit sha of a Hub repo; None is ``main``.
        pinned_commit: the commit this job started at (a resume, another shard): used instead of resolving
            ``revision`` again, so one output never mixes two commits.
        progress: show huggingface_hub's download progress bars.
        endpoint_url: an object-store model's S3 endpoint (the job's ``[storage] endpoint_url``).

    Returns:
        The ``ModelSource``; a local directory is returned as given (its checks come later, in
        ``cbrun.jobs.run.resources.check_model_dir``).

    Raises:
        ModelSourceError: a revision given for a directory or URI; a Hub model not in the cache while offline, no
            such repo, a gated or private repo without a token, a revision that does not exist, a repo with no
            safetensors weights.
        FileNotFoundError, StorageError: an object-store URI with no objects, or a failed download
            (``storage_cache.local_model``).
    """
    if not is_hub_id(name):
        if revision is not None:
            raise ModelSourceError(
                f"model.revision = {revision!r} names a revision of a Hugging Face Hub repo, but model.path "
                f"{name!r} is a {'URI' if is_uri(name) else 'local directory'}; drop --revision, or give a Hub "
                f"id (ORG/NAME)"
            )
        return ModelSource(name=name, local_path=local_model(name, endpoint_url))
    return resolve_hub_model(name, revision, pinned_commit=pinned_commit, progress=progress)


def resolve_hub_model(
    repo_id: str, revision: str | None = None, *, pinned_commit: str | None = None, progress: bool = True
) -> ModelSource:
    """A Hub repo's files at one commit, from the cache or downloaded into it (see the module docstring).

    Args and Raises: as ``resolve_model``.
    """
    revision = revision or DEFAULT_REVISION
    wanted = pinned_commit or revision
    cache, offline = hub_cache_dir(), hub_offline()
    try:
        path = _cached_snapshot(repo_id, wanted, cache) if _COMMIT_RE.fullmatch(wanted) else None
        if path is None:
            path = _snapshot(repo_id, wanted, cache, local_files_only=offline, progress=progress)
    except Exception as exc:  # NOTE: huggingface_hub's errors, mapped to what the user can do about them
        message = _hub_error_message(exc, repo_id, revision, pinned_commit, cache, offline)
        if message is None:
            raise
        raise ModelSourceError(message) from None
    local = Path(path)
    source = ModelSource(name=repo_id, local_path=str(local), repo_id=repo_id, revision=revision, commit=local.name)
    if not any(local.glob("*.safetensors")):
        raise ModelSourceError(
            f"model {repo_id!r} at commit {source.commit} has no *.safetensors weights in its top folder; cbrun "
            f"reads safetensors from the Hub: give a repo (or revision) with them, or a local model directory"
        )
    pinned = f", pinned when the job started (revision {revision!r})" if pinned_commit else ""
    logger.info("model %s at commit %s%s, from %s", repo_id, source.commit, pinned, local)
    return source


def recorded_commit(recorded: dict | None, repo_id: str, revision: str | None) -> str | None:
    """The commit a job's recorded fingerprint (``_cbrun/job.json``) pins ``repo_id`` at, when that job asked for
    the same revision; None otherwise (another model or revision: the fingerprint check then names the change)."""
    model = (recorded or {}).get("model") or {}
    if model.get("path") != repo_id or model.get("revision") != (revision or DEFAULT_REVISION):
        return None
    commit = model.get("commit")
    return commit if isinstance(commit, str) and _COMMIT_RE.fullmatch(commit) else None


def worker_model_path(source: ModelSource | None, path: str, endpoint_url: str | None = None) -> str:
    """The model directory on a worker (a Ray replica) given the driver's ``ModelSource`` and ``model.path``: the
    driver's folder when this machine has it; else a Hub model's commit the driver resolved, from this machine's
    cache (downloaded when missing), or a URI's copy in this machine's ``$CBRUN_CACHE``.

    Raises:
        ModelSourceError: as ``resolve_hub_model``.
    """
    if source is None or Path(source.local_path, "config.json").is_file():
        return path
    if source.repo_id is not None:
        return resolve_hub_model(
            source.repo_id, source.revision, pinned_commit=source.commit, progress=False
        ).local_path
    return local_model(source.name, endpoint_url) if is_uri(source.name) else path


def recorded_model_path(model: dict) -> str:
    """The local directory of a job's recorded model (the ``model`` of ``_cbrun/job.json``): its path, or for a Hub
    model its recorded commit from the cache (downloaded when missing and online).

    Raises:
        ModelSourceError: as ``resolve_hub_model``.
    """
    path, commit = model.get("path", ""), model.get("commit")
    if commit is None:
        return path
    return resolve_hub_model(path, model.get("revision"), pinned_commit=commit, progress=False).local_path


def _repo_folder(repo_id: str, cache: Path) -> Path:
    """``models--ORG--NAME`` in the cache (huggingface_hub's ``repo_folder_name``)."""
    return cache / ("models--" + repo_id.replace("/", "--"))


def _cached_snapshot(repo_id: str, commit: str, cache: Path) -> str | None:
    """The cached snapshot of a commit, without a network call; None when the cache lacks it or holds part of it
    (then the caller downloads it, or reports why it cannot)."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return _snapshot(repo_id, commit, cache, local_files_only=True, progress=False)
    except LocalEntryNotFoundError:
        return None


def _snapshot(repo_id: str, revision: str, cache: Path, *, local_files_only: bool, progress: bool) -> str:
    from huggingface_hub import snapshot_download

    with _progress_bars(progress):
        return snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=local_files_only,
            allow_patterns=list(HUB_PATTERNS),
            ignore_patterns=list(HUB_IGNORED),
            library_name="cbrun",
        )


@contextmanager
def _progress_bars(show: bool):
    """huggingface_hub's progress bars off for the call when ``show`` is false (``--no-progress``)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hide = not show and not are_progress_bars_disabled()
    if hide:
        disable_progress_bars()
    try:
        yield
    finally:
        if hide:
            enable_progress_bars()


def _hub_error_message(
    exc: Exception, repo_id: str, revision: str, pinned: str | None, cache: Path, offline: bool
) -> str | None:
    """What to tell the user about a huggingface_hub error; None for an error that is not one of these (raised)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"model {repo_id!r} at commit {pinned} (pinned when the job started at revision {revision!r})"
    if pinned is None:
        what = f"model {repo_id!r} at revision {revision!r}"
    restart = "; or rerun with --overwrite to start the job over at the revision's newest commit" if pinned else ""
    # NOTE: "unset HF_HUB_OFFLINE" only where it is set; without it, the way to fill the cache from a machine that
    # reaches the Hub.
    fill = (
        "download it once with network access (unset HF_HUB_OFFLINE)"
        if offline
        else f"fill {cache} where the Hub can be reached (hf download {repo_id} --revision {pinned or revision} "
        f"--cache-dir {cache}) and copy it here"
    )
    if isinstance(exc, IncompleteSnapshotError):
        return (
            f"{what}: the cached snapshot in {exc.snapshot_path} is incomplete (an interrupted download); "
            f"{fill} to complete it"
        )
    if isinstance(exc, LocalEntryNotFoundError):
        return _not_in_cache_message(what, repo_id, pinned, cache, offline, fill) + restart
    if isinstance(exc, GatedRepoError):
        return (
            f"model {repo_id!r} is gated on the Hugging Face Hub: accept its terms on its page "
            f"(https://huggingface.co/{repo_id}), then set HF_TOKEN to a token of that account"
        )
    if isinstance(exc, RevisionNotFoundError):
        return f"model {repo_id!r} has no revision {pinned or revision!r} (branch, tag or commit) on the Hub{restart}"
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"no local directory {repo_id!r}, and no model repository {repo_id!r} on the Hugging Face Hub (a private "
            f"repo needs HF_TOKEN set to a token that can read it)"
        )
    if isinstance(exc, HFValidationError):
        return f"model.path {repo_id!r} is neither a local directory nor a valid Hub repo id: {exc}"
    return None


def _not_in_cache_message(what: str, repo_id: str, pinned: str | None, cache: Path, offline: bool, fill: str) -> str:
    """The model is not in the cache and cannot be downloaded: offline, or the Hub out of reach (``fill``: how to
    fill the cache)."""
    if offline:
        reason = "HF_HUB_OFFLINE=1 forbids downloading it"
    else:
        reason = "the Hugging Face Hub could not be reached (HF_HUB_OFFLINE is not set)"
    held = _cached_revisions(_repo_folder(repo_id, cache))
    found = f" (it holds {repo_id!r} at {held})" if held else ""
    # A mistyped relative folder ("models/nope") is also a valid repo id: say that neither was found.
    local = "" if pinned else f"there is no local directory {repo_id!r} (in {Path.cwd()}), and "
    return (
        f"{local}{what} is not in the Hugging Face cache at {cache}{found}, and {reason}; {fill}, point HF_HOME or "
        f"HF_HUB_CACHE at the cache that holds it, or give a local model directory"
    )


def _cached_revisions(folder: Path) -> str:
    """The refs and snapshots a cached repo holds, for an error message ("" when none)."""
    refs = sorted(p.relative_to(folder / "refs").as_posix() for p in (folder / "refs").rglob("*") if p.is_file())
    snapshots = sorted(p.name for p in (folder / "snapshots").glob("*") if p.is_dir())
    parts = [f"refs {', '.join(refs)}" if refs else "", f"commits {', '.join(snapshots)}" if snapshots else ""]
    return "; ".join(p for p in parts if p)
