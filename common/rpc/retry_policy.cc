#include "common/rpc/retry_policy.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace lathe {

bool IsRetryable(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded;
}

Backoff::Backoff(const RetryOptions& options) : options_(options), next_(options.initial_backoff) {}

absl::Duration Backoff::Next() {
  const absl::Duration base = next_;
  next_ = std::min(next_ * options_.multiplier, options_.max_backoff);
  if (options_.jitter <= 0) return base;
  return base * absl::Uniform(random_, 1.0 - options_.jitter, 1.0 + options_.jitter);
}

void Backoff::Reset() { next_ = options_.initial_backoff; }

absl::Status RetryCall(const RetryOptions& options, absl::Time deadline, const Clock& clock,
                       const std::function<void(absl::Duration)>& sleep,
                       const std::function<absl::Status()>& call) {
  Backoff backoff(options);
  for (int attempt = 1;; ++attempt) {
    absl::Status status = call();
    if (status.ok() || !IsRetryable(status.code())) return status;
    if (options.max_attempts > 0 && attempt >= options.max_attempts) return status;
    const absl::Duration delay = backoff.Next();
    if (clock.Now() + delay >= deadline) return status;
    sleep(delay);
  }
}

absl::Status RetryCall(const RetryOptions& options, absl::Time deadline,
                       const std::function<absl::Status()>& call) {
  static const RealClock clock;
  return RetryCall(options, deadline, clock, absl::SleepFor, call);
}

}  // namespace lathe
