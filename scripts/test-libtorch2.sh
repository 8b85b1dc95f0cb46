#!/usr/bin/env bash
# The Debian 13 CI leg: builds paratrain with -Werror (GCC 14) against Debian 13's libtorch-dev
# (2.6) and makes a smoke run, in a debootstrap root made here and kept between runs on the same
# machine (${PARATRAIN_TRIXIE_ROOT:-/var/cache/paratrain/trixie}; about 2.3 GB). The checkout is
# bound into the root, and the build goes to ${BUILD_DIR_LIBTORCH2:-build-libtorch2} in it.
#
# PARATRAIN_TESTS=REGEX builds the tests too and runs the matching ones (a suite's cases are one
# test, SUITE.*; tests/CMakeLists.txt), but those labelled one-leg; PARATRAIN_CTEST_ENV adds
# environment (scripts/test.sh's ISA cap). Needs root (or
# sudo) for debootstrap, chroot and the mounts. `--root-only` makes the root and stops;
# `--build-only` stops after the build; `--smoke-only` runs the smoke run (or the tests) of an
# existing build (scripts/test.sh builds in the background, after the official leg's build).
# One run at a time uses a root: another waits (up to 10 minutes).
set -euo pipefail
case "$#:${1:-}" in
0: | 1:--root-only | 1:--build-only | 1:--smoke-only) ;;
*)
  echo "test-libtorch2: unknown arguments '$*': give none, or one of --root-only, --build-only" \
    "and --smoke-only" >&2
  exit 2
  ;;
esac
cd "$(dirname "$0")/.."
src=$(pwd)
# Absolute and without symbolic links, as /proc/mounts names the mounts inside it.
root=$(realpath -m -- "${PARATRAIN_TRIXIE_ROOT:-/var/cache/paratrain/trixie}")
build_dir="${BUILD_DIR_LIBTORCH2:-build-libtorch2}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
  # Without a terminal (scripts/test.sh's background build) sudo fails rather than asks.
  [ -t 0 ] || SUDO="sudo -n"
fi
# One run at a time: what is mounted inside the root when this run starts is then a stopped
# run's (the checkout is bound in there), and is unmounted.
[ -d "$(dirname "$root")" ] || $SUDO install -d -m 0755 "$(dirname "$root")"
exec 9<"$(dirname "$root")"
if ! flock -n 9; then
  echo "test-libtorch2: another run uses $root; waiting for it" >&2
  flock -w 600 9 || {
    echo "test-libtorch2: $root is still in use after 10 minutes (see: sudo fuser -v $(dirname "$root"))" >&2
    exit 1
  }
fi
# A command inside the root, without fd 9 (the lock): a process left behind there (a daemon that a
# package's script started) would hold it for the next run.
chroot_run() { $SUDO chroot "$root" "$@" 9<&-; }
mounts_inside() { awk -v r="$root" '$2 == r || index($2, r "/") == 1 { print $2 }' /proc/mounts; }
unmount_leftovers() {
  mounts_inside | sort -r | while read -r m; do $SUDO umount -l "$m" </dev/null || true; done
}

# What the build and this leg's tests need inside the root: scripts/setup.sh's list in trixie's
# names, less what only first-leg tests use (tests/test_lists.cmake: PostgreSQL, Chromium, Slurm, the
# Python readers of TensorBoard files), which would add minutes to the root's making.
packages=(libtorch-dev g++ cmake ninja-build ccache pkg-config libgloo-dev zlib1g-dev nlohmann-json3-dev
  libcli11-dev libprotobuf-dev protobuf-compiler libsqlite3-dev libpq-dev libcpp-httplib-dev iproute2
  libturbojpeg0-dev libpng-dev libwebp-dev
  libgtest-dev googletest libopenmpi-dev openmpi-bin libopenblas0-pthread dataset-fashion-mnist
  python3-torch python3-torchvision ca-certificates)
stamp="$root/.paratrain-packages"
want="${packages[*]}"

mirror() {
  # The Debian mirror this machine already uses (deb822 or one-line sources).
  local uri
  uri=$(grep -hoE '^URIs: *[^ ]+' /etc/apt/sources.list.d/*.sources 2>/dev/null |
    grep -v security | head -n 1 | sed 's/^URIs: *//') || true
  if [ -z "$uri" ]; then
    uri=$(grep -hoE '^deb +[^ ]+' /etc/apt/sources.list 2>/dev/null | head -n 1 | awk '{print $2}') || true
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # A root whose debootstrap did not finish (a run stopped while making it) is made again; one
  # with a stamp was finished by an earlier version of this script.
  if [ ! -f "$root/.paratrain-debootstrapped" ] && [ ! -f "$stamp" ]; then
    if ! command -v debootstrap >/dev/null 2>&1; then
      $SUDO apt-get update -q >&2
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
        debootstrap >&2
    fi
    echo "test-libtorch2: making a Debian 13 root in $root (once per machine)" >&2
    # What a stopped run left mounted inside it first, then the rest; never a removal across a
    # mount that is still there.
    unmount_leftovers
    if [ -n "$(mounts_inside)" ]; then
      echo "test-libtorch2: $root still has mounts inside it ($(mounts_inside | tr '\n' ' '));" \
        "unmount them, then run again" >&2
      exit 1
    fi
    $SUDO rm -rf --one-file-system "$root"
    $SUDO mkdir -p "$root"
    # A bare root, then apt inside it: debootstrap's own resolver skips alternatives (libtorch's
    # dependencies need them).
    $SUDO debootstrap --variant=minbase trixie "$root" "$(mirror)" >&2 9<&-
    $SUDO touch "$root/.paratrain-debootstrapped"
  fi
  $SUDO cp /etc/resolv.conf "$root/etc/resolv.conf"
  $SUDO mount -t proc proc "$root/proc"
  trap '$SUDO umount -l "$root/proc" 2>/dev/null || true' EXIT
  # Packages a stopped run left unpacked but not configured (apt refuses to go on otherwise).
  chroot_run env DEBIAN_FRONTEND=noninteractive dpkg --configure -a >&2
  chroot_run apt-get update -q >&2
  # Without dpkg's fsync after every file: 2.3 GB of fsyncs slow the first leg's build, which runs
  # meanwhile. The cost: after a power loss while the root was made, remove it (rm -rf $root).
  chroot_run env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
    -o Dpkg::Options::=--force-unsafe-io --no-install-recommends "${packages[@]}" >&2
  chroot_run apt-get clean
  $SUDO umount -l "$root/proc"
  trap - EXIT
  echo "$want" | $SUDO tee "$stamp" >/dev/null
fi
if [ "${1:-}" = "--root-only" ]; then exit 0; fi

# /proc, /sys and /dev for the tests (processes, /dev/shm for Open MPI), and the checkout itself,
# after what a run stopped by a signal left there.
unmount_leftovers
mounts=()
cleanup() {
  local i
  # `ip netns add` (the multi-host tests) leaves its bind mount of /run/netns behind.
  $SUDO umount -l "$root/run/netns" 2>/dev/null || true
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    $SUDO umount -l "${mounts[$i]}" 2>/dev/null || true
  done
}
trap cleanup EXIT
mount_in() { # mount_in TARGET ARGS...
  local target="$root$1"
  shift
  $SUDO mkdir -p "$target"
  $SUDO mount "$@" "$target"
  mounts+=("$target")
}
# The root on itself: `ip netns exec` (the multi-host tests) remounts "/", which must then be a
# mount point inside the chroot.
mount_in / --bind "$root"
mount_in /proc -t proc proc
# /sys: oneDNN reads the CPU's cache sizes there (without them it divides by zero), and Open MPI's
# hwloc its topology and network interfaces.
mount_in /sys --bind /sys
mount_in /dev --bind /dev
mount_in /dev/shm -t tmpfs tmpfs
mount_in /dev/pts -t devpts devpts
mount_in /tmp -t tmpfs tmpfs
mount_in /work/paratrain --bind "$src"

# Inside: the first leg's build (scripts/build.sh), less what the first leg checks once for all
# (formatting, each public header on its own, the docs' snippets), and without the tests unless
# PARATRAIN_TESTS names some (then those not labelled one-leg: tests/test_lists.cmake).
in_root() { # in_root SCRIPT: runs SCRIPT with bash in the root, in the checkout
  # shellcheck disable=SC2086
  chroot_run env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LANG=C.UTF-8 CI="${CI:-}" PARATRAIN_TESTS="${PARATRAIN_TESTS:-.}" \
    ${CCACHE_DISABLE:+CCACHE_DISABLE="$CCACHE_DISABLE"} \
    PARATRAIN_BUILD_JOBS="${PARATRAIN_BUILD_JOBS:-2}" \
    ${PARATRAIN_CTEST_ENV:-} bash -c "set -euo pipefail
    cd /work/paratrain
    $1"
}
timed() { # timed NAME SCRIPT: in_root, and the seconds go to $PARATRAIN_TIMINGS when it is set
  local t0 rc=0 name="$1"
  t0=$(date +%s)
  in_root "$2" || rc=$?
  if [ "$rc" -ne 0 ]; then name="$name (failed)"; fi
  if [ -n "${PARATRAIN_TIMINGS:-}" ]; then
    echo "$name $(($(date +%s) - t0))" >>"$PARATRAIN_TIMINGS"
  fi
  return "$rc"
}
# Without the tests: the official leg builds and runs them on a 2.x libtorch; this leg adds
# Debian 13's libtorch 2.6 and GCC 14's warnings on the library and its programs, and a smoke run:
# `paratrain info` and the main job's DDP training, shortened (one epoch of 100 steps on two ranks).
# PARATRAIN_TESTS=REGEX builds the tests too and runs those instead.
tests=OFF
if [ "${PARATRAIN_TESTS:-.}" != . ]; then tests=ON; fi
if [ "${1:-}" != "--smoke-only" ]; then
  timed "leg 2 build" "
  cmake -S . -B '$build_dir' -G Ninja -DCMAKE_BUILD_TYPE=Release -DPARATRAIN_BUILD_TESTS=$tests \
    -DPARATRAIN_WERROR=ON -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=0 \
    -DPARATRAIN_HEADER_CHECKS=OFF -DPARATRAIN_DOCS_SNIPPETS=OFF >/dev/null
  cmake --build '$build_dir' -j \${PARATRAIN_BUILD_JOBS:-2}"
fi
if [ "${1:-}" = "--build-only" ]; then exit 0; fi
timed "leg 2 smoke run" "
  cd '$build_dir'
  if [ $tests = ON ]; then
    ctest -j 2 --output-on-failure --timeout 300 -LE one-leg -R \"\$PARATRAIN_TESTS\"
  else
    bin/paratrain info
    bin/paratrain train --model mlp --dataset fashion-mnist --strategy ddp --nproc-per-node 2 --epochs 1 \\
      --batch-size 64 --lr 0.05 --momentum 0.9 --seed 0 --steps 100
  fi"
