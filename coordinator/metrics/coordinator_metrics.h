// The coordinator's Prometheus metrics (prometheus-cpp; every name, label and unit in
// docs/observability.md), served by common/http/http_endpoints.h: the scheduler's state and
// counters read at each scrape (Scheduler::Snapshot), the running jobs' progress, step and
// token counters and memory by component (and those that ended within the grace period, after
// which their series go away), the latency of every unary RPC by method and code, and
// lathe_build_info.
//
// Thread-safety: thread-safe.
#ifndef LATHE_COORDINATOR_METRICS_COORDINATOR_METRICS_H_
#define LATHE_COORDINATOR_METRICS_COORDINATOR_METRICS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/api/services.h"
#include "coordinator/scheduler/scheduler.h"

namespace prometheus {
class Collectable;
}  // namespace prometheus

namespace lathe {

// How long an ended job's series stay.
inline constexpr absl::Duration kEndedJobGrace = absl::Minutes(5);

class CoordinatorMetrics : public RpcObserver {
 public:
  // REQUIRES: `scheduler` outlives this.
  explicit CoordinatorMetrics(const Scheduler* scheduler);
  ~CoordinatorMetrics() override;

  // What /metrics serves.
  std::vector<std::weak_ptr<prometheus::Collectable>> Collectables() const;

  void ObserveRpc(const char* method, grpc::StatusCode code, absl::Duration took) override;

  // The exposition text of everything (what /metrics serves).
  std::string Text() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_METRICS_COORDINATOR_METRICS_H_
