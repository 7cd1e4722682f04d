// What the fuzz targets share: how a target reports a broken property. It prints the target,
// the property and the detail, then aborts, which libFuzzer records as a crash and keeps the
// input (build/fuzz/artifacts/<target>/).
#ifndef LATHE_FUZZ_FUZZ_CHECK_H_
#define LATHE_FUZZ_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>

#include "absl/strings/string_view.h"

namespace lathe {

[[noreturn]] inline void FuzzFail(const char* target, const char* what,
                                  absl::string_view detail = "") {
  std::fprintf(stderr, "%s: %s%s%.*s\n", target, what, detail.empty() ? "" : ": ",
               static_cast<int>(detail.size()), detail.data());
  std::abort();
}

}  // namespace lathe

#endif  // LATHE_FUZZ_FUZZ_CHECK_H_
