#!/usr/bin/env bash
# The main job, on a fresh machine: set-up, build, what this build offers, and a 2-rank allreduce
# on each CPU backend through `paratrain launch`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
bin="${BUILD_DIR:-build}/bin"
"$bin/paratrain" info
"$bin/paratrain" launch --standalone --nproc-per-node 2 --backend gloo -- "$bin/allreduce_smoke"
if "$bin/paratrain" info --json | grep -q '"mpi"'; then
  "$bin/paratrain" launch --nproc-per-node 2 --backend mpi -- "$bin/allreduce_smoke"
fi
