#!/usr/bin/env bash
# The official-libtorch CI leg: builds paratrain with -Werror against the libtorch inside PyTorch's
# wheel from PyPI (scripts/python/ci.txt pins it), with its CUDA targets configured, so that every
# CUDA path (the nccl backend, the device prefetcher, FSDP and AMP on cuda, DataParallel on GPUs,
# the GPU tests) is compiled and linked with this machine's nvcc and CUDA 13 libraries. Then it
# checks that the gloo headers (Debian's libgloo-dev) agree with the gloo inside the wheel, and runs
# the tests of code whose libtorch calls differ between versions (every test not labelled one-leg;
# tests/test_lists.cmake), the Hugging Face tests against real transformers among them. Without a GPU, the GPU
# tests skip, saying so.
#
# The wheel lives in a virtual environment kept between runs (scripts/venv.sh); the build goes to
# ${BUILD_DIR_OFFICIAL:-build-official}. PARATRAIN_TESTS=REGEX runs only the matching tests;
# `--build-only` stops after the build and the gloo check; `--tests-only` runs the tests of an
# existing build (scripts/test.sh builds in the background while leg 1 runs its tests).
set -euo pipefail
case "$#:${1:-}" in
0: | 1:--build-only | 1:--tests-only) ;;
*)
  echo "test-official: unknown arguments '$*': give none, or one of --build-only and --tests-only" >&2
  exit 2
  ;;
esac
cd "$(dirname "$0")/.."
build_dir="${BUILD_DIR_OFFICIAL:-build-official}"
source scripts/timing.sh # step NAME COMMAND...

python=$(bash scripts/venv.sh | tail -n 1)
if ! torch_dir=$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))'); then
  echo "test-official: $python cannot import torch; remove ${PARATRAIN_VENV:-/var/cache/paratrain/py}" \
    "and run again" >&2
  exit 1
fi
cuda=$("$python" -c 'import torch; print(torch.version.cuda or "")')
if [ -z "$cuda" ]; then
  echo "test-official: $python's torch has no CUDA; scripts/python/ci.txt must pin a CUDA wheel" >&2
  exit 1
fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

configure_and_build() {
  local log="$build_dir/paratrain-configure.log"
  mkdir -p "$build_dir"
  # The torch directory itself comes first: TorchConfig.cmake looks for libtorch.so in the system's
  # library directories before its own, and would take Debian's libtorch-dev from /usr/lib.
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPARATRAIN_WERROR=ON \
    -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=0 -DPARATRAIN_HEADER_CHECKS=OFF \
    -DCMAKE_PREFIX_PATH="$torch_dir;$torch_dir/share/cmake" -DGLOO_INCLUDE_DIR=/usr/include \
    -DPARATRAIN_HF_PYTHON="$python" >"$log" 2>&1 || {
    tail -n 30 "$log" >&2
    return 1
  }
  local found
  found=$(grep -E '^-- paratrain: (libtorch|backends)' "$log")
  echo "$found"
  # A CUDA libtorch that CMake did not take as one (no torch_cuda target) would leave the CUDA
  # code out without a word.
  if ! grep -q 'nccl=ON' <<<"$found" || ! grep -q 'gloo=ON' <<<"$found"; then
    echo "test-official: the build has not every backend (want gloo=ON and nccl=ON):" \
      "see $log" >&2
    return 1
  fi
  cmake --build "$build_dir" -j "${PARATRAIN_BUILD_JOBS:-2}"
}

# Debian's gloo headers (libgloo-dev) against the gloo compiled into the wheel's libtorch_cpu: for
# each gloo class whose virtual table the wheel exports and whose header c10d's
# ProcessGroupGloo.hpp reaches, the number of virtual functions on each side (a probe compiled
# with Debian's headers derives from the class and adds one). Where they differ, code compiled
# with Debian's headers must not hold that class's virtual table or functions: the check fails if
# any paratrain library defines a symbol of gloo's classes or of c10d's GlooStore (whose v2 store
# API c10d compiles only with a gloo that has it, GLOO_STORE_HAS_STORE_V2).
check_gloo() {
  local dir classes=(rendezvous::PrefixStore transport::Context transport::tcp::Device) c
  dir=$(mktemp -d /tmp/paratrain-gloo.XXXXXX)
  {
    echo '#include <gloo/rendezvous/prefix_store.h>'
    echo '#include <gloo/transport/context.h>'
    echo '#include <gloo/transport/tcp/device.h>'
    for c in "${classes[@]}"; do
      local n="Probe${c//:/_}"
      echo "struct $n : gloo::$c { virtual void paratrain_probe(); };"
      echo "void $n::paratrain_probe() {}"
    done
  } >"$dir/probe.cpp"
  # (step runs this function where set -e does not hold: every failure returns by hand)
  if ! g++ -std=c++17 -c "$dir/probe.cpp" -o "$dir/probe.o"; then
    echo "test-official: the gloo probe does not compile with Debian's headers (libgloo-dev)" >&2
    rm -rf "$dir"
    return 1
  fi
  local differ=0 ours theirs
  for c in "${classes[@]}"; do
    # nm -S prints a vtable's size in hex: two slots (offset, type), then one per function.
    ours=$(nm -SC "$dir/probe.o" | awk -v n="vtable for Probe${c//:/_}" 'index($0, n) { print $2 }')
    theirs=$(nm -DSC --defined-only "$torch_dir/lib/libtorch_cpu.so" |
      awk -v n="vtable for gloo::$c" '{ s = $0; sub(/^[^ ]+ [^ ]+ [^ ]+ /, "", s) }
        s == n { print $2 }')
    [ -z "$ours" ] || ours=$((16#$ours / 8 - 3))  # less the probe's own function
    [ -z "$theirs" ] || theirs=$((16#$theirs / 8 - 2))
    echo "test-official: gloo::$c has ${ours:-?} virtual functions in Debian's headers," \
      "${theirs:-?} in the wheel's gloo"
    if [ -z "$ours" ] || [ -z "$theirs" ]; then
      echo "test-official: no virtual table of gloo::$c to compare" >&2
      rm -rf "$dir"
      return 1
    fi
    [ "$ours" = "$theirs" ] || differ=1
  done
  rm -rf "$dir"
  local emitted lib symbols=""
  for lib in libparatrain_launch.so libparatrain.so libparatrain_commands.so; do
    if ! symbols+=$(nm -DC --defined-only "$build_dir/$lib")$'\n'; then
      echo "test-official: cannot read $build_dir/$lib's symbols" >&2
      return 1
    fi
  done
  emitted=$(grep -E ' (gloo::|c10d::ProcessGroupGloo::GlooStore)' <<<"$symbols" || true)
  if [ -n "$emitted" ]; then
    echo "test-official: paratrain's libraries define gloo code compiled with Debian's headers," \
      "which differ from the wheel's gloo:" >&2
    echo "$emitted" | head -n 20 >&2
    return 1
  fi
  if [ "$differ" -eq 1 ]; then
    echo "test-official: the headers differ, and paratrain's libraries define no gloo code" \
      "compiled with them: they reach gloo only through libtorch's c10d functions"
  fi
}

if [ "${1:-}" != "--tests-only" ]; then
  step "official build (torch $("$python" -c 'import torch; print(torch.__version__)'))" \
    configure_and_build
  step "official gloo check" check_gloo
fi
if [ "${1:-}" = "--build-only" ]; then exit 0; fi
# shellcheck disable=SC2086
# Not the cases that leg 1 repeats with the instruction set capped (isa-avx2): which CPU kernels
# run is what they check, and leg 1 checks it.
step "official tests" env ${PARATRAIN_CTEST_ENV:-OMP_NUM_THREADS=1} bash -c \
  "cd '$build_dir' && ctest -j 2 --output-on-failure --timeout 300 -LE 'one-leg|isa-avx2' \
    -R '${PARATRAIN_TESTS:-.}'"
