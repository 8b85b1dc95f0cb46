#!/usr/bin/env bash
# The main job, on a fresh machine: set-up, the build (the same as the tests', scripts/build.sh),
# what this build offers, then 2-rank DDP training of the MLP on Fashion-MNIST (reaches about 86%
# test accuracy in 3 epochs, well under a minute on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/timing.sh
step "main job: set-up and build" bash scripts/build.sh
bin="${BUILD_DIR:-build}/bin"
"$bin/paratrain" info
step "main job: training" "$bin/paratrain" train --model mlp --dataset fashion-mnist \
  --strategy ddp --nproc-per-node 2 --epochs 3 --batch-size 64 --lr 0.05 --momentum 0.9 --seed 0 "$@"
