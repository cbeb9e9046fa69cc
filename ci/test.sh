#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set up, build and install the
# wheel from this checkout (the tests exercise the installed package), build
# Gloo's own tests, then run pytest.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
python3 -m hpct.build all
python3 -m hpct.build build gloo --tests
# `pytest` (not `python -m pytest`) keeps the checkout off sys.path.
exec timeout --signal=INT --kill-after=60 80m pytest "$@"
