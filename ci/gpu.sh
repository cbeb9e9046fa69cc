#!/usr/bin/env bash
# The GPU proof of hpct's CUDA half, one command (docs/gpu.md "GPU proof").
#
#   ci/gpu.sh [--preflight] [--skip-build]
#
# Target: one H100 or H200 (sm_90), driver >= 580, nvcc 13.0, Python 3.12 with torch 2.11.0+cu130 and
# nvidia-nccl-cu13 installed, no network, <= 8 minutes.  Steps:
#   1. preflight (CPU side, also run in CI): arguments, tools, torch, a CUDA device;
#   2. build the patched NCCL for this GPU's arch only (NCCL_BUILD_ARGS below);
#   3. build and install the hpct wheel from CARRIED inputs (no network there):
#        third_party/cache/   the pinned Gloo archive (sha256-checked; a few MiB)
#        third_party/src/gloo-5354032/  the unpacked Gloo tree (optional, saves the unpack)
#      and ../shared/sources/nccl-2.30.7-1.tar.gz (or HPCT_NCCL_SOURCE) for step 2;
#      together well under 64 MiB;
#   4. pytest -m gpu tests/gpu with N = 2 and 4 ranks on the one GPU (NCCL_HOSTID per rank,
#      NCCL_SOCKET_IFNAME=lo): exactness against stock ProcessGroupNCCL, DDP bit-identity,
#      kill/recover, and the timing table (printed and written to $OUT or build/gpu-proof/).
set -euo pipefail
cd "$(dirname "$0")/.."

# ---- every flag of the NCCL build in one place (check `python -m hpct.builder build nccl --help`)
NCCL_VERSION=${NCCL_VERSION:-2.30.7}
CUDA_VERSION=${CUDA_VERSION:-13.0}
NCCL_BUILD_ARGS=(build "nccl=${NCCL_VERSION}" --cuda "${CUDA_VERSION}" --cuda-arch "${CUDA_ARCH:-90}")
PY=${PYTHON:-python3}
RANKS=${GPU_PROOF_RANKS:-"2 4"}
REPORT_DIR=${OUT:-build/gpu-proof}

die() { echo "ci/gpu.sh: $*" >&2; exit 2; }

PREFLIGHT_ONLY=0; SKIP_BUILD=0
for arg in "$@"; do
  case "$arg" in
    --preflight) PREFLIGHT_ONLY=1 ;;
    --skip-build) SKIP_BUILD=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) die "unknown argument '$arg' (use --preflight, --skip-build)" ;;
  esac
done

# ---- 1. preflight
command -v "$PY" >/dev/null || die "no $PY: set PYTHON to the interpreter with torch"
"$PY" - <<'PYEOF' || exit 3
import sys
try:
    import torch
except ImportError:
    sys.exit("ci/gpu.sh: torch is not importable: install a CUDA build of torch (e.g. 2.11.0+cu130)")
if not torch.version.cuda:
    sys.exit(f"ci/gpu.sh: torch {torch.__version__} is a CPU build: no CUDA device can be used; "
             "install a CUDA build of torch")
if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
    sys.exit(f"ci/gpu.sh: no CUDA device is visible (torch {torch.__version__}, CUDA {torch.version.cuda})")
import torch.distributed as dist
if not dist.is_nccl_available():
    sys.exit("ci/gpu.sh: this torch has no NCCL backend (stock ProcessGroupNCCL is the reference)")
major, minor = torch.cuda.get_device_capability(0)
print(f"preflight: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)} "
      f"(sm_{major}{minor}), NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
PYEOF
if [ "$SKIP_BUILD" = 0 ]; then
  command -v nvcc >/dev/null || die "no nvcc on PATH: the patched NCCL build needs CUDA ${CUDA_VERSION} (export PATH=/usr/local/cuda/bin:\$PATH)"
  command -v make >/dev/null || die "no make"
  ls third_party/cache/*gloo* >/dev/null 2>&1 || die "third_party/cache has no Gloo archive: carry third_party/cache (see the header)"
fi
[ "$PREFLIGHT_ONLY" = 1 ] && { echo "preflight ok"; exit 0; }

# ---- 2. patched NCCL, this GPU's arch only
if [ "$SKIP_BUILD" = 0 ]; then
  "$PY" -m hpct.builder "${NCCL_BUILD_ARGS[@]}"
fi
LIB=$(ls third_party/build/nccl-"${NCCL_VERSION}"*/install/lib/libnccl.so.2 2>/dev/null | head -1 || true)
[ -n "${HPCT_NCCL_LIBRARY:-}" ] || { [ -n "$LIB" ] || die "no built libnccl under third_party/build/nccl-${NCCL_VERSION}*"; export HPCT_NCCL_LIBRARY="$PWD/$LIB"; }

# ---- 3. the hpct wheel (Gloo from the carried archive, no network)
if [ "$SKIP_BUILD" = 0 ]; then
  "$PY" -m hpct.builder wheel --install
fi

# ---- 4. the proof
mkdir -p "$REPORT_DIR"
export NCCL_SOCKET_IFNAME=lo GPU_PROOF_RANKS="$RANKS" GPU_PROOF_REPORT="$REPORT_DIR"
rc=0
"$PY" -P -m pytest -m gpu tests/gpu -v -p no:cacheprovider || rc=$?
# The one table of the run (docs/gpu.md records it with the date and the machine).
echo "==== GPU proof report ($(date -u +%Y-%m-%dT%H:%MZ), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1))"
cat "$REPORT_DIR"/timing-*.txt "$REPORT_DIR"/busbw-*.txt "$REPORT_DIR"/ddp-*.txt 2>/dev/null || true
exit $rc
