#!/usr/bin/env bash
# The compiler launcher of the header checks (tests/CMakeLists.txt): runs COMPILER, through the
# launchers given before "--" (ccache), in place of the project's compiler that CMake puts first.
#   header-check-compiler.sh COMPILER [LAUNCHER...] -- PROJECT_COMPILER ARGS...
set -euo pipefail
compiler=$1
shift
launcher=()
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
  launcher+=("$1")
  shift
done
shift 2 # "--" and the project's compiler
exec "${launcher[@]}" "$compiler" "$@"
