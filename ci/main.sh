#!/usr/bin/env bash
# The main job: set up, fetch and verify the pinned sources, patch and build
# Gloo, build and install the hpct wheel, and print what was built.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
python3 -m hpct.build all
