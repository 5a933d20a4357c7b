"""cbrun's continuous-batching inference engine.

Names are imported on first use, so ``import engine.config`` (the CLI's argument parsing, manifests) does not pay
for importing torch and transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EngineConfig": "cbrun.engine.config",
    "EngineStats": "cbrun.engine.core.stats",
    "LLMEngine": "cbrun.engine.llm_engine",
    "Request": "cbrun.engine.core.request",
    "RequestOutput": "cbrun.engine.outputs",
    "RequestStatus": "cbrun.engine.core.request",
    "SamplingParams": "cbrun.engine.sampling_params",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
