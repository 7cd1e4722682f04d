// How every client of the coordinator (the CLI's JobClient, the worker agent, its progress
// reporter, the trainers' rendezvous store) retries a failed call: which codes mean "the same
// call may succeed if tried again", and how long to wait between tries.
//
// Retryable codes (docs/architecture.md, "Errors, retries, time"): UNAVAILABLE (the coordinator is
// down, restarting or unreachable) and DEADLINE_EXCEEDED (it did not answer in time). Every call
// Lathe retries is idempotent (SubmitJob carries a request id; reports and rendezvous writes
// may repeat), so a call that timed out after the server acted may safely go again. No other
// code is retried: RESOURCE_EXHAUSTED means "does not fit", ABORTED "restart the attempt",
// FAILED_PRECONDITION and INVALID_ARGUMENT "this will never work"; each is the caller's to
// handle.
//
// Delays grow exponentially from `initial_backoff` by `multiplier` up to `max_backoff`, and
// each is scaled by a random factor in [1 - jitter, 1 + jitter] so that many workers that
// lost the coordinator at once do not come back in lockstep.
//
// Thread-safety: IsRetryable and RetryCall are thread-safe; a Backoff is not (one per loop).
#ifndef LATHE_COMMON_RPC_RETRY_POLICY_H_
#define LATHE_COMMON_RPC_RETRY_POLICY_H_

#include <cstdint>
#include <functional>

#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace lathe {

struct RetryOptions {
  absl::Duration initial_backoff = absl::Milliseconds(200);
  absl::Duration max_backoff = absl::Seconds(10);
  double multiplier = 2.0;
  double jitter = 0.2;   // in [0, 1)
  int max_attempts = 0;  // tries in all, the first included; 0: no limit
};

// True for the codes worth trying the same call again for: UNAVAILABLE, DEADLINE_EXCEEDED.
bool IsRetryable(absl::StatusCode code);

// The delays of one retry loop.
class Backoff {
 public:
  explicit Backoff(const RetryOptions& options);

  // The delay before the next try; each call grows the next one, up to max_backoff.
  absl::Duration Next();
  // Back to initial_backoff (after a success).
  void Reset();

 private:
  const RetryOptions options_;
  absl::Duration next_;
  absl::BitGen random_;
};

// Runs `call` until it succeeds, returns a code that IsRetryable refuses, has been tried
// options.max_attempts times, or the next try would start after `deadline`; sleeps the
// Backoff's delays in between with `sleep`. Returns the last status.
// REQUIRES: `clock` and `sleep` are usable from the calling thread.
absl::Status RetryCall(const RetryOptions& options, absl::Time deadline, const Clock& clock,
                       const std::function<void(absl::Duration)>& sleep,
                       const std::function<absl::Status()>& call);

// RetryCall on the real clock, sleeping the calling thread.
absl::Status RetryCall(const RetryOptions& options, absl::Time deadline,
                       const std::function<absl::Status()>& call);

}  // namespace lathe

#endif  // LATHE_COMMON_RPC_RETRY_POLICY_H_
