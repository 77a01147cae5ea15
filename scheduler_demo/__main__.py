"""``python -m scheduler_demo``."""

import sys

from .cli import main

sys.exit(main())
