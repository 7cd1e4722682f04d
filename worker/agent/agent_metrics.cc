#include "worker/agent/agent_metrics.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/host_memory.h"
#include "common/http/build_info.h"
#include "common/http/metric_families.h"
#include "common/memory_components.h"
#include "common/proto/memory_breakdown.h"

namespace lathe {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// Step times from a tiny model's milliseconds to a large one's minutes.
const std::vector<double> kStepBuckets = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                          2.5,  5,     10,   30,  60,   120, 300};

bool Terminal(v1::RankEvent event) {
  return event == v1::RANK_EVENT_SUCCEEDED || event == v1::RANK_EVENT_FAILED ||
         event == v1::RANK_EVENT_CANCELLED;
}

// The step's wall time as the trainer measured its phases.
double StepSeconds(const v1::StepPhases& p) {
  return p.forward() + p.loss() + p.backward() + p.comm() + p.optimizer();
}

}  // namespace

AgentMetrics::AgentMetrics(std::string worker_id, int64_t slots,
                           std::vector<v1::DeviceInfo> devices, const Clock* clock,
                           DeviceMemoryUsed device_used)
    : worker_id_(std::move(worker_id)),
      slots_(slots),
      devices_(std::move(devices)),
      clock_(clock),
      device_used_(std::move(device_used)) {}

void AgentMetrics::Record(const v1::Assignment& assignment, const RankReport& event) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  for (auto it = ranks_.begin(); it != ranks_.end();) {  // the ended ones past their grace
    it = it->second.ended && now - *it->second.ended > kEndedRankGrace ? ranks_.erase(it)
                                                                       : std::next(it);
  }
  Rank& rank = ranks_[{assignment.job_id(), assignment.generation(), assignment.rank()}];
  rank.slot = assignment.slot();
  rank.generation = assignment.generation();
  if (rank.step_counts.empty()) rank.step_counts.assign(kStepBuckets.size(), 0);
  if (event.kind == v1::RANK_EVENT_PROGRESS || event.kind == v1::RANK_EVENT_SUCCEEDED) {
    const v1::Progress& progress = event.progress;
    const double seconds = StepSeconds(progress.phases());
    if (event.kind == v1::RANK_EVENT_PROGRESS && progress.step() > rank.progress.step() &&
        seconds > 0) {
      ++rank.steps;
      rank.step_seconds_sum += seconds;
      for (size_t i = 0; i < kStepBuckets.size(); ++i) {
        if (seconds <= kStepBuckets[i]) ++rank.step_counts[i];
      }
    }
    if (progress.memory().total() > rank.peak.total()) rank.peak = progress.memory();
    if (progress.step() >= rank.progress.step()) rank.progress = progress;
  }
  if (Terminal(event.kind)) rank.ended = now;
}

std::vector<MetricFamily> AgentMetrics::Collect() const {
  // Asked before the lock: it may wait for nvidia-smi, and events must not.
  const std::vector<std::optional<uint64_t>> used =
      device_used_ ? device_used_() : std::vector<std::optional<uint64_t>>();
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  const ClientMetric::Label worker = {"worker_id", worker_id_};
  std::vector<MetricFamily> out;
  out.push_back(BuildInfoFamily("agent"));

  MetricFamily slots =
      MakeFamily("lathe_worker_slots", "Slots this worker registered.", MetricType::Gauge);
  MetricFamily busy =
      MakeFamily("lathe_worker_busy_slots",
                 "Slots running a rank (from its first event to its end).", MetricType::Gauge);
  int64_t running = 0;
  for (const auto& [key, rank] : ranks_) running += rank.ended ? 0 : 1;
  AddSample(slots, {worker}, static_cast<double>(slots_));
  AddSample(busy, {worker}, static_cast<double>(running));
  out.push_back(std::move(slots));
  out.push_back(std::move(busy));

  MetricFamily host =
      MakeFamily("lathe_worker_host_memory_bytes",
                 "The host's memory: total, and available (MemAvailable).", MetricType::Gauge);
  if (absl::StatusOr<uint64_t> total = HostMemoryBytes(); total.ok()) {
    AddSample(host, {{"kind", "total"}, worker}, static_cast<double>(*total));
  }
  if (absl::StatusOr<uint64_t> available = HostAvailableMemoryBytes(); available.ok()) {
    AddSample(host, {{"kind", "available"}, worker}, static_cast<double>(*available));
  }
  out.push_back(std::move(host));
  MetricFamily device = MakeFamily("lathe_worker_device_memory_bytes",
                                   "Each slot's device memory: total as registered, and in use "
                                   "on its GPU (nvidia-smi).",
                                   MetricType::Gauge);
  for (const v1::DeviceInfo& d : devices_) {
    AddSample(device, {{"kind", "total"}, {"slot", absl::StrCat(d.index())}, worker},
              static_cast<double>(d.memory_bytes()));
  }
  for (size_t slot = 0; slot < used.size(); ++slot) {
    if (!used[slot]) continue;
    AddSample(device, {{"kind", "used"}, {"slot", absl::StrCat(slot)}, worker},
              static_cast<double>(*used[slot]));
  }
  out.push_back(std::move(device));

  MetricFamily info = MakeFamily("lathe_rank_info",
                                 "1 for each rank shown: its attempt, slot and whether it ended.",
                                 MetricType::Gauge);
  MetricFamily step = MakeFamily("lathe_rank_step", "Optimizer steps done.", MetricType::Gauge);
  MetricFamily loss =
      MakeFamily("lathe_rank_loss", "Training loss of the latest step.", MetricType::Gauge);
  MetricFamily lr = MakeFamily("lathe_rank_learning_rate", "Learning rate of the latest step.",
                               MetricType::Gauge);
  MetricFamily tokens = MakeFamily("lathe_rank_tokens_per_second",
                                   "Training tokens per second of this rank over the latest "
                                   "step.",
                                   MetricType::Gauge);
  MetricFamily mfu =
      MakeFamily("lathe_rank_mfu_ratio", "Model FLOPs utilisation of this rank's device, 0 to 1.",
                 MetricType::Gauge);
  MetricFamily duration =
      MakeFamily("lathe_rank_step_duration_seconds",
                 "Wall time of each step (the trainer's phases: forward, loss, backward, "
                 "communication, optimizer).",
                 MetricType::Histogram);
  MetricFamily memory =
      MakeFamily("lathe_rank_memory_peak_bytes", "Measured peak memory of this rank by component.",
                 MetricType::Gauge);
  for (const auto& [key, rank] : ranks_) {
    if (rank.ended && now - *rank.ended > kEndedRankGrace) continue;
    const auto& [job, generation, index] = key;
    const std::vector<ClientMetric::Label> id = {
        {"job_id", job}, {"rank", absl::StrCat(index)}, worker};
    AddSample(info,
              {{"attempt", absl::StrCat(generation)},
               {"ended", rank.ended ? "true" : "false"},
               {"job_id", job},
               {"rank", absl::StrCat(index)},
               {"slot", absl::StrCat(rank.slot)},
               worker},
              1);
    AddSample(step, id, static_cast<double>(rank.progress.step()));
    if (rank.progress.has_loss()) AddSample(loss, id, rank.progress.loss());
    AddSample(lr, id, rank.progress.lr());
    AddSample(tokens, id, rank.progress.tokens_per_second());
    AddSample(mfu, id, rank.progress.mfu());
    AddHistogram(duration, id, kStepBuckets, rank.step_counts, rank.steps, rank.step_seconds_sum);
    for (MemoryComponent c : kMemoryComponents) {
      std::vector<ClientMetric::Label> labels = id;
      labels.push_back({"component", std::string(MemoryComponentName(c))});
      AddSample(memory, std::move(labels), static_cast<double>(ComponentBytes(rank.peak, c)));
    }
  }
  for (MetricFamily* f : {&info, &step, &loss, &lr, &tokens, &mfu, &duration, &memory}) {
    out.push_back(std::move(*f));
  }
  return out;
}

}  // namespace lathe
