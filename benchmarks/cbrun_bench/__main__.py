"""``python -m benchmarks.cbrun_bench ARGS`` is ``cbrun bench ARGS``."""

import sys

from benchmarks.cbrun_bench.cli import main

sys.exit(main())
