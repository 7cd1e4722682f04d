// The process's limit on open files (RLIMIT_NOFILE). The daemons raise the soft limit to the
// hard one at start: the soft limit is often 1,024 (a login shell, systemd's default) where
// the hard one allows far more, and every connection, file and socket takes one. Issue #27:
// a coordinator at its limit could not accept connections.
//
// Thread-safety: call RaiseFdLimit at start, before other threads open files.
#ifndef LATHE_COMMON_FD_LIMIT_H_
#define LATHE_COMMON_FD_LIMIT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace lathe {

struct FdLimit {
  uint64_t soft = 0;  // in effect
  uint64_t hard = 0;
  uint64_t soft_before = 0;  // before RaiseFdLimit
};

// Raises the soft limit to the hard limit (children inherit it). INTERNAL naming the call
// when the limit cannot be read or set (it is unchanged then).
absl::StatusOr<FdLimit> RaiseFdLimit();

// "open files: limit 65536 (raised from 1024; hard limit 65536)", for the log.
std::string DescribeFdLimit(const FdLimit& limit);

}  // namespace lathe

#endif  // LATHE_COMMON_FD_LIMIT_H_
