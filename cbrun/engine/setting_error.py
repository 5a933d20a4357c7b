"""``SettingError``: a bad setting value, whose message names the settings as the engine's Python API spells them
(``top_p``) or, for a job manifest, with their section (``sampling.top_p``)."""

from __future__ import annotations

import functools
from typing import Any


class SettingError(ValueError):
    """A setting's bad value, raised by ``EngineConfig`` and ``SamplingParams``.

    The message is a ``str.format`` template whose fields are setting names, except those given in ``values``:
    ``SettingError("{top_p} must be in (0, 1], got {value!r}", value=2)`` reads ``top_p must be in (0, 1], got 2``
    (``str``, for the Python API, where there is no section) and ``sampling.top_p must be in (0, 1], got 2``
    (``in_section("sampling")``, what a job says of its manifest, ``--set`` and flags).

    Args:
        template: the message; a field not in ``values`` is a setting's name. Literal braces are doubled.
        values: the template's other fields (the value given, a bound, ...).
    """

    def __init__(self, template: str, /, **values: Any) -> None:
        self.template = template
        self.values = values
        super().__init__(self.in_section(None))

    def in_section(self, section: str | None) -> str:
        """The message with each setting named ``SECTION.NAME`` (just ``NAME`` for None)."""
        return self.template.format_map(_Fields(self.values, section))

    def __reduce__(self):
        # NOTE: rebuilt from the template (the default would pass the finished message as the template)
        return functools.partial(type(self), self.template, **self.values), ()


def must_be(name: str, expected: str, value: Any) -> SettingError:
    """``NAME must be EXPECTED, got VALUE``, for setting ``name``; a boolean value shown as TOML and JSON write it
    (``true``), the others as Python's ``repr``."""
    shown = str(value).lower() if isinstance(value, bool) else repr(value)
    return SettingError("{" + name + "} must be {expected}, got {value}", expected=expected, value=shown)


class _Fields(dict):
    """A template's fields: ``values``, and any other field a setting name, qualified by ``section``."""

    def __init__(self, values: dict[str, Any], section: str | None) -> None:
        super().__init__(values)
        self.section = section

    def __missing__(self, name: str) -> str:
        return name if self.section is None else f"{self.section}.{name}"
