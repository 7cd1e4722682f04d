// main() of the gpu-labelled test binaries: GoogleTest's, except that it exits 77 when every
// test that was to run skipped (GTEST_SKIP: no GPU, or too few), which ctest reports as
// skipped (SKIP_RETURN_CODE) instead of passed.
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int result = RUN_ALL_TESTS();
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  if (result == 0 && unit.test_to_run_count() > 0 &&
      unit.skipped_test_count() == unit.test_to_run_count()) {
    return 77;
  }
  return result;
}
