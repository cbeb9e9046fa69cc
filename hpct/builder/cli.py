"""hpct-build: fetch, patch and build hpct's pinned, patched collective stack."""

from __future__ import annotations

from typing import Sequence

from ..cliutil import run_cli

VERBS = {
    "fetch": "download or copy the pinned sources, verify sha256, unpack into third_party/src/",
    "patch": "apply patches/<component>/<version>/series (--check: to a scratch copy)",
    "build": "build a component from its patched tree (gloo: CMake + ninja)",
    "wheel": "build the hpct wheel against the patched Gloo (--install to install it)",
    "all": "everything this machine can do, in order, then status",
    "status": "what is fetched, patched and built, with versions",
}


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("hpct-build", __doc__.split(": ", 1)[1].strip(), "hpct.builder", VERBS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
