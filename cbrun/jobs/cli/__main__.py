"""``python -m cbrun.jobs.cli``: the ``cbrun`` command."""

import sys

from cbrun.jobs.cli.commands import main

sys.exit(main())
