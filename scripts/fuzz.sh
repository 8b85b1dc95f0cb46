#!/usr/bin/env bash
# libFuzzer targets for the input readers (tests/fuzz): the Fashion-MNIST idx reader, the
# safetensors reader, the torch.save loader and the command-line parser. Builds them with clang,
# AddressSanitizer and UndefinedBehaviorSanitizer into ${FUZZ_BUILD_DIR:-build-fuzz}, then runs
# each from a scratch copy of its seeds (tests/fuzz/corpus/<target>, never modified):
#
#   scripts/fuzz.sh smoke              each target for 5 s; fails on any crash
#   scripts/fuzz.sh long [N [SECONDS]] each target for N runs (default 1000000), or SECONDS at
#                                      most (default: no limit); prints execs, exec/s and result
#
# A crash, sanitizer report, hang (> 10 s on one input), allocation over 4 GiB or uncaught
# exception fails the run; the input that caused it is kept under $FUZZ_BUILD_DIR/artifacts/ and
# replays with: $FUZZ_BUILD_DIR/fuzz_<target> <that file>.
# FUZZ_TARGETS="idx args" runs only some; FUZZ_JOBS sets the build's parallelism (default 1).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

mode=${1:-smoke}
build=${FUZZ_BUILD_DIR:-build-fuzz}
targets=${FUZZ_TARGETS:-idx safetensors torch_load args}
case "$mode" in
  smoke) limits=(-max_total_time=5) ;;
  long)
    runs=${2:-1000000}
    limits=("-runs=$runs" "-max_total_time=${3:-0}")
    ;;
  *)
    echo "usage: scripts/fuzz.sh smoke | long [RUNS [SECONDS]]" >&2
    exit 2
    ;;
esac

for tool in clang clang++ cmake; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "fuzz: $tool not found (apt-get install clang cmake)" >&2
    exit 1
  fi
done
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S tests/fuzz -B "$build" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang >/dev/null
fi
cmake --build "$build" -j "${FUZZ_JOBS:-1}"
build=$(cd "$build" && pwd)

scratch=$(mktemp -d "${TMPDIR:-/tmp}/paratrain-fuzz.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$build/artifacts"

# Leak checking stays on, but for a leak inside libtorch's zip reader (see the file).
export LSAN_OPTIONS="suppressions=$root/tests/fuzz/lsan.supp:print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"

failed=()
for t in $targets; do
  bin="$build/fuzz_$t"
  if [ ! -x "$bin" ]; then
    echo "fuzz: no target fuzz_$t in $build" >&2
    exit 2
  fi
  corpus="$scratch/$t"
  mkdir -p "$corpus" "$build/artifacts/$t"
  cp "$root/tests/fuzz/corpus/$t/"* "$corpus/"
  dict=()
  if [ -f "$root/tests/fuzz/dict/$t.dict" ]; then
    dict=("-dict=$root/tests/fuzz/dict/$t.dict")
  fi
  log="$scratch/$t.log"
  start=$(date +%s)
  status=0
  "$bin" "${limits[@]}" "${dict[@]}" -rss_limit_mb=4096 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$build/artifacts/$t/" "$corpus" >"$log" 2>&1 || status=$?
  seconds=$(($(date +%s) - start))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  if [ "$status" -eq 0 ]; then
    result=ok
  else
    result="FAILED (exit $status)"
    failed+=("$t")
  fi
  printf 'fuzz_%-12s %10s execs %8s exec/s %5ss  %s\n' "$t" "${execs:-?}" "${rate:-?}" \
    "$seconds" "$result"
  if [ "$status" -ne 0 ]; then
    tail -n 60 "$log" >&2
    echo "fuzz: the failing input is in $build/artifacts/$t/" >&2
  fi
done

if [ "${#failed[@]}" -ne 0 ]; then
  echo "fuzz: ${failed[*]} failed" >&2
  exit 1
fi
