#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set up, build and install the
# wheel from this checkout (the tests exercise the installed package), build
# Gloo's own tests, then run pytest.  Extra arguments go to pytest.
# Each tier prints its duration (CI allows 90 minutes on 2 cores; the aim is 45 with warm caches,
# under 85 cold).
# NCCL's tag tarballs come from HPCT_NCCL_SOURCES (a folder of nccl-<version>-1.tar.gz;
# .ci/run sets it when ../shared/sources exists); without it the NCCL source tiers skip.
# Without pytest arguments the torch tier follows (ci/torch_tier.sh: PyPI's newest supported
# torch in a cached virtual environment).
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/python.sh
hpct_pick_python
tier_start=$SECONDS
mkdir -p build
rm -f build/ci-tiers.tsv build/junit-*.xml build/test-profile-*.jsonl build/ccache-*.tsv   # this run's only (ci/summary.py)
tier() {  # tier NAME: print how long the previous tier took, then start NAME
  local now=$SECONDS
  if [ -n "${tier_name:-}" ]; then
    echo "ci/test.sh: tier '$tier_name' took $((now - tier_start)) s"
    printf '%s\t%s\n' "$tier_name" "$((now - tier_start))" >> build/ci-tiers.tsv
  fi
  tier_name=$1; tier_start=$now
  [ -z "$1" ] || echo "ci/test.sh: tier '$1' starts"
}
tier setup
bash ci/setup.sh --tests
if [ $# -eq 0 ]; then   # the torch tier's environment downloads meanwhile (its log: build/torch-tier-prepare.log)
  mkdir -p build
  timeout 40m bash ci/torch_tier.sh --prepare >build/torch-tier-prepare.log 2>&1 &
  prepare_pid=$!
fi
ccache_stats() { ! command -v ccache >/dev/null || ccache --print-stats >"build/ccache-$1.tsv" 2>/dev/null || true; }
ccache_stats before           # ci/summary.py reports this run's compiler-cache hits
tier build
"$PYTHON" -m hpct.builder all
"$PYTHON" -m hpct.builder build gloo --tests
hpct_console_script hpct >/dev/null       # rehash pyenv's shims; note when hpct is off PATH
if [ $# -eq 0 ]; then   # after `all` has fetched NCCL's sources: the real NCCL builds of
  # tests/test_nccl_build.py use the CPU the tests leave idle (nice 19: they never slow a
  # test down; the tests wait for them, then find them built)
  timeout 70m nice -n 19 "$PYTHON" tests/nccl_prebuild.py >build/nccl-prebuild.log 2>&1 &
  # Likewise the patched torch 2.6.0 wheel (hpct-build wheel torch=2.6.0, from the build cache when
  # warm) and the two torch 2.6.0 environments tests/test_patched_torch.py runs in (cached by key)
  timeout 70m nice -n 19 "$PYTHON" tests/torch26_envs.py >build/torch26-prepare.log 2>&1 &
fi
# -P keeps the checkout off sys.path (the tests exercise the installed wheel), and
# the same interpreter that installed the wheel runs the tests.
rc=0
if [ $# -gt 0 ]; then
  timeout --signal=INT --kill-after=60 80m "$PYTHON" -P -m pytest --durations=15 --junitxml=build/junit-suite.xml "$@" || rc=$?
else
  # The suite's tiers, in this order; a test that carries several tier markers runs in the first
  # of them (tests/test_suite_layout.py: this list is the registered markers but gpu, and every
  # test carries one).  serial before the tiers that share the machine: it takes the tests that
  # time themselves or fill both cores.
  TIER_MARKERS=(unit nccl_sim serial multiprocess multihost slow)
  # One pytest run per tier; TIER_WORKERS gives a tier pytest-xdist workers where what serial
  # leaves keeps a core idle: the profile (build/test-profile-*.jsonl, CPU / wall per test)
  # measured 0.1-0.6 for the rest of the multiprocess tier (PyTorch's suites on hpct, the lossy
  # links) and 0.1-1.2 for the rest of slow (Gloo's own suite sleeps; the image, wheel and
  # source builds use one core each), against 1.2-1.9 for the serial tests.  One run of all
  # three on 4 workers was tried: the image, the wheels and the source installs compiling at
  # once stretched the image to 825 s and Slurm's job start past its limit, for 100 s saved.
  # Each worker takes its ports from a range of its own (tests/conftest.py) and pytest gives it
  # its own scratch folder; loadfile keeps a module's shared world in one worker.  unit and
  # nccl_sim stay one at a time: their tests write the checkout's patched trees and time
  # in-process deadlines, for a minute's gain at most.
  declare -A TIER_WORKERS=([multiprocess]=3 [slow]=3)
  # A tier's longest files start first, one per worker (collection order, not xdist's
  # most-tests-first): started late, the image build alone outlasted every other slow worker,
  # and PyTorch's c10d suite (one test, three minutes) the other multiprocess ones.
  LONG_FIRST=(tests/test_image.py tests/test_patched_torch.py tests/test_goodput.py tests/test_wheels.py
              tests/test_source_install.py tests/test_torch_suites.py tests/test_fault_tolerance.py)
  earlier=""
  for marker in "${TIER_MARKERS[@]}"; do
    tier "pytest $marker"
    tier_rc=0
    workers=${TIER_WORKERS[$marker]:-}
    order=()
    [ -z "$workers" ] || order=(--no-loadscope-reorder "--first=$(IFS=,; echo "${LONG_FIRST[*]}")")
    timeout --signal=INT --kill-after=60 40m "$PYTHON" -P -m pytest --durations=5 -p no:cacheprovider \
      ${workers:+-n "$workers" --dist loadfile} "${order[@]}" \
      -m "$marker${earlier:+ and not ($earlier)}" --junitxml="build/junit-$marker.xml" || tier_rc=$?
    [ "$tier_rc" = 5 ] || [ "$tier_rc" = 0 ] || rc=$tier_rc        # 5: a tier with no test left
    earlier="${earlier:+$earlier or }$marker"
  done
fi
if [ $# -eq 0 ]; then          # the whole suite: also against the newest torch users install
  tier torch
  wait "$prepare_pid" || echo "ci/test.sh: preparing the torch tier failed (build/torch-tier-prepare.log):" \
                              "$(tail -n 5 build/torch-tier-prepare.log)"
  bash ci/torch_tier.sh || rc=$?
fi
tier ""
ccache_stats after
echo "ci/test.sh: total $SECONDS s"
"$PYTHON" ci/summary.py build || true
exit $rc
