#!/usr/bin/env bash
# Fails when a C++ file differs from the committed .clang-format.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null 2>&1; then
  echo "check-format: clang-format not installed (apt-get install clang-format)" >&2
  exit 1
fi
files=$(git ls-files '*.cpp' '*.h' '*.hpp' '*.cc' 2>/dev/null || find include src apps bench tests examples -name '*.cpp' -o -name '*.h')
bad=0
for f in $files; do
  if ! clang-format --dry-run --Werror "$f" >/dev/null 2>&1; then
    echo "check-format: $f is not formatted (run: clang-format -i $f)" >&2
    bad=1
  fi
done
exit $bad
