#!/usr/bin/env bash
# Gathers, on a Debian machine with paratrain's set-up done (scripts/setup.sh), what a GPU machine
# with only a CUDA PyTorch lacks: gloo's headers, GoogleTest's sources, zlib's headers and the
# Fashion-MNIST files. They go to ${1:-.gpu-deps} (ignored by git) for scripts/gpu-check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.gpu-deps}"
rm -rf "$out"
mkdir -p "$out/include" "$out/fashion-mnist"
cp -r /usr/include/gloo "$out/include/"
cp /usr/include/zlib.h /usr/include/zconf.h "$out/include/"
cp -r /usr/src/googletest "$out/googletest"
cp /usr/share/datasets/fashion-mnist/*.gz "$out/fashion-mnist/"
du -sh "$out"
