#!/usr/bin/env bash
# The torch tier: hpct against the torch users install today, PyPI's newest supported torch (the
# CUDA build; it runs on a CPU machine), in a virtual environment of its own, cached between runs
# at ~/.cache/hpct/venv-torch-<version> (a fresh machine downloads about 2.8 GB once).
#
#   bash ci/torch_tier.sh [pytest arguments]      (after ci/test.sh's build: it installs dist/'s wheel)
#
# The machine's pip configuration caps torch below it (a constraint file): this tier's pip runs
# without it (PIP_CONFIG_FILE=/dev/null, --isolated); certificates still come from the environment.
# Never install this torch into the machine's own Python.
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/python.sh
hpct_pick_python
version=$("$PYTHON" -P -c "from hpct.requirements import TORCH_NEWEST; print(TORCH_NEWEST)")
tag=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "ci/torch_tier.sh: torch $version needs Python 3.11 or newer; $PYTHON is older: tier skipped" >&2
  exit 0
fi
wheel=$(ls -t dist/hpct-*-"$tag"-*.whl 2>/dev/null | head -n1 || true)
[ -n "$wheel" ] || { echo "ci/torch_tier.sh: no hpct wheel for $tag in dist/" >&2
                     echo "  fix: build it first: $PYTHON -m hpct.builder wheel --install" >&2; exit 2; }
venv="${XDG_CACHE_HOME:-$HOME/.cache}/hpct/venv-torch-$version"
tier_pip() { PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip --isolated --disable-pip-version-check "$@"; }
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
  echo "ci/torch_tier.sh: making $venv (torch==$version from PyPI; a few minutes the first time)"
  rm -rf "$venv.tmp"
  "$PYTHON" -m venv "$venv.tmp"
  venv="$venv.tmp" tier_pip install -q "torch==$version" numpy "pytest>=7" "expecttest>=0.2"
  rm -rf "$venv"
  mv "$venv.tmp" "$venv"          # its python finds its packages from where it lies; pip runs as -m
fi
tier_pip install -q --no-deps --force-reinstall "$wheel"
echo "ci/torch_tier.sh: $("$venv/bin/python" -P -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL", ".".join(map(str, torch.cuda.nccl.version())))') with $(basename "$wheel")"
# The backend against ProcessGroupGloo, a SIGKILLed rank's in-process recovery, shrink/grow, the
# doctor, the NCCL engine's simulation tier: what a user of this torch runs (the full suite
# runs on the CPU pin; this tier keeps CI within its time).
timeout --signal=INT --kill-after=30 15m "$venv/bin/python" -P -m pytest -q -p no:cacheprovider \
  tests/test_backend.py tests/test_recovery.py::test_ddp_survives_a_sigkilled_rank_bit_identical \
  tests/test_elastic.py tests/test_doctor.py tests/test_nccl_sim.py "$@"
