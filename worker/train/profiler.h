// Profiling a running trainer on request (docs/observability.md, "Profiling").
//
// The agent drops a request (trainer.proto's ProfileRequest) at <profile dir>/request.json;
// between optimizer steps the trainer looks for it (one stat per step while no capture runs),
// removes it and profiles the next `steps` steps:
//  - <profile dir>/<capture_id>/rank-<R>.trace.json: libtorch's profiler (Kineto) over those
//    steps, CPU operators (and CUDA kernels on a CUDA job) inside the engine's ProfileScopes,
//    as Chrome trace JSON with the process named "lathe rank <R>";
//  - with `memory`, <profile dir>/<capture_id>/rank-<R>.memory.json: every allocation and
//    free over those steps (the MemoryTracker's record on the CPU, the caching allocator's
//    history on CUDA) and a summary of the peak.
// Each request is answered by one ProfileOutcome (trainer.proto's TrainerProfile): after the
// capture's last step, when training ends first (with what the capture holds), or at once
// with an error when the request cannot be honoured. A capture never stops training.
//
// Thread-safety: not thread-safe; the training thread drives a StepProfiler.
#ifndef LATHE_WORKER_TRAIN_PROFILER_H_
#define LATHE_WORKER_TRAIN_PROFILER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/profile_limits.h"
#include "kernels/ops/torch_compat.h"

namespace lathe {

class MemoryTracker;

// Bounds of one capture beyond common/profile_limits.h's (documented in
// docs/observability.md).
// The largest trace whose process is renamed after the rank (the rename parses it whole).
inline constexpr uintmax_t kMaxRenamedTraceBytes = uintmax_t{256} << 20;
// Memory events kept per capture; later ones are dropped (the file says "truncated") but
// still count towards the peak.
inline constexpr int64_t kMaxMemoryEvents = 200000;

// trainer.proto's ProfileRequest.
struct ProfileRequest {
  std::string capture_id;
  int64_t steps = 0;
  bool memory = false;
};

// trainer.proto's TrainerProfile.
struct ProfileOutcome {
  std::string capture_id;
  int64_t first_step = 0;  // 1-based; 0 when nothing was captured
  int64_t last_step = 0;
  std::vector<std::string> files;  // absolute paths
  std::string error;               // non-empty: why there is no capture, or only part of one
};

// OK when `request` can be captured: capture_id matches [A-Za-z0-9_-]{1,64} and steps is in
// 1..kMaxProfileSteps. INVALID_ARGUMENT naming the field otherwise.
absl::Status CheckProfileRequest(const ProfileRequest& request);

struct ProfileOptions {
  // <rank dir>/profile: requests are read from <dir>/request.json and captures written to
  // <dir>/<capture_id>/. Empty: no requests are looked for.
  std::string dir;
  // Reads request.json's text (protobuf JSON; lathe-worker passes ParseProfileRequest, which
  // this library, without protobuf, cannot call). Null: every request is refused.
  std::function<absl::StatusOr<ProfileRequest>(const std::string& text)> parse;
  // A request to start with, from the first step (`lathe-worker train --profile-steps`).
  // Needs `dir`.
  std::optional<ProfileRequest> initial;
  // Called with each request's outcome, on the training thread. Null: none.
  std::function<void(const ProfileOutcome&)> on_profile;
};

class StepProfiler {
 public:
  // `mapped_weight_bytes`: frozen weights read in place from the mapped model file, which a
  // step's reported peak counts and the CPU allocator never sees (trainer.h).
  StepProfiler(ProfileOptions options, int64_t rank, at::Device device, int64_t mapped_weight_bytes,
               MemoryTracker* tracker);
  // Closes an open capture as ended early (Finish with the last step done).
  ~StepProfiler();

  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  bool enabled() const { return !options_.dir.empty(); }
  bool capturing() const { return capture_ != nullptr; }

  // Before optimizer step `step` (1-based), once its peaks were reset: takes a pending
  // request and starts its capture.
  void BeforeStep(int64_t step);
  // After step `step` and everything that follows it (checkpoint): closes the capture after
  // its last step.
  void AfterStep(int64_t step);
  // Training ended (finished, stopped or failed) after `last_step` steps: closes an open
  // capture with what it holds, and answers a request that came too late.
  void Finish(int64_t last_step, const std::string& why);

 private:
  struct Capture;

  void Answer(const ProfileOutcome& outcome);
  // A pending request: the initial one, else the file's (removed). nullopt: none.
  std::optional<absl::StatusOr<ProfileRequest>> TakeRequest();
  void Start(const ProfileRequest& request, int64_t step);
  // Writes the capture's files and answers; `error` empty when it ran to its last step.
  void Close(int64_t last_step, std::string error);

  ProfileOptions options_;
  const int64_t rank_;
  const at::Device device_;
  const int64_t mapped_weight_bytes_;
  MemoryTracker* const tracker_;
  std::string request_path_;
  int64_t last_done_ = 0;  // the last step AfterStep saw
  bool finished_ = false;
  std::unique_ptr<Capture> capture_;
};

}  // namespace lathe

#endif  // LATHE_WORKER_TRAIN_PROFILER_H_
