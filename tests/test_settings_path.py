"""A job's settings, followed from ``run_job`` through the calls that pass them on (``tests/settings_path.py``):
how many modules they visit and how often they come back to a module they had left (issue 41's measure), held
where they are so that they only go down."""

from __future__ import annotations

from tests.settings_path import settings_path

#: Where the measure stands (modules, returns); issue 41 asks for at most 12 and 8. Four of the modules are the
#: engine's (its load, and the batch-invariance check before it, which takes the dtype the job resolved once), the
#: rest the job's: its entry, its resolution, the manifest, the resources it opens (reader, tokenizer, engine), the
#: model's sampling defaults, the fingerprint, the run under the lock and the Ray executor.
MAX_MODULES = 12
MAX_RETURNS = 6


def test_the_settings_path_is_followed_through_the_job():
    trace, _, _ = settings_path()
    for module in ("cbrun.jobs.run.resolve", "cbrun.jobs.output.fingerprint", "cbrun.jobs.run.locked_run"):
        assert module in trace
    assert trace.index("cbrun.jobs.run.resolve") < trace.index("cbrun.jobs.output.fingerprint")


def test_the_settings_visit_few_modules_and_seldom_come_back():
    _, modules, returns = settings_path()
    assert modules <= MAX_MODULES and returns <= MAX_RETURNS, (modules, returns)
