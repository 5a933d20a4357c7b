"""cbrun's benchmarks: ``cbrun_bench`` (the ``cbrun bench`` command) and scripts run as ``python -m benchmarks.NAME``
from the repository root. Not part of the runtime: nothing in engine/, jobs/ or kernels/ imports them (``cbrun
bench`` imports ``cbrun_bench`` when it is called)."""
