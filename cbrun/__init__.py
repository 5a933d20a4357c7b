"""cbrun: offline batch LLM inference jobs over a continuous-batching engine.

One import name: ``cbrun.jobs`` (rows and files, the CLI), ``cbrun.engine`` (scheduling, paged KV cache, model
runner, sampling), ``cbrun.kernels`` (Triton, C and PyTorch reference kernels) and ``cbrun.bench`` (the harness
behind ``cbrun bench``). Importing ``cbrun`` imports none of them.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("cbrun")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"
