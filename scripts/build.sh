#!/usr/bin/env bash
# Installs the system dependencies (scripts/setup.sh) and builds paratrain into ${BUILD_DIR:-build}.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
build_dir="${BUILD_DIR:-build}"
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DPARATRAIN_BUILD_TESTS=ON \
  "$@" >/dev/null
# Two jobs: each libtorch translation unit takes ~1.5 GB and this machine has 2 cores.
cmake --build "$build_dir" -j "${PARATRAIN_BUILD_JOBS:-2}"
