#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set up, build and install the
# wheel from this checkout (the tests exercise the installed package), build
# Gloo's own tests, then run pytest.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/python.sh
hpct_pick_python
bash ci/setup.sh --tests
"$PYTHON" -m hpct.builder all
"$PYTHON" -m hpct.builder build gloo --tests
hpct_console_script hpct >/dev/null       # rehash pyenv's shims; note when hpct is off PATH
# -P keeps the checkout off sys.path (the tests exercise the installed wheel), and
# the same interpreter that installed the wheel runs the tests.
exec timeout --signal=INT --kill-after=60 80m "$PYTHON" -P -m pytest "$@"
