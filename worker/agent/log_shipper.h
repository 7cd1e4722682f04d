// Sends the trainers' output to the coordinator (WorkerService.AppendLogs) from one thread,
// one batch per rank about every `period`, so that `lathe logs` shows a rank's log while it
// runs and after its worker is gone. Each rank's log is a byte stream with offsets: a batch
// the coordinator did not take (UNAVAILABLE) is sent again with the next; one it refuses
// (the rank is not this worker's, logs are not kept) is dropped. What piles up beyond
// max_pending per rank while the coordinator is away is dropped from the oldest end: the next
// batch declares how many bytes were lost (offsets are otherwise contiguous), and the
// coordinator marks the gap.
//
// Thread-safety: thread-safe.
#ifndef LATHE_WORKER_AGENT_LOG_SHIPPER_H_
#define LATHE_WORKER_AGENT_LOG_SHIPPER_H_

#include <cstdint>
#include <map>
#include <string>
#include <thread>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "lathe/v1/coordinator.grpc.pb.h"

namespace lathe {

struct LogShipperOptions {
  absl::Duration period = absl::Seconds(1);
  absl::Duration rpc_timeout = absl::Seconds(10);
  size_t max_pending = 8 << 20;  // per rank
  std::string token;             // the worker's bearer token; none when empty
};

class LogShipper {
 public:
  // Starts the sending thread. REQUIRES: `stub` outlives the shipper.
  LogShipper(v1::WorkerService::StubInterface* stub, LogShipperOptions options);
  // Stop().
  ~LogShipper();
  LogShipper(const LogShipper&) = delete;
  LogShipper& operator=(const LogShipper&) = delete;

  // One line of the output of rank `rank` of attempt `generation` of `job_id`.
  void AppendLine(const std::string& worker_id, const std::string& job_id, int64_t generation,
                  int64_t rank, absl::string_view line);

  // The rank ended: its log is forgotten once what is pending has gone.
  void Finished(const std::string& job_id, int64_t generation, int64_t rank);

  // True when nothing of that rank's log waits to be sent: all of it was delivered, refused
  // or dropped (or there was none).
  bool Shipped(const std::string& job_id, int64_t generation, int64_t rank);

  // Sends what is pending once more, then stops the thread. Idempotent.
  void Stop();

 private:
  using Key = std::tuple<std::string, int64_t, int64_t>;  // job, generation, rank
  struct Log {
    std::string worker_id;
    std::string pending;
    int64_t sent = 0;  // offset of pending's first byte
    int64_t lost = 0;  // dropped right before `sent`, not yet declared to the coordinator
    bool finished = false;
  };

  void Loop();
  // One batch per log with anything pending.
  void SendAll();

  v1::WorkerService::StubInterface* const stub_;
  const LogShipperOptions options_;
  absl::Mutex mu_;
  std::map<Key, Log> logs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Mutex send_mu_;  // one SendAll at a time
  std::thread thread_;
};

}  // namespace lathe

#endif  // LATHE_WORKER_AGENT_LOG_SHIPPER_H_
