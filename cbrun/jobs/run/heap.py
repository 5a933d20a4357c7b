"""Keep the garbage collector off the objects that imports and loading create: paused during a job's setup,
frozen out of its generation phase.

By the time a job generates, the process holds about 400k objects the collector tracks, nearly all of them from
importing torch and transformers, plus the model. None of them becomes garbage while the job runs, yet every
full (oldest-generation) collection walks them all: 0.26 s for the one that fell inside generation on the
gsm8k-long benchmark (256 rows, 2-core machine under load; ``benchmarks/results-startup.md``). ``frozen_heap``
moves them into CPython's permanent generation (``gc.freeze``) for the generation phase and back afterwards
(``gc.unfreeze``), so collections during generation only see what generation allocates; nothing is leaked (the
same objects are collectable again once the phase ends). vLLM freezes its heap the same way after warm-up
(``freeze_gc_heap``), SGLang after startup (``freeze_gc``).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """For the ``with`` block (a job's generation phase): every object the collector tracks now frozen, and the
    collector on, even when the setup before it ran with collection paused (``collection_paused``); afterwards
    the objects unfrozen and the collector as it was.

    A process that already keeps objects in the permanent generation (``gc.get_freeze_count() > 0``, e.g. a server
    that froze its own heap before forking) manages it itself: then nothing is frozen or unfrozen here, so as never
    to unfreeze what its owner froze.
    """
    freeze = not gc.get_freeze_count()
    was_enabled = gc.isenabled()
    if freeze:
        gc.freeze()
    gc.enable()
    try:
        yield
    finally:
        if not was_enabled:
            gc.disable()
        if freeze:
            gc.unfreeze()


@contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic garbage collection inside the ``with`` block (``gc.disable``); the collector's state before it
    is restored after.

    For the import-heavy setup of a job: importing torch and transformers creates ~400k objects, and the young
    generations' collections it triggers promote them until full collections walk them all, again and again:
    about a second of collector time before the first row on the gsm8k-long benchmark (6 full collections,
    ``benchmarks/results-startup.md``). Import garbage is small; reference counting still frees everything that
    is not in a cycle.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
