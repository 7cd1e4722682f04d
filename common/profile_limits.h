// What one profile capture (`lathe profile`, docs/observability.md "Profiling") may be: the
// bounds and names that the CLI, the coordinator, the agent and the trainer all check, stated
// once.
//
// Thread-safety: constants and pure functions.
#ifndef LATHE_COMMON_PROFILE_LIMITS_H_
#define LATHE_COMMON_PROFILE_LIMITS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace lathe {

// Optimizer steps one capture covers, at most.
inline constexpr int64_t kMaxProfileSteps = 20;
// The bytes of one file of a capture, and of a capture's files over all its ranks, that the
// agent uploads and the coordinator keeps.
inline constexpr int64_t kMaxProfileFileBytes = int64_t{64} << 20;
inline constexpr int64_t kMaxProfileCaptureBytes = int64_t{256} << 20;

// INVALID_ARGUMENT "capture_id: ..." unless `capture_id` is [A-Za-z0-9_-]{1,64}: it names a
// directory (trainer.proto's ProfileRequest).
absl::Status CheckCaptureId(absl::string_view capture_id);
// INVALID_ARGUMENT naming `what` unless `name` is [A-Za-z0-9._-]{1,128} and not "." or "..":
// a file name, never a path.
absl::Status CheckProfileFileName(absl::string_view name, absl::string_view what = "name");

}  // namespace lathe

#endif  // LATHE_COMMON_PROFILE_LIMITS_H_
