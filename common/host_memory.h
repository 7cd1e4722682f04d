// The machine's memory: MemTotal of /proc/meminfo. The agent reports it when it registers
// (and MemAvailable in its metrics); the planner falls back on it for a CPU job when no
// worker has reported (docs/planner.md).
//
// Thread-safety: free functions; safe to call concurrently.
#ifndef LATHE_COMMON_HOST_MEMORY_H_
#define LATHE_COMMON_HOST_MEMORY_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lathe {

// `field` ("MemTotal", "MemAvailable") of /proc/meminfo text, in bytes. INVALID_ARGUMENT
// when it is missing or garbled.
absl::StatusOr<uint64_t> ParseMeminfoBytes(absl::string_view meminfo, absl::string_view field);
absl::StatusOr<uint64_t> ParseMemTotalBytes(absl::string_view meminfo);
// The host's memory from /proc/meminfo; NOT_FOUND / INTERNAL when it cannot be read.
absl::StatusOr<uint64_t> HostMemoryBytes();
// What the host has available now (MemAvailable), the same way.
absl::StatusOr<uint64_t> HostAvailableMemoryBytes();

}  // namespace lathe

#endif  // LATHE_COMMON_HOST_MEMORY_H_
