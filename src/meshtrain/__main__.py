"""Entry point for `python -m meshtrain`."""

import sys

from meshtrain.cli import main

sys.exit(main())
