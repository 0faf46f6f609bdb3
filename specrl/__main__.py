"""``python -m specrl`` = the ``specrl`` command (for machines where the package is not installed)."""

import sys

from specrl.cli import main

sys.exit(main())
