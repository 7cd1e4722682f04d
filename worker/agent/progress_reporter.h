// Sends the agent's ReportProgress calls to the coordinator in order, from one thread, so
// that a slow or unreachable coordinator never blocks a trainer's reader thread.
//
// Delivery: each report is tried once; the end of a rank (SUCCEEDED, FAILED, CANCELLED) is
// retried under the retry policy (common/rpc/retry_policy.h: UNAVAILABLE and
// DEADLINE_EXCEEDED, with its backoff, until Stop), since the coordinator must learn how
// each rank ended. Other errors (FAILED_PRECONDITION for a stale generation, NOT_FOUND for
// an unknown job) drop the report: the coordinator has moved on. A
// queued PROGRESS report not yet sent is replaced by a newer one for the same rank, so a
// backlog never builds up.
//
// Thread-safety: thread-safe.
#ifndef LATHE_WORKER_AGENT_PROGRESS_REPORTER_H_
#define LATHE_WORKER_AGENT_PROGRESS_REPORTER_H_

#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/rpc/retry_policy.h"
#include "lathe/v1/coordinator.grpc.pb.h"
#include "lathe/v1/coordinator.pb.h"

namespace lathe {

struct ProgressReporterOptions {
  absl::Duration rpc_timeout = absl::Seconds(10);
  RetryOptions retry;  // max_attempts is not used: an end is retried until Stop
  std::string token;   // bearer token sent with every report; none when empty
};

class ProgressReporter {
 public:
  // Starts the sending thread. REQUIRES: `stub` outlives the reporter.
  ProgressReporter(v1::WorkerService::StubInterface* stub, ProgressReporterOptions options);
  // Stop().
  ~ProgressReporter();

  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

  // Queues `request`. `on_done`, when set, runs on the sending thread (or, after Stop, on
  // the caller's) once the report was delivered or given up on; it may call Report.
  void Report(v1::ReportProgressRequest request, std::function<void()> on_done = nullptr);

  // Tries every queued report once more (no retries), then stops the sending thread. Later
  // reports are dropped (their on_done still runs). Idempotent.
  void Stop();

 private:
  struct Item {
    v1::ReportProgressRequest request;
    std::function<void()> on_done;
  };

  void Loop();
  void Deliver(const v1::ReportProgressRequest& request);

  v1::WorkerService::StubInterface* const stub_;
  const ProgressReporterOptions options_;

  absl::Mutex mu_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;  // the thread has been joined (or is being)
  std::thread thread_;
  // Progress reports dropped in a row (only the first is logged; the count with the next
  // delivered report). Touched by the reporting thread only.
  int64_t dropped_progress_ = 0;
};

}  // namespace lathe

#endif  // LATHE_WORKER_AGENT_PROGRESS_REPORTER_H_
