"""SIGINT and SIGTERM stop a job the same way: stop admitting rows, commit the finished ones, say so, exit 128 + N.

SIGTERM is what ``timeout``, systemd, Slurm and Kubernetes send before they kill. The first signal raises
``Interrupted`` wherever the main thread is: the engine's requests are aborted, the job commits its finished rows
(``PartWriter.commit`` is safe to rerun after an interrupt at any line) and the CLI prints what happened. Later
signals, while the job winds down, only print a note: they cannot cut the final commit short (SIGKILL still can;
the rows it loses are recomputed on resume).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived. A ``KeyboardInterrupt``, so every cleanup path treats it like Ctrl-C.

    Attributes:
        signum: the signal's number.
    """

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as shells report a process a signal ended: 130 SIGINT, 143 SIGTERM."""
        return 128 + self.signum


@contextmanager
def interrupt_on_stop_signals() -> Iterator[None]:
    """Within the block, the first SIGINT or SIGTERM raises ``Interrupted``; the previous handlers come back after.

    A no-op outside the main thread (Python delivers signals to the main thread only).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def handler(signum, frame):
        nonlocal raised
        if raised:
            print(
                f"cbrun: {signal.Signals(signum).name} again: still committing the finished rows (SIGKILL stops at "
                f"once; rows it loses are recomputed on resume)",
                file=sys.stderr,
            )
            return
        raised = True
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
