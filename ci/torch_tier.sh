#!/usr/bin/env bash
# The torch tier: hpct against the torch users install today, PyPI's newest supported torch (the
# CUDA build; it runs on a CPU machine), in a virtual environment of its own, cached between runs
# at ~/.cache/hpct/venv-torch-<version>-<key of the requirements> (a fresh machine downloads about 2.8 GB once).
#
#   bash ci/torch_tier.sh [pytest arguments]      (after ci/test.sh's build: it installs dist/'s wheel)
#   bash ci/torch_tier.sh --prepare               (only make the environment: ci/test.sh starts this in
#                                                  the background at the beginning, hiding the download)
#
# With an NCCL 2.30.7 build in the checkout (the suite's slow tier makes one), hpct's drop-in
# nvidia-nccl-cu13 2.30.7+hpct.<series> wheel goes in under torch's own pin (pip's resolver), so
# the tier runs on what a GPU user of hpct installs; tests/test_torch_nccl.py checks it.
#
# The machine's pip configuration caps torch below it (a constraint file): this tier's pip runs
# without it (PIP_CONFIG_FILE=/dev/null, --isolated); certificates still come from the environment.
# Never install this torch into the machine's own Python.
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/python.sh
hpct_pick_python
prepare_only=0
if [ "${1:-}" = "--prepare" ]; then prepare_only=1; shift; fi
version=$(hpct_torch_newest)     # from the checkout: --prepare runs before the hpct wheel is built
tag=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "ci/torch_tier.sh: torch $version needs Python 3.11 or newer; $PYTHON is older: tier skipped" >&2
  exit 0
fi
# The cache is keyed by what goes into it: the interpreter's tag and the requirement list.
requirements=("torch==$version" numpy "pytest>=7" "expecttest>=0.2")
key=$(printf '%s\n' "$tag" "${requirements[@]}" | sha256sum | cut -c1-12)
venv="${XDG_CACHE_HOME:-$HOME/.cache}/hpct/venv-torch-$version-$key"
# --isolated ignores the environment too: the CA bundle (a TLS-inspecting proxy's, say) is passed on
# explicitly, from pip's variables or from the machine's pip configuration (its cert, not its caps).
cert=${PIP_CERT:-${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-}}}
[ -n "$cert" ] || cert=$(hpct_pip_cert)
tier_pip() { PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip --isolated --disable-pip-version-check \
               ${cert:+--cert "$cert"} "$@"; }
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
  echo "ci/torch_tier.sh: making $venv (torch==$version from PyPI; a few minutes the first time)"
  rm -rf "$venv.tmp"
  "$PYTHON" -m venv "$venv.tmp"
  venv="$venv.tmp" tier_pip install -q "${requirements[@]}"
  rm -rf "$venv"
  mv "$venv.tmp" "$venv"          # its python finds its packages from where it lies; pip runs as -m
  echo "ci/torch_tier.sh: cache miss: made $venv"
else
  echo "ci/torch_tier.sh: cache hit: $venv"
fi
[ "$prepare_only" = 0 ] || { echo "ci/torch_tier.sh: $venv is ready"; exit 0; }
wheel=$(ls -t dist/hpct-*-"$tag"-*.whl 2>/dev/null | head -n1 || true)
[ -n "$wheel" ] || { echo "ci/torch_tier.sh: no hpct wheel for $tag in dist/" >&2
                     echo "  fix: build it first: $PYTHON -m hpct.builder wheel --install" >&2; exit 2; }
nccl_prefix=third_party/build/nccl-2.30.7/install
if [ -f "$nccl_prefix/lib/libnccl.so.2" ]; then
  rm -rf build/torch-tier-nccl
  "$PYTHON" -m hpct.builder wheel -q nccl=2.30.7 --dist build/torch-tier-nccl >/dev/null
  nccl_wheel=$(ls build/torch-tier-nccl/nvidia_nccl_cu13-*.whl)
  # No --no-deps: pip's resolver must accept the drop-in under torch's nvidia-nccl-cu13==2.30.7.
  tier_pip install -q "$nccl_wheel" "torch==$version"
  echo "ci/torch_tier.sh: installed $(basename "$nccl_wheel") under torch $version's pin"
else
  # The cached environment may hold the drop-in an earlier run put there: NVIDIA's goes back under
  # torch's pin, so that a run without the build tests what a user of this torch has.
  if "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit('+hpct.' not in m.version('nvidia-nccl-cu13'))" 2>/dev/null; then
    tier_pip uninstall -q -y nvidia-nccl-cu13
    tier_pip install -q "torch==$version"
  fi
  echo "ci/torch_tier.sh: no NCCL 2.30.7 build in $nccl_prefix (the slow tier makes it from HPCT_NCCL_SOURCES):" \
       "torch keeps NVIDIA's nvidia-nccl-cu13; tests/test_torch_nccl.py says so"
fi
tier_pip install -q --no-deps --force-reinstall "$wheel"
echo "ci/torch_tier.sh: $("$venv/bin/python" -P -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL", ".".join(map(str, torch.cuda.nccl.version())))') with $(basename "$wheel")"
# The backend against ProcessGroupGloo, a SIGKILLed rank's in-process recovery, shrink/grow, the
# doctor, `hpct run` replacing a killed worker from a warm standby (DDP, and FSDP2 from its replica), a
# worker forked by hpct run's fork server (on this CUDA build torch would mark it a bad fork had the
# server asked CUDA anything: the CPU pin cannot tell), the NCCL engine's simulation
# tier and its fault path by NCCL's rules, the reconfigure API with PyTorch's own fault-tolerance suite, the drop-in NCCL: what a user of this torch runs (the full suite runs
# on the CPU pin; this tier keeps CI within its time).
timeout --signal=INT --kill-after=30 20m "$venv/bin/python" -P -m pytest -q -p no:cacheprovider \
  --junitxml=build/junit-torch.xml \
  tests/test_backend.py tests/test_recovery.py::test_ddp_survives_two_sigkilled_ranks_bit_identical \
  tests/test_elastic.py tests/test_doctor.py tests/test_nccl_sim.py tests/test_nccl_sim_faults.py tests/test_reconfigure.py \
  tests/test_fault_tolerance.py tests/test_torch_nccl.py tests/test_nccl_sim_forked.py \
  tests/test_launch_recovery.py::test_a_killed_worker_is_replaced_from_a_standby_and_nobody_else_restarts \
  tests/test_launch_recovery.py::test_an_fsdp2_hsdp_job_replaces_a_killed_worker_from_its_replicas_shards \
  tests/test_launch_recovery.py::test_fsdp2_join_takes_the_furthest_replica_and_heals_a_torn_step "$@"
