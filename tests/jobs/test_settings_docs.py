"""Every manifest setting has a description in its dataclass's docstring, and docs/manifest.md's settings tables are
the ones made from them (``python -m cbrun.jobs.config.settings_docs --write`` rewrites them)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cbrun.jobs.config.manifest import SECTIONS, manifest_from_dict
from cbrun.jobs.config.settings_docs import DOC, SECTION_SOURCES, document_with_tables, field_docs, section_fields


def test_every_setting_of_every_section_has_a_description():
    assert list(SECTION_SOURCES) == list(SECTIONS)
    undocumented = [f"{s}.{name}" for s in SECTIONS for name, _, doc in section_fields(s) if not doc]
    assert undocumented == []


def test_the_tables_list_keys_a_manifest_accepts_with_their_defaults():
    paths = {"model": {"path": "m"}, "input": {"path": "i", "prompt_column": "p"}, "output": {"path": "o"}}
    for section in SECTIONS:
        for name, default, _ in section_fields(section):
            if default is not None and name != "path":  # TOML has no null: an unset setting is left out
                manifest_from_dict({**paths, section: {**paths.get(section, {}), name: default}})
    with pytest.raises(ValueError, match="unknown setting engine.nonsense"):
        manifest_from_dict({**paths, "engine": {"nonsense": 1}})


def test_docs_manifest_holds_the_tables_made_from_the_docstrings():
    text = DOC.read_text()
    assert text == document_with_tables(text), "run: python -m cbrun.jobs.config.settings_docs --write"


def test_field_docs_reads_multi_name_entries_and_continuations_and_stops_at_the_next_section():
    @dataclass
    class Example:
        """An example.

        Attributes:
            a: the first,
                continued.
            b, c: shared | text.

        Raises:
            d: not a field.
        """

    assert field_docs(Example) == {"a": "the first, continued.", "b": "shared | text.", "c": "shared | text."}
