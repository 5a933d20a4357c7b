"""Sampling defaults from the model: the settings a job did not give, taken from the model's
generation_config.json (``model_sampling_defaults``, taken by ``cbrun.jobs.run.resolve`` before the fingerprint).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.config.manifest import JobManifest

logger = logging.getLogger("cbrun.job")

#: generation_config.json keys taken as sampling defaults when the job does not set them (vLLM's
#: ``get_diff_sampling_param`` list). The last four are not taken when the file says ``do_sample = false``.
MODEL_DEFAULT_KEYS = ("max_new_tokens", "repetition_penalty", "temperature", "top_p", "top_k", "min_p")
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")


def model_sampling_defaults(manifest: JobManifest) -> tuple[SamplingParams, dict[str, Any]]:
    """Take the sampling settings the job did not set from the model's generation_config.json, as transformers'
    ``generate`` and vLLM (``generation_config = "auto"``) do.

    Only keys written in the file count (``MODEL_DEFAULT_KEYS``; transformers' own defaults are not read). When
    the file says ``do_sample = false``, the sampling keys (temperature, top_p, top_k, min_p) are not taken: the
    model is meant to be decoded greedily, as ``generate`` would. Nothing is taken with ``model_defaults = false``.

    Args:
        manifest: the job, its ``model.path`` the model's folder on this machine; not changed.

    Returns:
        The job's sampling settings with the defaults taken, and {setting: value} of what was taken (logged once).

    Raises:
        ValueError: when a taken value is out of range, naming the file.
    """
    path = Path(manifest.model.path) / "generation_config.json"
    if not manifest.model_defaults or not path.is_file():
        return manifest.sampling, {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc}") from None
    skip = set(manifest.sampling_set)
    if config.get("do_sample") is False:
        skip.update(_SAMPLING_KEYS)
    taken = {key: config[key] for key in MODEL_DEFAULT_KEYS if key not in skip and config.get(key) is not None}
    if not taken:
        return manifest.sampling, {}
    sampling = manifest.sampling.replace(**taken)
    try:
        sampling.validate()
    except ValueError as exc:
        raise ValueError(f"{str(path)!r}: {exc} (set it in [sampling], or sampling.model_defaults = false)") from None
    logger.info(
        "sampling defaults from %s: %s (set them in [sampling] to change; sampling.model_defaults = false "
        "ignores the file)",
        path,
        ", ".join(f"{k} = {v!r}" for k, v in taken.items()),
    )
    return sampling, taken
