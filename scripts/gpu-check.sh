#!/usr/bin/env bash
# On a machine whose python3 holds a CUDA PyTorch: builds paratrain against that PyTorch's
# libtorch (with -Werror), runs the whole suite, then compares `paratrain train` with PyTorch on
# ResNet-50 at 224x224, O1 fp16, batch 64 (bench/train_pytorch.py, data already on the GPU), and
# FSDP with its optimizer offloaded to the host against Adam on the GPU (bench offload).
#
# What the machine lacks comes from ${PARATRAIN_GPU_DEPS:-.gpu-deps}, made by scripts/gpu-deps.sh
# on a Debian machine: gloo's headers, GoogleTest's sources, zlib's headers, the image libraries,
# Fashion-MNIST.
# Results: ${OUT:-/tmp/paratrain-gpu-check}/{build,ctest,speed}.log.
set -euo pipefail
cd "$(dirname "$0")/.."
deps="$(realpath "${PARATRAIN_GPU_DEPS:-.gpu-deps}")"
python="${PYTHON:-python3}"
build="${BUILD_DIR:-build-gpu}"
out="${OUT:-/tmp/paratrain-gpu-check}"
mkdir -p "$out"

# The torch directory first, then its CMake files: TorchConfig.cmake looks for libtorch.so in the
# system's library directories before its own (as scripts/test-official.sh does).
torch_dir=$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
prefix="$torch_dir;$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
"$python" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))'

# The dataset where paratrain looks for it by default.
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  mkdir -p /usr/share/datasets/fashion-mnist
  cp "$deps"/fashion-mnist/*.gz /usr/share/datasets/fashion-mnist/
fi
zlib=$(ldconfig -p | awk '/libz\.so(\.1)? .*x86-64/ {print $NF; exit}')
# The image libraries live in $deps/lib, inside the checkout, so CMake leaves them out of the
# installed library's RUNPATH (it adds only link directories outside the project): the consumer
# project's link and run (ctest's consumer_project) find them here, as on a machine where they are
# installed system-wide.
export LD_LIBRARY_PATH="$deps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
{
  # A unity build, as CI's (scripts/test.sh).
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DPARATRAIN_WERROR=ON \
    -DCMAKE_UNITY_BUILD=ON \
    -DCMAKE_PREFIX_PATH="$prefix;$deps" -DGLOO_INCLUDE_DIR="$deps/include" \
    -DZLIB_INCLUDE_DIR="$deps/include" -DZLIB_LIBRARY="$zlib" \
    -DPARATRAIN_GTEST_SOURCE_DIR="$deps/googletest" -DPARATRAIN_TEST_PYTHON="$(command -v "$python")"
  cmake --build "$build" -j "$(nproc)" -- -k 0
} 2>&1 | tee "$out/build.log"

status=0
# PARATRAIN_CTEST_ARGS: more ctest arguments, e.g. "--stop-time 12:30:00" to fit a time budget.
# Two intra-op threads per process: ctest runs nproc/2 tests at a time, most of them with two or
# three processes, and libtorch otherwise gives every process a thread per core.
# shellcheck disable=SC2086
(cd "$build" && OMP_NUM_THREADS=2 ctest -j "$(($(nproc) / 2))" --output-on-failure --timeout 300 \
  ${PARATRAIN_CTEST_ARGS:-}) 2>&1 | tee "$out/ctest.log" || status=1

# The speed comparison of docs/building.md ("Using an official libtorch (CUDA)"): images per second of
# one epoch's first steps, paratrain train against PyTorch with the batch already on the GPU.
{
  echo "== PyTorch, data already on the GPU"
  "$python" bench/train_pytorch.py --model resnet50 --image-size 224 --batch-size 64 --amp fp16 \
    --steps 60 --warmup 10
  echo "== paratrain train"
  # Two epochs of 100 steps: the second one's images/s is the steady state.
  "$build/bin/paratrain" train --model resnet50 --image-size 224 --channels 3 --batch-size 64 \
    --amp O1 --amp-dtype fp16 --epochs 2 --steps 100 --workers 4 --lr 0.01 --json
  # ZeRO-Offload against FSDP with Adam on the GPU, GPT-2's shape (docs/benchmarks.md, "offload").
  echo "== paratrain bench offload, GPT-2's shape"
  "$build/bin/paratrain" bench offload --json --device cuda --nproc-per-node 1 --layers 12 \
    --width 768 --heads 12 --vocab 50257 --context 1024 --batch-size 8 --steps 10
} 2>&1 | tee "$out/speed.log" || status=1
exit $status
