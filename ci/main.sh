#!/usr/bin/env bash
# The main job: set up, fetch and verify the pinned sources, patch and build
# Gloo, build and install the hpct wheel, print what was built, then run the
# rootless demo: start, train, lose a rank, recover in-process, compare with stock.
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/python.sh
hpct_pick_python
bash ci/setup.sh
"$PYTHON" -m hpct.builder all
# The demo runs through the installed console script, as a user would run `hpct demo`.
hpct=$(hpct_console_script hpct)
"$hpct" demo
