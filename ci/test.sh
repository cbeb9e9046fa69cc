#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set up, build and install the
# wheel from this checkout (the tests exercise the installed package), build
# Gloo's own tests, then run pytest.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
python3 -m hpct.build all
python3 -m hpct.build build gloo --tests
# -P keeps the checkout off sys.path (the tests exercise the installed wheel), and
# the same python3 that installed the wheel runs the tests.
exec timeout --signal=INT --kill-after=60 80m python3 -P -m pytest "$@"
