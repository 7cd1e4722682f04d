// Test data in the source tree: ctest sets LATHE_SOURCE_DIR (cmake/LatheTargets.cmake); a
// binary run by hand from the source root finds the same files.
#ifndef LATHE_TESTS_TESTING_SOURCE_PATH_H_
#define LATHE_TESTS_TESTING_SOURCE_PATH_H_

#include <cstdlib>
#include <string>

namespace lathe::testing {

// <LATHE_SOURCE_DIR or .>/<relative>
inline std::string SourcePath(const std::string& relative) {
  const char* root = std::getenv("LATHE_SOURCE_DIR");
  return std::string(root != nullptr ? root : ".") + "/" + relative;
}

}  // namespace lathe::testing

#endif  // LATHE_TESTS_TESTING_SOURCE_PATH_H_
