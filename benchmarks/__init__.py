"""cbrun's benchmark scripts, run as ``python -m benchmarks.NAME`` from the repository root; not installed. The
``cbrun bench`` harness they share is ``cbrun.bench``. Nothing in cbrun's runtime packages imports either (``cbrun
bench`` loads ``cbrun.bench`` through its entry point when it is called)."""
