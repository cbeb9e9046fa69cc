"""``python -m hpct.build``: the old name of the ``hpct-build`` pipeline, kept for one release.

The pipeline lives in ``hpct.builder`` (a folder named ``build`` reads as build output to
tools and ignore patterns).  This module only forwards, and says so on stderr once.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from .builder.cli import main as builder_main
    print("hpct: `python -m hpct.build` is deprecated and will be removed in the next release; "
          "use `hpct-build` or `python -m hpct.builder`", file=sys.stderr)
    return builder_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
