#!/usr/bin/env bash
# Installs the system dependencies (scripts/setup.sh) and builds paratrain into ${BUILD_DIR:-build}.
# The README's two commands share this one build (the main job's, then the tests' first leg):
# warnings are errors, and each target compiles as one unity batch, since every translation unit
# that includes libtorch's headers pays 13-20 CPU-seconds whatever it holds (docs/building.md).
# Arguments are added to cmake's (later -D options win): -DCMAKE_UNITY_BUILD=OFF builds file by
# file, as an IDE does, which must compile too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
build_dir="${BUILD_DIR:-build}"
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DPARATRAIN_BUILD_TESTS=ON \
  -DPARATRAIN_WERROR=ON -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=0 "$@" >/dev/null
# Two jobs: each libtorch translation unit takes ~1.5 GB and this machine has 2 cores.
cmake --build "$build_dir" -j "${PARATRAIN_BUILD_JOBS:-2}"
