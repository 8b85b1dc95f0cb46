#!/usr/bin/env bash
# The whole test suite on a fresh machine, in two legs:
#   1. Debian 12's libtorch 1.13 (CPU): set-up, the build scripts/run.sh makes too
#      (scripts/build.sh: unity batches, -Werror), the formatting check, every test through ctest;
#   2. Debian 13's libtorch 2.6 (CPU), in a debootstrap root kept between runs on the same
#      machine (scripts/test-libtorch2.sh): the same build but the header checks, and the tests
#      of code whose libtorch calls differ between 1.13 and 2.x (every test not labelled one-leg;
#      tests/labels.cmake says which and why).
# In both legs the tests labelled cpu-kernels run twice, the second time (NAME@avx2) with the
# instruction set capped to AVX2. The root of leg 2 is made in the background while leg 1 builds
# and tests (it downloads and unpacks; the build computes). Multi-process tests start real
# processes on loopback. At the end, a table of the seconds each step took.
#
#   scripts/test.sh           both legs (CI runs this: .ci/run)
#   scripts/test.sh --quick   on the existing build (${BUILD_DIR:-build}): rebuilds, then runs the
#                             unit tests and the tests of the files changed since origin/main
#
# PARATRAIN_LEGS=1 or PARATRAIN_LEGS=2 runs one leg only. PARATRAIN_ISA=avx2 runs every test of
# the legs with the instruction set capped to AVX2, as on a CPU without AVX512.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--quick" ]; then
  exec bash scripts/test-quick.sh
fi

legs="${PARATRAIN_LEGS:-1 2}"
build_dir="${BUILD_DIR:-build}"
# .ci/run runs the main job first and passes its timings file and start on, for one table.
started="${PARATRAIN_STARTED:-$(date +%s)}"
timings="${PARATRAIN_TIMINGS:-$(mktemp /tmp/paratrain-timings.XXXXXX)}"
export PARATRAIN_TIMINGS="$timings"
root_pid=""
root_log=/tmp/paratrain-trixie-root.log

# The environment of both legs' tests. Two tests run at a time on this machine's two cores, so
# each test's processes get one intra-op thread: libtorch 2.6 otherwise takes both cores in every
# process, and two such tests oversubscribe the machine (the CNN's fp32 step took 127 ms with 2
# threads and 88 ms with 1, alone). libtorch 1.13 (Debian 12) runs one thread by default.
# PARATRAIN_ISA adds its cap.
ctest_env=(OMP_NUM_THREADS=1)
if [ "${PARATRAIN_ISA:-}" = "avx2" ]; then
  ctest_env+=(ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 OPENBLAS_CORETYPE=Haswell)
elif [ -n "${PARATRAIN_ISA:-}" ]; then
  echo "test: PARATRAIN_ISA=${PARATRAIN_ISA} is not known: use avx2, or leave it unset" >&2
  exit 2
fi
export PARATRAIN_CTEST_ENV="${ctest_env[*]}"

source scripts/timing.sh  # step NAME COMMAND...

table() {
  local status=$?
  if [ -n "$root_pid" ] && kill -0 "$root_pid" 2>/dev/null; then
    kill -- -"$root_pid" 2>/dev/null || true  # the root's set-up, when leg 1 failed first
  fi
  echo
  echo "test: seconds per step (status $status)"
  awk '{ name = $1; for (i = 2; i < NF; ++i) name = name " " $i; printf "  %-34s %6d\n", name, $NF }' \
    "$timings"
  printf "  %-34s %6d\n" "total" "$(($(date +%s) - started))"
  rm -f "$timings"
}
trap table EXIT

step "set-up (apt)" bash scripts/setup.sh  # both legs' packages on the host, debootstrap too
if [[ " $legs " == *" 2 "* ]]; then
  # A process group of its own, so that a failure of leg 1 can stop it whole.
  setsid bash -c "t0=\$(date +%s); bash scripts/test-libtorch2.sh --root-only > '$root_log' 2>&1; \
    rc=\$?; name='leg 2 root, in the background'; [ \$rc -eq 0 ] || name=\"\$name (failed)\"; \
    echo \"\$name \$((\$(date +%s) - t0))\" >> '$timings'; \
    exit \$rc" &
  root_pid=$!
fi
if [[ " $legs " == *" 1 "* ]]; then
  # The main job's build (scripts/build.sh): after `bash scripts/run.sh` there is nothing to do.
  step "leg 1 build" bash scripts/build.sh
  step "leg 1 format check" bash scripts/check-format.sh
  # shellcheck disable=SC2086
  step "leg 1 tests" env ${PARATRAIN_CTEST_ENV} \
    bash -c "cd '$build_dir' && ctest -j 2 --output-on-failure --timeout 300"
  echo "test: leg 1 (libtorch 1.13) passed after $(($(date +%s) - started)) s"
fi
if [[ " $legs " == *" 2 "* ]]; then
  t0=$(date +%s)
  if ! wait "$root_pid"; then
    root_pid=""
    echo "test: making the Debian 13 root failed:" >&2
    tail -n 20 "$root_log" >&2
    exit 1
  fi
  root_pid=""
  echo "leg 2 waiting for the root $(($(date +%s) - t0))" >>"$timings"
  bash scripts/test-libtorch2.sh  # records its build and tests in $PARATRAIN_TIMINGS
  echo "test: leg 2 (libtorch 2.6) passed; both legs took $(($(date +%s) - started)) s"
fi
