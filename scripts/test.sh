#!/usr/bin/env bash
# The whole test suite on a fresh machine: set-up, build, formatting check, then every test
# through ctest.
# Multi-process tests start real processes on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
bash scripts/check-format.sh
cd "${BUILD_DIR:-build}"
ctest -j 2 --output-on-failure --timeout 300
