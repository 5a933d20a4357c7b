"""Every manifest setting's description, read from its dataclass's docstring, and the settings tables of
docs/manifest.md made from them.

A setting is documented once, in the ``Attributes:`` section of its dataclass's Google-style docstring
(``ModelSettings`` ... ``StorageSettings``, ``SamplingParams``, ``EngineConfig`` and the job-level ``[sampling]``
keys of ``JobManifest``). ``tests/jobs/test_settings_docs.py`` checks that every field has one and that the tables
committed in docs/manifest.md are these; after changing a setting, rewrite them with::

    python -m cbrun.jobs.config.settings_docs --write
"""

from __future__ import annotations

import re
import sys
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.config.manifest import JobManifest
from cbrun.jobs.config.settings import ClusterSettings, InputSettings, ModelSettings, OutputSettings, StorageSettings

#: Each manifest section, the dataclasses its keys come from, and the fields of theirs it does not take.
SECTION_SOURCES: dict[str, list[tuple[type, set[str]]]] = {
    "model": [(ModelSettings, set())],
    "input": [(InputSettings, set())],
    # NOTE: [sampling] seed is the job seed (each row's derives from it), not SamplingParams.seed
    "sampling": [
        (SamplingParams, {"seed"}),
        (JobManifest, {"model", "input", "sampling", "engine", "output", "sampling_set", "cluster", "storage"}),
    ],
    "engine": [(EngineConfig, set())],
    "output": [(OutputSettings, set())],
    "cluster": [(ClusterSettings, set())],
    "storage": [(StorageSettings, set())],
}
#: What the manifest's own defaults replace (``cbrun.jobs.config.manifest.manifest_from_dict``).
MANIFEST_DEFAULTS = {("engine", "device"): "auto"}
BEGIN = "<!-- settings tables: made by `python -m cbrun.jobs.config.settings_docs --write` from the settings' docstrings -->"
END = "<!-- end of the settings tables -->"
DOC = Path(__file__).resolve().parents[3] / "docs" / "manifest.md"

_ENTRY = re.compile(r"^(?P<names>[a-z_][a-z0-9_]*(?:, [a-z_][a-z0-9_]*)*): (?P<text>.*)$")


def field_docs(cls: type) -> dict[str, str]:
    """The description of each field in the ``Attributes:`` section of ``cls``'s docstring, as one line each.

    An entry may name several fields (``ngram_min, ngram_max: ...``); each gets the entry's text. Entries start at
    the section's first indent; deeper lines continue the entry above.
    """
    lines = (cls.__doc__ or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Attributes:"), None)
    if start is None:
        return {}
    docs: dict[str, list[str]] = {}
    current: list[str] = []
    indent = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        if depth < indent:  # the section ended (Raises:, ...)
            break
        entry = _ENTRY.match(line.strip()) if depth == indent else None
        if entry:
            current = [entry["text"]]
            for name in entry["names"].split(", "):
                docs[name] = current
        else:
            current.append(line.strip())
    return {name: " ".join(parts) for name, parts in docs.items()}


def section_fields(section: str) -> list[tuple[str, Any, str | None]]:
    """(name, default, description or None) of every key ``[section]`` takes, in the dataclasses' order."""
    rows = []
    for cls, skipped in SECTION_SOURCES[section]:
        docs = field_docs(cls)
        for f in fields(cls):
            if f.name not in skipped and f.init:  # NOTE: a field the job sets (init=False) is no setting
                default = MANIFEST_DEFAULTS.get((section, f.name), _default(f))
                rows.append((f.name, default, docs.get(f.name)))
    return rows


def _default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    assert f.default_factory is not MISSING, f"{f.name} has no default"
    return f.default_factory()


def _toml(value: Any) -> str:
    """A default as a manifest would write it; unset for None."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, list | tuple):
        return "`[]`" if not value else f"`{list(value)!r}`"
    return f"`{value!r}`"


def settings_tables() -> str:
    """The Markdown tables of every section's settings, between the ``BEGIN`` and ``END`` markers."""
    out = [BEGIN, ""]
    for section in SECTION_SOURCES:
        out += [f"### [{section}]", "", "| setting | default | meaning |", "|---|---|---|"]
        for name, default, doc in section_fields(section):
            text = (doc or "").replace("|", "\\|")
            out.append(f"| `{name}` | {_toml(default)} | {text} |")
        out.append("")
    return "\n".join(out + [END])


def document_with_tables(text: str) -> str:
    """``text`` (docs/manifest.md) with its settings tables replaced by ``settings_tables()``.

    Raises:
        ValueError: when the text lacks the ``BEGIN`` / ``END`` markers.
    """
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin:
        raise ValueError(f"{DOC} has no settings tables between {BEGIN!r} and {END!r}")
    return text[:begin] + settings_tables() + text[end + len(END) :]


def main(argv: list[str]) -> int:
    """``--write``: rewrite docs/manifest.md's tables; without it, print them. Returns the exit code."""
    if argv == ["--write"]:
        DOC.write_text(document_with_tables(DOC.read_text()))
        return 0
    print(settings_tables())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
