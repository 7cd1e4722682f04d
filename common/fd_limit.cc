#include "common/fd_limit.h"

#include <errno.h>
#include <string.h>
#include <sys/resource.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"

namespace lathe {
namespace {

// The kernel refuses a limit on open files above fs.nr_open, which an unlimited hard limit
// would ask for.
rlim_t KernelMaximum() {
  absl::StatusOr<std::string> text = ReadFile("/proc/sys/fs/nr_open");
  uint64_t value = 0;
  if (text.ok() && absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &value)) return value;
  return 1 << 20;  // the kernel's default
}

}  // namespace

absl::StatusOr<FdLimit> RaiseFdLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::InternalError(absl::StrCat("getrlimit(RLIMIT_NOFILE): ", strerror(errno)));
  }
  FdLimit result{limit.rlim_cur, limit.rlim_max, limit.rlim_cur};
  const rlim_t target = limit.rlim_max == RLIM_INFINITY ? KernelMaximum() : limit.rlim_max;
  if (limit.rlim_cur != RLIM_INFINITY && limit.rlim_cur < target) {
    rlimit raised{target, limit.rlim_max};
    if (setrlimit(RLIMIT_NOFILE, &raised) != 0) {
      return absl::InternalError(
          absl::StrCat("setrlimit(RLIMIT_NOFILE, ", target, "): ", strerror(errno)));
    }
    result.soft = target;
  }
  return result;
}

std::string DescribeFdLimit(const FdLimit& limit) {
  const std::string hard = limit.hard == RLIM_INFINITY ? "unlimited" : absl::StrCat(limit.hard);
  if (limit.soft == limit.soft_before) {
    return absl::StrCat("open files: limit ", limit.soft, " (hard limit ", hard, ")");
  }
  return absl::StrCat("open files: limit ", limit.soft, " (raised from ", limit.soft_before,
                      "; hard limit ", hard, ")");
}

}  // namespace lathe
