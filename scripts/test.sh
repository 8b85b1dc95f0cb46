#!/usr/bin/env bash
# The whole test suite on a fresh machine, in two legs:
#   1. Debian 12's libtorch 1.13 (CPU): set-up, build with -Werror, formatting check, every test
#      through ctest;
#   2. Debian 13's libtorch 2.6 (CPU), in a debootstrap root kept between runs on the same
#      machine: the same build and tests (scripts/test-libtorch2.sh).
# PARATRAIN_LEGS=1 or PARATRAIN_LEGS=2 runs one leg only. Multi-process tests start real processes
# on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
legs="${PARATRAIN_LEGS:-1 2}"
started=$(date +%s)
if [[ " $legs " == *" 1 "* ]]; then
  bash scripts/build.sh -DPARATRAIN_WERROR=ON
  bash scripts/check-format.sh
  (cd "${BUILD_DIR:-build}" && ctest -j 2 --output-on-failure --timeout 300)
  echo "test: leg 1 (libtorch 1.13) passed after $(($(date +%s) - started)) s"
fi
if [[ " $legs " == *" 2 "* ]]; then
  bash scripts/test-libtorch2.sh
  echo "test: leg 2 (libtorch 2.6) passed; both legs took $(($(date +%s) - started)) s"
fi
