"""``python -m bcg_core`` is the ``bcg`` command (useful where the package is not installed)."""

import sys

from bcg_core.bench import main

sys.exit(main())
