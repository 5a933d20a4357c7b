"""``python -m cbrun.bench ARGS`` is ``cbrun bench ARGS``."""

import sys

from cbrun.bench.cli import main

sys.exit(main())
