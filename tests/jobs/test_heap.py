"""cbrun.jobs.run.heap: the collector paused for a job's setup, the setup's objects frozen out of its generation phase."""

from __future__ import annotations

import gc

import pytest

from cbrun.jobs.run.heap import collection_paused, frozen_heap


@pytest.fixture(autouse=True)
def collector_restored():
    """Each test starts with the collector on and nothing frozen, and leaves it so."""
    was_enabled = gc.isenabled()
    gc.unfreeze()
    gc.enable()
    yield
    gc.unfreeze()
    if not was_enabled:
        gc.disable()


def is_frozen(obj) -> bool:
    """Whether ``obj`` (a tracked container) is in the permanent generation: ``gc.get_objects`` skips that one."""
    assert gc.is_tracked(obj)
    return not any(o is obj for o in gc.get_objects())


def test_frozen_heap_freezes_what_exists_turns_the_collector_on_and_restores_both():
    before = []
    gc.disable()  # as a setup under collection_paused leaves it
    with frozen_heap():
        assert gc.isenabled()
        made_inside = []
        assert is_frozen(before) and not is_frozen(made_inside)  # only what existed before the block
    assert not gc.isenabled()
    assert gc.get_freeze_count() == 0 and not is_frozen(before)


def test_frozen_heap_leaves_a_heap_frozen_by_someone_else_alone():
    owners = []
    gc.freeze()
    made_after = []
    with frozen_heap():
        assert not is_frozen(made_after)  # nothing more is frozen here
    assert is_frozen(owners)  # not unfrozen: its owner froze it
    assert not is_frozen(made_after)


def test_frozen_heap_unfreezes_when_the_block_raises():
    with pytest.raises(KeyboardInterrupt), frozen_heap():
        raise KeyboardInterrupt
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_collection_paused_disables_the_collector_and_restores_its_state():
    with collection_paused():
        assert not gc.isenabled()
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block restores the outer one's state, paused
    assert gc.isenabled()
    gc.disable()
    with collection_paused():
        pass
    assert not gc.isenabled()  # it was off before: it stays off
