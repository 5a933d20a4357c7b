"""Values given on the command line: ``--set SECTION.KEY=VALUE`` assignments (``parse_set``) and text read with
TOML's escapes (``cli_text``).

Text given on the command line (``--template``, ``--stop``, and a ``--set`` value that is not a TOML value) is read
like the inside of a manifest's double-quoted TOML string: ``\\n`` is a newline, ``\\t`` a tab, ``\\\\`` a
backslash, ``\\"`` a quote, ``\\uXXXX`` a character (``cli_text``). So ``--template 'Q: {q}\\nA:'`` and
``template = "Q: {q}\\nA:"`` give the same prompt.
"""

from __future__ import annotations

import tomllib
from typing import Any


def parse_set(assignment: str) -> tuple[str, str, Any]:
    """Parse one ``SECTION.KEY=VALUE``; VALUE is read as a TOML value, else taken as text with TOML's escapes
    (``cli_text``).

    Returns:
        (section, key, value).

    Raises:
        ValueError: when the assignment is not of the form SECTION.KEY=VALUE, or has a bad escape.
    """
    name, sep, raw = assignment.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ValueError(f"--set expects SECTION.KEY=VALUE (e.g. sampling.temperature=0.7), got {assignment!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = cli_text(raw)
    return section, key, value


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "\\": "\\", '"': '"', "e": "\x1b"}


def cli_text(text: str) -> str:
    """Text from the command line read with TOML's basic-string escapes, as a manifest's "..." string is.

    ``\\n`` \\t \\r \\b \\f \\e \\\\ \\" \\uXXXX \\UXXXXXXXX are replaced; any other backslash is an error (as in TOML),
    so a mistyped escape is not silently kept.

    Raises:
        ValueError: for an unknown or incomplete escape, naming it.
    """
    out, i = [], 0
    while i < len(text):
        char = text[i]
        if char != "\\":
            out.append(char)
            i += 1
            continue
        code = text[i + 1 : i + 2]
        if code in _ESCAPES:
            out.append(_ESCAPES[code])
            i += 2
        elif code in ("u", "U"):
            width = 4 if code == "u" else 8
            digits = text[i + 2 : i + 2 + width]
            if len(digits) != width or any(c not in "0123456789abcdefABCDEF" for c in digits):
                raise ValueError(f"bad escape \\{code}{digits} in {text!r}: \\{code} takes {width} hex digits")
            out.append(chr(int(digits, 16)))
            i += 2 + width
        else:
            raise ValueError(
                f"unknown escape \\{code} in {text!r}: command-line text takes TOML's escapes "
                f'(\\n, \\t, \\\\, \\", \\uXXXX); write \\\\ for a backslash'
            )
    return "".join(out)
