// The coordinator's Prometheus metrics on /metrics (prometheus-cpp; every name, label and
// unit in docs/observability.md): the scheduler's state and counters read at each scrape
// (Scheduler::Snapshot), the running jobs' progress and memory by component (and those that
// ended within the grace period, after which their series go away), and the latency of
// every unary RPC by method and code.
//
// Thread-safety: thread-safe.
#ifndef LATHE_COORDINATOR_METRICS_COORDINATOR_METRICS_H_
#define LATHE_COORDINATOR_METRICS_COORDINATOR_METRICS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/api/services.h"
#include "coordinator/scheduler/scheduler.h"

namespace prometheus {
class Exposer;
class Registry;
}  // namespace prometheus

namespace lathe {

// How long an ended job's series stay.
inline constexpr absl::Duration kEndedJobGrace = absl::Minutes(5);

class CoordinatorMetrics : public RpcObserver {
 public:
  // Serves /metrics on `listen` ("host:port"; port 0 picks one). UNAVAILABLE naming the
  // address when it cannot be bound. REQUIRES: `scheduler` outlives the result.
  static absl::StatusOr<std::unique_ptr<CoordinatorMetrics>> Start(const std::string& listen,
                                                                   const Scheduler* scheduler);
  ~CoordinatorMetrics() override;

  // The port bound.
  int port() const { return port_; }

  void ObserveRpc(const char* method, grpc::StatusCode code, absl::Duration took) override;

  // The exposition text of everything (what /metrics serves).
  std::string Text() const;

 private:
  class Impl;
  explicit CoordinatorMetrics(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_METRICS_COORDINATOR_METRICS_H_
