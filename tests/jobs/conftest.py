"""Fixtures shared by the job tests: one tiny engine per test module, and a manifest factory.

A module that uses them sets ``ENGINE_CONFIG`` (an ``EngineConfig``) and may set ``MANIFEST_DEFAULTS``: keyword
defaults of ``make_manifest`` (``sampling``, ``seed``, ``n``, ``commit_every_rows`` and ``[input]`` settings).
"""

from __future__ import annotations

import pytest

from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.config.manifest import JobManifest
from cbrun.jobs.config.settings import InputSettings, ModelSettings, OutputSettings
from tests.jobs.s3_server import _moto_server, s3  # noqa: F401 - the object-store tests' S3 server fixtures

_PROMPT_SOURCES = ("prompt_column", "prompt_ids_column", "template", "messages_column")


@pytest.fixture(scope="module")
def tiny_engine(request, tiny_model_dir):
    """An ``LLMEngine`` over the tiny random-weight model with the test module's ``ENGINE_CONFIG``."""
    from cbrun.engine import LLMEngine

    return LLMEngine.from_pretrained(str(tiny_model_dir), request.module.ENGINE_CONFIG)


@pytest.fixture
def make_manifest(request):
    """``make_manifest(model_dir, input_path, output_dir, **settings) -> JobManifest``.

    ``settings``: ``sampling`` (a ``SamplingParams``), ``seed``, ``n``, ``commit_every_rows``; the rest are
    ``[input]`` settings (``prompt_column="prompt"`` unless another prompt source is given). Unset ones come from
    the module's ``MANIFEST_DEFAULTS``; the engine is the module's ``ENGINE_CONFIG``.
    """
    defaults = getattr(request.module, "MANIFEST_DEFAULTS", {})

    def make(model_dir, input_path, output_dir, **settings) -> JobManifest:
        settings = {**defaults, **settings}
        sampling = settings.pop("sampling", SamplingParams())
        seed, n = settings.pop("seed", 0), settings.pop("n", 1)
        commit_every_rows = settings.pop("commit_every_rows", 1000)
        if not any(settings.get(name) is not None for name in _PROMPT_SOURCES) and "prompt_column" not in settings:
            settings["prompt_column"] = "prompt"
        return JobManifest(
            model=ModelSettings(path=str(model_dir)),
            input=InputSettings(path=str(input_path), **settings),
            sampling=sampling,
            seed=seed,
            n=n,
            engine=request.module.ENGINE_CONFIG,
            output=OutputSettings(path=str(output_dir), commit_every_rows=commit_every_rows),
        )

    return make


#: A simple chat template for the tiny byte-tokenizer model (saved with it: nothing is downloaded).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """The tiny demo model, its byte tokenizer given ``CHAT_TEMPLATE``, built once per session."""
    from transformers import AutoTokenizer

    from cbrun.jobs.cli.demo import build_demo_model

    path = build_demo_model(tmp_path_factory.mktemp("chat_model") / "model")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path
