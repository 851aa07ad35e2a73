"""Entry point for `python -m meshtrain`."""

import sys

from meshtrain.commands import main

sys.exit(main())
