"""Shared test fixtures.

Real model files live outside the repo, in ``shared/`` beside the repo root (stories260K: or under
``$CBRUN_SHARED``, e.g. from a git worktree elsewhere); they are read in place, never copied. Tests that need them
are skipped when that folder is absent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Triton kernels run in its CPU interpreter when no GPU is present; it must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The test models are tiny: one intra-op thread avoids OpenMP overhead and oversubscription on 2-core machines.
torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = REPO_ROOT.parent / "shared"  # the shipped manifests' relative ../shared paths resolve here
# llama2.c checkpoint, tokenizer and greedy goldens; $CBRUN_SHARED points elsewhere (e.g. from a git worktree).
STORIES260K = Path(os.environ.get("CBRUN_SHARED") or SHARED) / "models" / "stories260K"


def require_stories260k() -> Path:
    """Returns the stories260K folder, or skips the calling test when it is absent."""
    if not (STORIES260K / "stories260K.bin").is_file():
        pytest.skip(f"stories260K files not found under {STORIES260K} (expected ../shared beside the repo root)")
    return STORIES260K


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The ``shared/`` folder beside the repo root; skips when it is absent."""
    if not SHARED.is_dir():
        pytest.skip(f"shared folder not found: {SHARED}")
    return SHARED


@pytest.fixture(scope="session")
def stories260k_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """stories260K converted once per session to a transformers model directory (model and tokenizer)."""
    from cbrun.jobs.model.convert_llama2c import convert_llama2c

    src = require_stories260k()
    out = tmp_path_factory.mktemp("stories260K_hf")
    return convert_llama2c(src / "stories260K.bin", src / "tok512.bin", out)


@pytest.fixture(scope="session")
def reference_greedy() -> list[dict]:
    """llama2.c's greedy goldens for stories260K, one dict a line.

    Keys: prompt, prompt_token_ids (BOS first), max_positions, output_token_ids (ending with the stop token 1
    when llama2.c stopped on it), stdout_text.
    """
    path = require_stories260k() / "reference_greedy.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama (hidden 64, 2 layers, byte tokenizer, max length 256) built once per session."""
    from cbrun.jobs.cli.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("tiny_model") / "model")
