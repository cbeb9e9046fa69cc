"""``python -m hpct.diagnose``: the same as ``hpct diagnose``."""

import sys

from ..cli import main

sys.exit(main(["diagnose", *sys.argv[1:]]))
