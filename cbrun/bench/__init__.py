"""``cbrun bench``: workloads run through cbrun and transformers backends, measured alike, reported side by side.

Modules: ``workloads`` (the rows), ``backends`` (how each backend runs them), ``measure`` (clocks, memory, FLOPs),
``report`` (records, the table of median runs), ``overhead`` (host time per engine step), ``cli`` (the command).
Run it as ``cbrun bench ...`` or ``python -m cbrun.bench ...`` from the repository root.
"""
