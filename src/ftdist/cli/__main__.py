"""``python -m ftdist.cli``: the ``ftdist`` console script."""

import sys

from ftdist.cli import main

sys.exit(main())
