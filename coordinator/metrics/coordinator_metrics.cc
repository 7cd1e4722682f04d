#include "coordinator/metrics/coordinator_metrics.h"

#include <algorithm>
#include <limits>
#include <map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "common/http/build_info.h"
#include "common/http/metric_families.h"
#include "common/memory_components.h"
#include "common/proto/job_state.h"
#include "common/proto/memory_breakdown.h"
#include "prometheus/collectable.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace lathe {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// "JOB_STATE_QUEUED" -> "queued", by the enum's prefix.
std::string EnumLabel(const std::string& name, absl::string_view prefix) {
  return absl::AsciiStrToLower(absl::StripPrefix(name, prefix));
}

// A gauge per value of a proto enum but its UNSPECIFIED (0), labelled by its name: every
// state is exported, also at 0, so that a query by state never finds nothing.
template <typename Enum>
void AddByEnum(MetricFamily& family, const google::protobuf::EnumDescriptor* values,
               absl::string_view prefix, const std::map<Enum, int64_t>& counts) {
  for (int i = 0; i < values->value_count(); ++i) {
    const google::protobuf::EnumValueDescriptor* value = values->value(i);
    if (value->number() == 0) continue;
    auto it = counts.find(static_cast<Enum>(value->number()));
    AddSample(family, {{"state", EnumLabel(value->name(), prefix)}},
              it == counts.end() ? 0 : static_cast<double>(it->second));
  }
}

void AddDurations(MetricFamily& family, const DurationHistogram& h) {
  AddHistogram(family, {}, h.bounds, h.counts, h.count, h.sum);
}

// The highest step a job has reached in any attempt (a resumed attempt redoes the steps
// after its checkpoint: they are no progress until it passes that step).
int64_t HighestStep(const SchedulerSnapshot::Job& job) {
  return std::max(job.steps_before, job.progress.step());
}

// Rank 0's training tokens in its latest step: its tokens/s over that step times the step's
// wall time (the sum of its phases; the mean step time when the report has no phases).
double TokensPerStep(const v1::Progress& p) {
  const v1::StepPhases& phases = p.phases();
  double seconds =
      phases.forward() + phases.loss() + phases.backward() + phases.comm() + phases.optimizer();
  if (seconds <= 0) seconds = p.step_seconds();
  return seconds > 0 ? p.tokens_per_second() * seconds : 0.0;
}

// The scheduler read at each scrape.
//
// lathe_job_steps_total and lathe_job_tokens_total count the steps of progress this
// coordinator saw a job make: each scrape adds the steps by which the job's highest step
// (over all its attempts) grew since the last, and for each such step rank 0's tokens of its
// latest step. Steps are cumulative in every report, so a report the agent coalesced or a
// scrape that missed some is still counted in full; a restarted attempt that resumes from a
// checkpoint redoes steps the job had already made, which are counted once (the counters
// stand still until it passes its old highest step). Jobs this coordinator found running at
// its start count from where they were (a new process's counters start at 0, which rate()
// takes as a counter reset); a job first seen later counts from the highest step of its
// earlier attempts (none: from 0).
class SchedulerCollector : public prometheus::Collectable {
 public:
  explicit SchedulerCollector(const Scheduler* scheduler) : scheduler_(scheduler) {
    absl::MutexLock lock(&counts_mu_);
    for (const SchedulerSnapshot::Job& job : scheduler_->Snapshot(kEndedJobGrace).jobs_shown) {
      counts_[job.job_id].highest_step = HighestStep(job);
    }
  }

  std::vector<MetricFamily> Collect() const override {
    const SchedulerSnapshot s = scheduler_->Snapshot(kEndedJobGrace);
    std::vector<MetricFamily> out;
    out.push_back(BuildInfoFamily("coordinator"));
    {
      MetricFamily f = MakeFamily("lathe_jobs", "Jobs by state.", MetricType::Gauge);
      AddByEnum(f, v1::JobState_descriptor(), "JOB_STATE_", s.jobs);
      out.push_back(std::move(f));
    }
    {
      MetricFamily f =
          MakeFamily("lathe_queue_length",
                     "Queued jobs that scheduling passes try (past any restart backoff, "
                     "no rank of an earlier attempt still running).",
                     MetricType::Gauge);
      AddSample(f, {}, static_cast<double>(s.queued_eligible));
      out.push_back(std::move(f));
    }
    {
      MetricFamily f =
          MakeFamily("lathe_workers", "Registered workers by state.", MetricType::Gauge);
      AddByEnum(f, v1::WorkerState_descriptor(), "WORKER_STATE_", s.workers);
      out.push_back(std::move(f));
    }
    {
      MetricFamily slots =
          MakeFamily("lathe_slots", "Slots of ready workers, by device.", MetricType::Gauge);
      MetricFamily free = MakeFamily("lathe_free_slots", "Free slots of ready workers, by device.",
                                     MetricType::Gauge);
      for (v1::Device device : {v1::DEVICE_CPU, v1::DEVICE_CUDA}) {
        auto total = s.slots.find(device);
        auto idle = s.free_slots.find(device);
        AddSample(slots, {{"device", DeviceName(device)}},
                  total == s.slots.end() ? 0 : static_cast<double>(total->second));
        AddSample(free, {{"device", DeviceName(device)}},
                  idle == s.free_slots.end() ? 0 : static_cast<double>(idle->second));
      }
      out.push_back(std::move(slots));
      out.push_back(std::move(free));
    }
    for (const auto& [name, help, value] :
         {std::tuple{"lathe_jobs_submitted_total", "Jobs accepted since the coordinator started.",
                     s.jobs_submitted},
          std::tuple{"lathe_attempts_started_total", "Attempts placed since the start.",
                     s.attempts_started},
          std::tuple{"lathe_restarts_total",
                     "Attempts queued again after an infrastructure failure (charged to "
                     "max_restarts).",
                     s.restarts},
          std::tuple{"lathe_workers_lost_total",
                     "Workers declared lost after a heartbeat timeout of silence.", s.workers_lost},
          std::tuple{"lathe_heartbeats_total", "Heartbeats answered.", s.heartbeats}}) {
      MetricFamily f = MakeFamily(name, help, MetricType::Counter);
      AddSample(f, {}, static_cast<double>(value));
      out.push_back(std::move(f));
    }
    {
      MetricFamily f =
          MakeFamily("lathe_attempts_ended_total",
                     "Attempts ended, by result (succeeded, failed, cancelled) and failure kind "
                     "(user, infrastructure, none).",
                     MetricType::Counter);
      for (const auto& [key, count] : s.attempts_ended) {
        const std::string failure =
            key.second == v1::FAILURE_KIND_UNSPECIFIED
                ? "none"
                : EnumLabel(v1::FailureKind_Name(key.second), "FAILURE_KIND_");
        AddSample(f,
                  {{"failure", failure},
                   {"result", EnumLabel(v1::AttemptState_Name(key.first), "ATTEMPT_STATE_")}},
                  static_cast<double>(count));
      }
      out.push_back(std::move(f));
    }
    {
      MetricFamily f = MakeFamily("lathe_scheduling_pass_duration_seconds",
                                  "Wall time of each scheduling pass.", MetricType::Histogram);
      AddDurations(f, s.pass_seconds);
      out.push_back(std::move(f));
    }
    {
      MetricFamily f = MakeFamily("lathe_queue_wait_seconds",
                                  "Time from a job's submission (or its requeue after a failed "
                                  "attempt) to its placement.",
                                  MetricType::Histogram);
      AddDurations(f, s.queue_seconds);
      out.push_back(std::move(f));
    }
    AddJobs(s, out);
    return out;
  }

 private:
  // What the job counters have counted of one job.
  struct JobCounts {
    int64_t highest_step = 0;  // counted up to here
    int64_t steps = 0;
    double tokens = 0;
    bool ended = false;  // when last shown
  };

  // Brings the job counters up to `s`. A job that ended and is no longer shown is forgotten; one
  // that was running and is not shown waits in the queue for its next attempt (its series are
  // gone meanwhile; its counters go on from where they were when it runs again).
  std::map<std::string, JobCounts> CountJobs(const SchedulerSnapshot& s) const {
    absl::MutexLock lock(&counts_mu_);
    std::map<std::string, JobCounts> shown;
    for (const SchedulerSnapshot::Job& job : s.jobs_shown) {
      auto [it, first_seen] = counts_.try_emplace(job.job_id);
      JobCounts& c = it->second;
      if (first_seen) c.highest_step = job.steps_before;
      const int64_t highest = HighestStep(job);
      if (highest > c.highest_step) {
        const int64_t steps = highest - c.highest_step;
        c.steps += steps;
        c.tokens += static_cast<double>(steps) * TokensPerStep(job.progress);
        c.highest_step = highest;
      }
      c.ended = job.state == v1::JOB_STATE_SUCCEEDED || job.state == v1::JOB_STATE_FAILED ||
                job.state == v1::JOB_STATE_CANCELLED;
      shown.insert(*it);
    }
    for (auto it = counts_.begin(); it != counts_.end();) {
      it = it->second.ended && !shown.count(it->first) ? counts_.erase(it) : std::next(it);
    }
    return shown;
  }

  // Per job (running, or ended within kEndedJobGrace): rank 0's progress and memory. The
  // label is job_id, not job: Prometheus gives every target a `job` label of its own.
  void AddJobs(const SchedulerSnapshot& s, std::vector<MetricFamily>& out) const {
    const std::map<std::string, JobCounts> counts = CountJobs(s);
    MetricFamily info =
        MakeFamily("lathe_job_info", "1 for each job shown: its name, state and current attempt.",
                   MetricType::Gauge);
    MetricFamily step = MakeFamily("lathe_job_step", "Optimizer steps done.", MetricType::Gauge);
    MetricFamily total =
        MakeFamily("lathe_job_total_steps", "Steps the job runs.", MetricType::Gauge);
    MetricFamily loss =
        MakeFamily("lathe_job_loss", "Training loss of the latest step.", MetricType::Gauge);
    MetricFamily lr = MakeFamily("lathe_job_learning_rate", "Learning rate of the latest step.",
                                 MetricType::Gauge);
    MetricFamily steps_total =
        MakeFamily("lathe_job_steps_total",
                   "Steps of progress the job made (a step redone after a restart counts once).",
                   MetricType::Counter);
    MetricFamily tokens =
        MakeFamily("lathe_job_tokens_total",
                   "Rank 0's training tokens of the job's steps of progress (its tokens/s times "
                   "the step time, per step).",
                   MetricType::Counter);
    MetricFamily mfu = MakeFamily("lathe_job_mfu_ratio",
                                  "Model FLOPs utilisation of rank 0's device, 0 to 1 "
                                  "(docs/training.md, \"MFU\").",
                                  MetricType::Gauge);
    MetricFamily measured = MakeFamily("lathe_job_memory_peak_bytes",
                                       "Measured peak memory of the attempt by component: the "
                                       "largest any rank reported.",
                                       MetricType::Gauge);
    MetricFamily predicted = MakeFamily("lathe_job_memory_predicted_bytes",
                                        "The planner's predicted peak per rank by component "
                                        "(before its learned correction).",
                                        MetricType::Gauge);
    for (const SchedulerSnapshot::Job& job : s.jobs_shown) {
      AddSample(info,
                {{"attempt", absl::StrCat(job.generation)},
                 {"job_id", job.job_id},
                 {"name", job.name},
                 {"state", EnumLabel(v1::JobState_Name(job.state), "JOB_STATE_")}},
                1);
      const std::vector<ClientMetric::Label> id = {{"job_id", job.job_id}};
      AddSample(step, id, static_cast<double>(job.progress.step()));
      AddSample(total, id, static_cast<double>(job.progress.total_steps()));
      if (job.progress.has_loss()) AddSample(loss, id, job.progress.loss());
      AddSample(lr, id, job.progress.lr());
      const JobCounts& counted = counts.at(job.job_id);
      AddSample(steps_total, id, static_cast<double>(counted.steps));
      AddSample(tokens, id, counted.tokens);
      AddSample(mfu, id, job.progress.mfu());
      for (MemoryComponent c : kMemoryComponents) {
        const std::vector<ClientMetric::Label> labels = {
            {"component", std::string(MemoryComponentName(c))}, {"job_id", job.job_id}};
        AddSample(measured, labels, static_cast<double>(ComponentBytes(job.peak_memory, c)));
        AddSample(predicted, labels, static_cast<double>(ComponentBytes(job.predicted_memory, c)));
      }
    }
    for (MetricFamily* f :
         {&info, &step, &total, &steps_total, &loss, &lr, &tokens, &mfu, &measured, &predicted}) {
      out.push_back(std::move(*f));
    }
  }

  const Scheduler* const scheduler_;
  mutable absl::Mutex counts_mu_;
  mutable std::map<std::string, JobCounts> counts_ ABSL_GUARDED_BY(counts_mu_);
};

}  // namespace

class CoordinatorMetrics::Impl {
 public:
  explicit Impl(const Scheduler* scheduler)
      : registry(std::make_shared<prometheus::Registry>()),
        rpc(prometheus::BuildHistogram()
                .Name("lathe_rpc_duration_seconds")
                .Help("Wall time of each unary RPC the coordinator answered, by method and "
                      "status code.")
                .Register(*registry)),
        collector(std::make_shared<SchedulerCollector>(scheduler)) {}

  std::shared_ptr<prometheus::Registry> registry;
  prometheus::Family<prometheus::Histogram>& rpc;
  std::shared_ptr<SchedulerCollector> collector;
};

CoordinatorMetrics::CoordinatorMetrics(const Scheduler* scheduler)
    : impl_(std::make_unique<Impl>(scheduler)) {}

CoordinatorMetrics::~CoordinatorMetrics() = default;

std::vector<std::weak_ptr<prometheus::Collectable>> CoordinatorMetrics::Collectables() const {
  return {impl_->registry, impl_->collector};
}

void CoordinatorMetrics::ObserveRpc(const char* method, grpc::StatusCode code,
                                    absl::Duration took) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
  impl_->rpc
      .Add({{"method", method},
            {"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(code))}},
           kBuckets)
      .Observe(absl::ToDoubleSeconds(took));
}

std::string CoordinatorMetrics::Text() const {
  std::vector<MetricFamily> families = impl_->registry->Collect();
  for (MetricFamily& f : impl_->collector->Collect()) families.push_back(std::move(f));
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace lathe
