// The test binary's main: GoogleTest's, but a run whose every case skipped exits 77, which ctest
// reports as skipped (SKIP_RETURN_CODE, tests/CMakeLists.txt). ctest runs a suite's cases as one
// test, and a suite that skipped whole (no network namespaces, no PostgreSQL, no GPU) must not
// read as passed. A suite that ran some cases and skipped others passes, and GoogleTest's output
// names the skipped ones with their reasons.

#include <gtest/gtest.h>

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  const int status = RUN_ALL_TESTS();
  const testing::UnitTest& run = *testing::UnitTest::GetInstance();
  if (status == 0 && run.test_to_run_count() > 0 &&
      run.skipped_test_count() == run.test_to_run_count()) {
    return 77;
  }
  return status;
}
