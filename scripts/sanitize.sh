#!/usr/bin/env bash
# Sanitizer runs (outside CI: each is a full build of its own).
#   bash scripts/sanitize.sh asan [ctest -R regex]   AddressSanitizer + UndefinedBehaviorSanitizer
#   bash scripts/sanitize.sh tsan [ctest -R regex]   ThreadSanitizer
# Default test sets: asan runs the whole suite but the heaviest training jobs; tsan runs the tests
# of what paratrain threads itself: WorkerTeam (DataParallel, Pipeline), the mpi backend's worker
# thread, the DDP hooks and the launcher. libtorch itself is not instrumented: its own reports are
# suppressed in tests/sanitizers/*.supp, each with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:?usage: sanitize.sh asan|tsan [test regex]}"
supp="$(pwd)/tests/sanitizers"
case "$kind" in
  asan)
    flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
    default='.'
    exclude='MixedPrecision.EveryOptLevel|Train.CustomResNet|Train.ModelParallel|Bench\.|header_compiles|consumer'
    # keep_modules.so (see the file, preloaded into the tests only) lets lsan.supp name Open MPI's
    # components; ASan then is not the first library loaded, harmless here.
    preload_keep_modules=1
    export ASAN_OPTIONS="detect_leaks=1:suppressions=$supp/asan.supp:detect_odr_violation=0:verify_asan_link_order=0"
    export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
    export UBSAN_OPTIONS="suppressions=$supp/ubsan.supp:print_stacktrace=1:halt_on_error=1"
    ;;
  tsan)
    flags="-fsanitize=thread -fno-omit-frame-pointer"
    default='DataParallel|Pipeline\.|Ddp\.|Launch\.|Backends/Collectives\.|BadInput.Mpi|Spawn\.'
    exclude='header_compiles|consumer'
    export TSAN_OPTIONS="suppressions=$supp/tsan.supp:halt_on_error=1:second_deadlock_stack=1"
    # libgomp (libtorch's OpenMP) is not instrumented and its barriers look like races.
    export OMP_NUM_THREADS=1
    ;;
  *)
    echo "sanitize.sh: unknown sanitizer '$kind': choose asan or tsan" >&2
    exit 2
    ;;
esac
build="${BUILD_DIR:-build-$kind}"
bash scripts/setup.sh
# -O1 -g1: what the sanitizers' docs recommend for readable reports; it also builds faster than -O2 -g.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPARATRAIN_BUILD_TESTS=ON \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" \
  -DCMAKE_SHARED_LINKER_FLAGS="$flags" >/dev/null
cmake --build "$build" -j "${PARATRAIN_BUILD_JOBS:-2}"
cd "$build"
if [[ -n "${preload_keep_modules:-}" ]]; then
  "${CC:-cc}" -shared -fPIC -O2 -o keep_modules.so "$supp/keep_modules.c"
  export LD_PRELOAD="$(pwd)/keep_modules.so${LD_PRELOAD:+:$LD_PRELOAD}"
fi
ctest -j 2 --output-on-failure --timeout 900 -R "${2:-$default}" -E "$exclude"
