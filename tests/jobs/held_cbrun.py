"""``python -m tests.jobs.held_cbrun HOLD_AFTER ARGS...``: ``cbrun ARGS...`` whose engine, once it has handed out
HOLD_AFTER outputs, holds until a stop signal ends the job.

The SIGTERM test needs a job that is still running when the signal arrives, on any machine: the hold makes that
true by construction (the job cannot finish on its own), where a sleep between start and signal only makes it
likely. The hold prints ``held after N outputs`` on stderr, so the test signals once it is in place.
"""

from __future__ import annotations

import sys
import time

from cbrun.engine.llm_engine import LLMEngine
from cbrun.jobs.cli import main

HELD_LINE = "held after {} outputs"


def hold_after(num_outputs: int) -> None:
    """Make ``LLMEngine.generate`` wait (sleeping, so a signal's handler runs) after ``num_outputs`` outputs."""
    generate = LLMEngine.generate

    def held_generate(self, *args, **kwargs):
        for count, output in enumerate(generate(self, *args, **kwargs), start=1):
            yield output
            if count == num_outputs:
                print(HELD_LINE.format(count), file=sys.stderr, flush=True)
                while True:  # until a stop signal raises Interrupted here
                    time.sleep(0.01)

    LLMEngine.generate = held_generate


if __name__ == "__main__":
    hold_after(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
