#!/usr/bin/env bash
# Installs every system dependency of paratrain on Debian 12 with apt. Idempotent: packages already
# present are skipped, so the README's commands can call it on every run.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config git
  clang-format          # scripts/check-format.sh
  clang libclang-rt-14-dev  # libFuzzer and the sanitizers' runtimes (scripts/fuzz.sh)
  libtorch-dev          # libtorch 1.13.1 (CPU), with c10d (Gloo, TCPStore)
  libgloo-dev           # headers that c10d's ProcessGroupGloo.hpp includes
  libopenblas0-pthread  # without it libtorch falls back to the reference BLAS (5x slower)
  libopenmpi-dev openmpi-bin
  zlib1g-dev
  nlohmann-json3-dev    # checkpoint manifests, metrics, configs
  libcli11-dev          # the CLI's command lines and --config TOML files
  libprotobuf-dev protobuf-compiler  # TensorBoard's Event protobufs (--tensorboard)
  python3-protobuf python3-crc32c    # the tests' independent reader of those event files
  libsqlite3-dev libpq-dev  # paratrain tune's studies: SQLite files, PostgreSQL databases
  postgresql            # the server the tune tests start (initdb in a temporary directory)
  chromium chromium-driver  # headless: the tune report and dashboard tests render their pages
  libcpp-httplib-dev    # paratrain tune serve (the dashboard), and the launcher's etcd client
  etcd-server           # the etcd the rendezvous tests start (--rdzv-backend etcd)
  iproute2              # the multi-host tests' network namespaces (ip netns, veth, bridge)
  debootstrap           # the second CI leg's Debian 13 root (scripts/test-libtorch2.sh)
  slurmctld slurmd slurm-client munge  # the Slurm tests start a real one-node Slurm
  python3-optuna        # paratrain bench tune's comparison (bench/tune_optuna.py)
  libturbojpeg0-dev libpng-dev libwebp-dev  # ImageFolder decoding: TurboJPEG, libpng, libwebp
  dataset-fashion-mnist
  libgtest-dev googletest
  python3-torch         # /usr/bin/python3's torch: the reference for PyTorch behaviour and speed
  python3-torchvision   # torchvision weights for the model-zoo import tests
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >&2
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
