"""The random-weight models the benchmarks build: one helper, so each benchmark names only its config."""

from __future__ import annotations

from pathlib import Path


def saved_random_model(model_dir: Path, model_class: str, **config) -> Path:
    """A ``transformers.<model_class>`` of ``config``'s fields (and no special tokens unless ``config`` sets them),
    initialised from seed 0 and saved to ``model_dir`` (safetensors); a model already there is kept as it is."""
    if (model_dir / "config.json").is_file():
        return model_dir
    import torch
    import transformers

    model_type = getattr(transformers, model_class)
    config_class = getattr(transformers, model_class.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    fields = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None) | config
    model_type(config_class(**fields)).save_pretrained(model_dir)
    return model_dir
