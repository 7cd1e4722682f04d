// The machine's memory: MemTotal of /proc/meminfo. The agent reports it when it registers;
// the planner falls back on it for a CPU job when no worker has reported (docs/planner.md).
//
// Thread-safety: free functions; safe to call concurrently.
#ifndef LATHE_COMMON_HOST_MEMORY_H_
#define LATHE_COMMON_HOST_MEMORY_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lathe {

// MemTotal of /proc/meminfo text, in bytes. INVALID_ARGUMENT when it is missing or garbled.
absl::StatusOr<uint64_t> ParseMemTotalBytes(absl::string_view meminfo);
// The host's memory from /proc/meminfo; NOT_FOUND / INTERNAL when it cannot be read.
absl::StatusOr<uint64_t> HostMemoryBytes();

}  // namespace lathe

#endif  // LATHE_COMMON_HOST_MEMORY_H_
