// A worker agent's Prometheus metrics (docs/observability.md, "The worker agents"), from its
// trainers' events: every rank it runs (step, loss, learning rate, tokens/s, MFU, a step
// time histogram, measured memory by component) and the worker itself (slots, busy slots,
// host memory, device memory: total, and in use on a GPU), and lathe_build_info. An ended
// rank's series stay for the grace period, then go. The step time histogram is the one
// Lathe exports (the coordinator has none): the agent sees every step of its ranks, the
// coordinator only rank 0's latest report.
//
// Thread-safety: thread-safe (Record from trainers' reader threads, Collect from the HTTP
// server's).
#ifndef LATHE_WORKER_AGENT_AGENT_METRICS_H_
#define LATHE_WORKER_AGENT_AGENT_METRICS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "lathe/v1/coordinator.pb.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "worker/agent/trainer_supervisor.h"

namespace lathe {

class AgentMetrics : public prometheus::Collectable {
 public:
  // How long an ended rank's series stay.
  static constexpr absl::Duration kEndedRankGrace = absl::Minutes(5);

  // Device memory in use per slot, when known (GpuMemoryProbe::UsedBytes).
  using DeviceMemoryUsed = std::function<std::vector<std::optional<uint64_t>>()>;

  // `devices`: what the agent registered (GPU memory per slot); `device_used`, when set,
  // is asked on each scrape. REQUIRES: `clock` outlives this.
  AgentMetrics(std::string worker_id, int64_t slots, std::vector<v1::DeviceInfo> devices,
               const Clock* clock, DeviceMemoryUsed device_used = nullptr);

  // One event of the trainer running `assignment` (WorkerAgentOptions::on_event).
  void Record(const v1::Assignment& assignment, const RankReport& event);

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  struct Rank {
    int64_t slot = 0;
    int64_t generation = 0;
    v1::Progress progress;              // the latest step's
    v1::MemoryBreakdown peak;           // the largest measured so far
    std::vector<uint64_t> step_counts;  // cumulative, per bucket of kStepBuckets
    uint64_t steps = 0;
    double step_seconds_sum = 0;
    std::optional<absl::Time> ended;
  };
  using RankKey = std::tuple<std::string, int64_t, int64_t>;  // job, generation, rank

  const std::string worker_id_;
  const int64_t slots_;
  const std::vector<v1::DeviceInfo> devices_;
  const Clock* const clock_;
  const DeviceMemoryUsed device_used_;
  mutable absl::Mutex mu_;
  std::map<RankKey, Rank> ranks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lathe

#endif  // LATHE_WORKER_AGENT_AGENT_METRICS_H_
