#!/usr/bin/env bash
# The whole test suite on a fresh machine, in three legs:
#   1. Debian 12's libtorch 1.13 (CPU): set-up, the build scripts/run.sh makes too
#      (scripts/build.sh: unity batches, -Werror), the formatting check, every test through ctest;
#   official: the official libtorch, inside PyTorch's wheel from PyPI (2.15, with CUDA), in a
#      virtual environment kept between runs (scripts/test-official.sh): the build with every CUDA
#      path compiled and linked by this machine's nvcc and CUDA 13 libraries, a check that Debian's
#      gloo headers match the wheel's gloo, and the tests of code whose libtorch calls differ
#      between versions (every test not labelled one-leg; tests/test_lists.cmake says which and why),
#      with the Hugging Face tests against real transformers;
#   2. Debian 13's libtorch 2.6 and GCC 14 (CPU), in a debootstrap root kept between runs on the
#      same machine (scripts/test-libtorch2.sh): the library, CLI, benchmarks and examples built
#      with -Werror, and a smoke run (a two-rank DDP job); the official leg runs the tests on a 2.x
#      libtorch.
# In leg 1 the tests labelled cpu-kernels run twice, the second time (NAME@avx2) with the
# instruction set capped to AVX2. The official and Debian 13 legs' builds run in the background
# from the start, after what each needs is made (the virtual environment, the root: downloads and
# unpacking), the official one first, then leg 2's (each holds gigabytes), at the idle priority
# (SCHED_IDLE): they take the CPU time that leg 1's tests, and then the official leg's, leave
# while they wait on sockets, timeouts and each other. They are not detached with setsid: the
# kernel gives each setsid group of processes (an autogroup) an equal share of the CPU whatever
# its nice value or policy, and a build detached that way at nice 19 took half the CPU and slowed
# leg 1's tests past their timeouts.
# Multi-process tests start real processes on loopback. At the end, a table of the seconds each
# step took.
#
#   scripts/test.sh           every leg (CI runs this: .ci/run)
#   scripts/test.sh --quick   on the existing build (${BUILD_DIR:-build}): rebuilds, then runs the
#                             unit tests and the tests of the files changed since origin/main
#
# PARATRAIN_LEGS="1 official 2" (the default) picks legs. PARATRAIN_ISA=avx2 runs every test of
# the legs with the instruction set capped to AVX2, as on a CPU without AVX512.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--quick" ]; then
  exec bash scripts/test-quick.sh
fi

legs="${PARATRAIN_LEGS:-1 official 2}"
build_dir="${BUILD_DIR:-build}"
# .ci/run runs the main job first and passes its timings file and start on, for one table.
started="${PARATRAIN_STARTED:-$(date +%s)}"
timings="${PARATRAIN_TIMINGS:-$(mktemp /tmp/paratrain-timings.XXXXXX)}"
export PARATRAIN_TIMINGS="$timings"
official_pid=""
leg2_pid=""
work_dir=""  # the background builds' logs and marker: removed after a run that passed

# The environment of the legs' tests. Two tests run at a time on this machine's two cores, so
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
  local pid i
  for pid in "$official_pid" "$leg2_pid"; do  # what runs in the background, when a step failed
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
      kill -- -"$pid" 2>/dev/null || true
      # The group's members run their traps (leg 2's unmounts) before this script ends.
      for ((i = 0; i < 60; i++)); do
        kill -0 -- -"$pid" 2>/dev/null || break
        sleep 0.5
      done
    fi
  done
  if [ -n "$work_dir" ] && [ "$status" -eq 0 ]; then
    rm -rf "$work_dir"
  elif [ -n "$work_dir" ]; then
    echo "test: the background builds' logs are in $work_dir"
  fi
  echo
  echo "test: seconds per step (status $status)"
  awk '{ name = $1; for (i = 2; i < NF; ++i) name = name " " $i; printf "  %-46s %6d\n", name, $NF }' \
    "$timings"
  printf "  %-46s %6d\n" "total" "$(($(date +%s) - started))"
  rm -f "$timings"
}
trap table EXIT

step "set-up (apt)" bash scripts/setup.sh  # every leg's packages on the host, debootstrap too
work_dir=$(mktemp -d /tmp/paratrain-test.XXXXXX)
official_log="$work_dir/official-build.log"
leg2_log="$work_dir/leg2-build.log"
# background VAR NAME LOG COMMAND...: COMMAND in a process group of its own (so that a failed step
# can stop it whole), not detached with setsid (see above), its output in LOG, its seconds in the table;
# its pid goes to VAR.
background() {
  local var="$1" name="$2" log="$3"
  shift 3
  # In the inner script: $0 the log, $1 the name, $2 the table's file, then the command.
  perl -e 'setpgrp(0, 0) or die "setpgrp: $!"; exec @ARGV or die "exec: $!"' -- \
    bash -c 't0=$(date +%s); name="$1"; table="$2"; shift 2; "$@" >> "$0" 2>&1; rc=$?
    [ $rc -eq 0 ] || name="$name (failed)"
    echo "$name, in the background $(($(date +%s) - t0))" >> "$table"; exit $rc' \
    "$log" "$name" "$timings" "$@" </dev/null >>"$log" 2>&1 &
  printf -v "$var" '%s' "$!"
}
# wait_for NAME VAR LOG: waits for the background step whose pid is in VAR, then empties VAR (the
# pid is reaped: table() must not signal it); shows where the log says it failed.
wait_for() {
  local t0 pid="${!2}" rc=0
  t0=$(date +%s)
  wait "$pid" || rc=$?
  printf -v "$2" '%s' ""
  if [ "$rc" -ne 0 ]; then
    echo "test: $1 failed; the whole log is $3. Its errors and its end:" >&2
    grep -n -m 20 -E 'error:|^FAILED:|fatal error|CMake Error|^ERROR|^E: ' "$3" >&2 || true
    tail -n 40 "$3" >&2
    exit 1
  fi
  echo "waiting for $1 $(($(date +%s) - t0))" >>"$timings"
}
# The idle priority (SCHED_IDLE), or nice 19 where the system refuses it.
idle=(chrt --idle 0)
if ! chrt --idle 0 true 2>/dev/null; then idle=(nice -n 19); fi
# Leg 2's background job cannot ask for a password, and runs after any it typed has expired.
if [[ " $legs " == *" 2 "* ]] && [ "$(id -u)" -ne 0 ] && ! sudo -n -k true 2>/dev/null; then
  echo "test: leg 2 needs root for its chroot: run as root or with sudo that asks no password," \
    "or leave leg 2 out (PARATRAIN_LEGS='1 official')" >&2
  exit 2
fi
if [[ " $legs " == *" official "* ]]; then
  # The marker tells leg 2's job that this build is over (a zombie still answers kill -0).
  background official_pid "official venv and build" "$official_log" bash -c \
    'bash scripts/venv.sh && "${@:2}" bash scripts/test-official.sh --build-only; rc=$?
    touch "$1"; exit $rc' _ "$work_dir/official-built" "${idle[@]}"
else
  touch "$work_dir/official-built"
fi
if [[ " $legs " == *" 2 "* ]]; then
  # The root meanwhile (downloads), the build after the official one: one build at a time, as
  # each holds gigabytes.
  background leg2_pid "leg 2 root and build" "$leg2_log" bash -c \
    'bash scripts/test-libtorch2.sh --root-only || exit
    while [ ! -e "$1" ]; do sleep 2; done
    "${@:2}" bash scripts/test-libtorch2.sh --build-only' _ "$work_dir/official-built" "${idle[@]}"
fi
if [[ " $legs " == *" 1 "* ]]; then
  # The main job's build (scripts/build.sh): after `bash scripts/run.sh` there is nothing to do.
  step "leg 1 build" bash scripts/build.sh
  step "leg 1 format check" bash scripts/check-format.sh
  # shellcheck disable=SC2086
  # Every test but the Hugging Face ones, which the official leg runs against its transformers.
  step "leg 1 tests" env ${PARATRAIN_CTEST_ENV} \
    bash -c "cd '$build_dir' && ctest -j 2 --output-on-failure --timeout 300 \
      $([[ " $legs " == *" official "* ]] && echo "-E '^HfGpt2[.]'")"
  echo "test: leg 1 (libtorch 1.13) passed after $(($(date +%s) - started)) s"
fi
if [[ " $legs " == *" official "* ]]; then
  wait_for "the official build" official_pid "$official_log"
  grep -E '^(-- paratrain: |test-official: )' "$official_log" || true
  bash scripts/test-official.sh --tests-only  # records its tests in $PARATRAIN_TIMINGS
  echo "test: the official leg (libtorch from PyTorch's wheel) passed after" \
    "$(($(date +%s) - started)) s"
fi
if [[ " $legs " == *" 2 "* ]]; then
  wait_for "the leg 2 build" leg2_pid "$leg2_log"
  bash scripts/test-libtorch2.sh --smoke-only  # records its smoke run in $PARATRAIN_TIMINGS
  echo "test: leg 2 (libtorch 2.6) passed; every leg took $(($(date +%s) - started)) s"
fi
