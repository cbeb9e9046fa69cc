#!/usr/bin/env bash
# The GPU proof of hpct's CUDA half (docs/gpu-proof.md has the device plan, docs/gpu.md the claims).
#
# Here, on the CPU machine (CUDA 13.0's nvcc, no GPU): build everything the device needs and pack it
#   ci/gpu.sh --pack DIR [--funcs proof|all|SPEC] [--max-calls N] [--workdir W] [--reuse] [--no-test-wheels]
#     patched libnccl 2.30.7 for sm_90 (stripped, xz), the hpct wheel for cp312, tests/gpu and the
#     runner, a manifest (every file's size and sha256, the totals); refused with the reason and the
#     fix when nvcc is not exactly 13.0, an input is missing, or the pack exceeds the device tool's
#     64 MiB per call (less the working tree that travels with it).  ci/gpu_pack.py does the work.
#
# On the device (one H100/H200, from the carried pack; nothing is built there)
#   ci/gpu.sh [--from DIR] [--phase smoke|proof|more|overhead|held|faults|speed|speed61|ddp|start|plan|all] [--budget-s S] [--mps]
#     preflight (Python 3.12, torch 2.11.x+cu130, driver >= 580, an sm_90 device, the pack's
#     sha256s), install (pip --no-index --no-deps --target), then the phase's tests, both stacks
#     on the pack's libnccl (LD_PRELOAD) with NCCL_ALGO=Ring NCCL_PROTO=Simple and one channel.
#     Reports (tables, log) go to $OUT, else build/gpu-proof/.  ci/gpu_device.py does the work.
#   ci/gpu.sh --preflight [--from DIR]     the checks only (CI runs this on a CPU: it must refuse)
#
# On a GPU machine with hpct's patched torch 2.6.0 (hpct-build wheel torch=2.6.0) and hpct's NCCL
# 2.21.5 wheel installed in $PYTHON's environment (the lent H200's torch 2.11 cannot be this one):
#   ci/gpu.sh --torch26                     the wheel's NCCL half (tests/gpu/test_torch26_nccl.py);
#     refused (exit 3) naming what is missing: a CUDA device, the patched torch, hpct's libnccl
#
# Exit codes: 0 ok, 1 a proof test failed, 2 bad arguments, 3 the preflight refused,
# 4 the pack was refused, 5 a build failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

die() { echo "ci/gpu.sh: $*" >&2; exit 2; }
usage() { sed -n '2,22p' "$0"; }

[ $# -gt 0 ] && [ "$1" = "--pack" ] && {
  shift
  [ $# -gt 0 ] && [ "${1#--}" = "$1" ] || die "--pack needs the pack folder first (e.g. ci/gpu.sh --pack build/gpu-pack)"
  # The builder runs from this checkout (python3 -m hpct.builder with the root as its cwd).
  exec "${PACK_HOST_PYTHON:-python3}" ci/gpu_pack.py "$@"
}

[ $# -gt 0 ] && [ "$1" = "--torch26" ] && {
  shift
  [ $# -eq 0 ] || die "--torch26 takes no other argument"
  "${PYTHON:-python3}" - <<'PY' || exit 3
import sys
try:
    import torch
except ImportError as err:
    sys.exit(f"ci/gpu.sh --torch26: no torch here ({err})\n  fix: pip install the wheel of hpct-build wheel torch=2.6.0")
problems = []
if "+hpct." not in torch.__version__:
    problems.append(f"torch {torch.__version__} is not hpct's patched 2.6.0 (fix: pip install the wheel of "
                    "hpct-build wheel torch=2.6.0)")
if not torch.cuda.is_available():
    problems.append("no CUDA device (fix: run this on a GPU machine)")
probe = getattr(torch._C._distributed_c10d, "_hpct_nccl_rootless_probe", None)
if probe is not None and probe()[1]:
    problems.append(f"{probe()[1]} (fix: {probe()[2]})")
if problems:
    sys.exit("ci/gpu.sh --torch26: refused:\n  " + "\n  ".join(problems))
PY
  exec "${PYTHON:-python3}" -P -m pytest -m gpu -p no:cacheprovider -s tests/gpu/test_torch26_nccl.py
}

MODE=run; ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --preflight) MODE=preflight ;;
    --mps) ARGS+=("$1") ;;
    --from|--phase|--budget-s|--work|--report)
      [ $# -ge 2 ] || die "$1 needs a value"; ARGS+=("$1" "$2"); shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (use --pack DIR here; --from DIR, --phase, --budget-s, --preflight on the device)" ;;
  esac
  shift
done
command -v "$PY" >/dev/null || die "no $PY: set PYTHON to the interpreter with torch"
export PYTHONUNBUFFERED=1
exec "$PY" ci/gpu_device.py "$MODE" ${ARGS[@]+"${ARGS[@]}"}
