#!/usr/bin/env bash
# The main job: set up, fetch and verify the pinned sources, patch and build
# Gloo, build and install the hpct wheel, print what was built, then run the
# rootless demo: start, train, lose a rank, recover in-process, compare with stock.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
python3 -m hpct.build all
hpct demo
