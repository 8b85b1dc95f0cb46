#!/usr/bin/env bash
# The inner loop (scripts/test.sh --quick): on the existing build (${BUILD_DIR:-build}, made by
# scripts/build.sh), rebuilds what changed, compiles each changed .cpp on its own (outside its
# unity batch: scripts/compile-alone.py), then runs
#   1. the tests labelled unit (one process, under 2 s each; tests/labels.cmake), and
#   2. the tests of the files changed since origin/main (committed or not): a changed test file
#      gives its own suites; a changed file of the library gives the suites of the test files that
#      include its area's headers or sit in its area (src/amp/autocast.cpp: tests/amp/ and every
#      test file that includes "paratrain/amp/..."); a changed program (the CLI, a benchmark, an
#      example, a test worker) gives the suites of the test files that run it.
# Tests labelled slow are left out of 2 unless their own test file changed; the script names
# them. Set PARATRAIN_BASE to compare with another commit than origin/main.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${BUILD_DIR:-build}"
if [ ! -f "$build_dir/CMakeCache.txt" ]; then
  echo "test --quick: no build in $build_dir: run scripts/build.sh first (or set BUILD_DIR)" >&2
  exit 2
fi
started=$(date +%s)
cmake --build "$build_dir" -j "${PARATRAIN_BUILD_JOBS:-2}"

base="${PARATRAIN_BASE:-origin/main}"
if ! git rev-parse -q --verify "$base^{commit}" >/dev/null; then
  echo "test --quick: no commit '$base' to compare with: uncommitted changes only (set" \
    "PARATRAIN_BASE to compare with another)" >&2
  changed=$( (git diff --name-only HEAD; git ls-files --others --exclude-standard) | sort -u)
else
  changed=$( (git diff --name-only "$(git merge-base "$base" HEAD)"; git diff --name-only HEAD;
    git ls-files --others --exclude-standard) | sort -u)
fi

# The build compiles unity batches: a changed .cpp that compiles only because another file of its
# batch includes a header for it would pass there and fail in a build without them (an IDE's, a
# user's own CMake). Each is compiled on its own too.
changed_sources=()
for f in $changed; do
  case "$f" in *.cpp) [ -f "$f" ] && changed_sources+=("$f") ;; esac
done
if [ ${#changed_sources[@]} -gt 0 ]; then
  echo "test --quick: compiling the ${#changed_sources[@]} changed .cpp file(s) on their own"
  python3 scripts/compile-alone.py "$build_dir" "${changed_sources[@]}"
fi

# The suites defined in one test file (TEST, TEST_F, TEST_P; ctest names a parameterized one's
# cases PREFIX/Suite.Name/PARAM).
suites_of() {
  sed -n -E 's/^(TEST|TEST_F|TEST_P)\(([A-Za-z0-9_]+),.*/\2/p' "$1" | sort -u
}

test_files=()
direct=()
for f in $changed; do
  case "$f" in
    tests/*_test.cpp)
      [ -f "$f" ] && test_files+=("$f") && direct+=("$f")
      ;;
    src/*/* | include/paratrain/*/*)
      area=$(echo "$f" | sed -E 's#^(src|include/paratrain)/([^/]+)/.*#\2#')
      # The CLI's end-to-end tests (tests/cli) run the Trainer whatever headers they include.
      while IFS= read -r t; do test_files+=("$t"); done < <( (grep -rl "paratrain/$area/" tests \
        --include='*_test.cpp'; ls tests/"$area"/*_test.cpp 2>/dev/null
        [ "$area" = train ] && ls tests/cli/*_test.cpp) | sort -u)
      ;;
    src/* | include/paratrain/*)  # beside the areas (paratrain.h, version.h): the build checks it
      echo "test --quick: $f belongs to no area; the build above checked it" >&2
      ;;
    apps/*)  # the CLI: the tests that run it
      while IFS= read -r t; do test_files+=("$t"); done < <(grep -rlE \
        'PARATRAIN_TEST_CLI|cli_path\(\)' tests --include='*_test.cpp')
      ;;
    bench/*)  # the benchmarks: the tests that run `paratrain bench`
      while IFS= read -r t; do test_files+=("$t"); done < <(grep -rl '"bench"' tests \
        --include='*_test.cpp')
      ;;
    cmake/examples.cpp.in)  # the examples' program: the tests that run any example
      while IFS= read -r t; do test_files+=("$t"); done < <(grep -rlE \
        'PARATRAIN_TEST_[A-Z_]*(EXAMPLE|SMOKE)' tests --include='*_test.cpp')
      ;;
    examples/*.cpp | tests/programs/*.cpp)  # a program: the tests that use its path
      name=$(basename "$f" .cpp)
      # An example is a link ${CMAKE_BINARY_DIR}/bin/name to paratrain_examples; a test worker is a
      # link ${CMAKE_CURRENT_BINARY_DIR}/name to test_programs, whose main.cpp every worker shares.
      path="\\\$\{CMAKE_BINARY_DIR\}\/bin\/$name|\\\$\{CMAKE_CURRENT_BINARY_DIR\}\/$name"
      [ "$f" = tests/programs/main.cpp ] && path="\\\$\{CMAKE_CURRENT_BINARY_DIR\}\/[a-z_]+"
      for macro in $(sed -n -E "s/.*(PARATRAIN_TEST_[A-Z_]+)=\"($path)\".*/\1/p" tests/CMakeLists.txt); do
        # The tests name it by the macro, or by test_util.cpp's function that returns it.
        uses="$macro"
        accessor=$(grep -B1 "return $macro;" tests/support/test_util.cpp | sed -n -E 's/^std::string ([a-z_]+)\(\).*/\1/p')
        [ -n "$accessor" ] && uses="$macro|$accessor\\(\\)"
        while IFS= read -r t; do test_files+=("$t"); done < <(grep -rlE "$uses" tests \
          --include='*_test.cpp')
      done
      ;;
  esac
done

regex=""
if [ ${#test_files[@]} -gt 0 ]; then
  for s in $(for t in $(printf '%s\n' "${test_files[@]}" | sort -u); do suites_of "$t"; done | sort -u); do
    regex="${regex:+$regex|}$s"
  done
fi
slow_ok=""
if [ ${#direct[@]} -gt 0 ]; then
  for s in $(for t in "${direct[@]}"; do suites_of "$t"; done | sort -u); do
    slow_ok="${slow_ok:+$slow_ok|}$s"
  done
fi

cd "$build_dir"
echo "test --quick: the unit tests"
ctest -j 2 --output-on-failure --timeout 300 -L '^unit$' -LE isa-avx2
if [ -n "$regex" ]; then
  echo "test --quick: the tests of the changed files (suites: ${regex//|/, })"
  # Everything of those suites that is not unit (already run), nor slow unless its file changed.
  ctest -j 2 --output-on-failure --timeout 300 -R "(^|/)($regex)[./]" -LE '^(unit|slow|isa-avx2)$'
  if [ -n "$slow_ok" ]; then
    ctest -j 2 --output-on-failure --timeout 300 -R "(^|/)($slow_ok)[./]" -L '^slow$' -LE isa-avx2
  fi
  left=$(ctest -N -R "(^|/)($regex)[./]" -L '^slow$' -LE isa-avx2 |
    sed -n -E 's/^ *Test +#[0-9]+: //p' | grep -vE "(^|/)(${slow_ok:-^})[./]" || true)
  if [ -n "$left" ]; then
    echo "test --quick: left out, slow (run them with ctest -R NAME):"
    echo "$left" | sed 's/^/  /'
  fi
else
  echo "test --quick: no changed file since $base has tests of its own"
fi
echo "test --quick: passed in $(($(date +%s) - started)) s"
