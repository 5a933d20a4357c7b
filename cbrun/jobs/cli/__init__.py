"""The ``cbrun`` command: ``main`` (``commands``), the parser (``parser``), flag values (``values``), the demo."""

from cbrun.jobs.cli.commands import main

__all__ = ["main"]
