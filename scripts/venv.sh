#!/usr/bin/env bash
# The Python virtual environment of PyPI packages that the official-libtorch leg and the
# benchmarks use: PyTorch's wheel (whose libtorch, with CUDA, the leg builds against) and
# transformers (scripts/python/ci.txt), and with --bench also Ray Tune, current Optuna and what
# their searchers need (scripts/python/bench.txt). Made once per machine in
# ${PARATRAIN_VENV:-/var/cache/paratrain/py} (about 6 GB, most of it CUDA's libraries) and kept
# between runs, as the Debian 13 root is; made again when a pinned file changes. Prints the
# environment's python on its last line.
#
#   scripts/venv.sh            the CI set
#   scripts/venv.sh --bench    the CI set and the benchmarks' anchors
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${PARATRAIN_VENV:-/var/cache/paratrain/py}"
sets=(scripts/python/ci.txt)
if [ "${1:-}" = "--bench" ]; then
  sets+=(scripts/python/bench.txt)
elif [ -n "${1:-}" ]; then
  echo "venv: unknown argument '$1': give --bench or nothing" >&2
  exit 2
fi
base_python="${PARATRAIN_BASE_PYTHON:-python3}"
if ! command -v "$base_python" >/dev/null 2>&1; then
  echo "venv: no $base_python on PATH to make $venv with; install Python 3.10 or newer" >&2
  exit 1
fi

# One pip at a time in the environment: CI's background run and a developer's --bench may meet.
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9

# The stamp holds the requirement files installed last, as they were, so that a changed pin (or a
# reverted one) or a set not installed yet installs again, and an environment whose making was cut
# short (no stamp) is made whole. A run without --bench accepts an environment made with it.
stamp="$venv/.paratrain-requirements"
want=$(cat "${sets[@]}")
have=$(cat "$stamp" 2>/dev/null || true)
# A venv whose ensurepip step failed has a python but no pip: made again.
if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  rm -rf "$venv"
  "$base_python" -m venv "$venv"
  have=""
fi
if [ "$have" != "$want" ] && [ "$have" != "$(cat scripts/python/ci.txt scripts/python/bench.txt)" ]; then
  echo "venv: installing $(IFS=' '; echo "${sets[*]}") into $venv" >&2
  rm -f "$stamp"
  args=()
  for f in "${sets[@]}"; do args+=(-r "$f"); done
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${args[@]}" >&2
  echo "$want" >"$stamp"
fi
echo "$venv/bin/python"
