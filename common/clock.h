// Time as a collaborator: production code asks a Clock, tests pass a FakeClock and move it
// by hand, so heartbeat timeouts and backoffs are tested without sleeping.
//
// Thread-safety: both implementations are thread-safe.
#ifndef LATHE_COMMON_CLOCK_H_
#define LATHE_COMMON_CLOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace lathe {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

class RealClock : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};

class FakeClock : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'700'000'000)) : now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lathe

#endif  // LATHE_COMMON_CLOCK_H_
