#include "coordinator/metrics/coordinator_metrics.h"

#include <limits>
#include <map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
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

// The scheduler read at each scrape.
class SchedulerCollector : public prometheus::Collectable {
 public:
  explicit SchedulerCollector(const Scheduler* scheduler) : scheduler_(scheduler) {}

  std::vector<MetricFamily> Collect() const override {
    const SchedulerSnapshot s = scheduler_->Snapshot(kEndedJobGrace);
    std::vector<MetricFamily> out;
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
  // Per job (running, or ended within kEndedJobGrace): rank 0's progress and memory. The
  // label is job_id, not job: Prometheus gives every target a `job` label of its own.
  static void AddJobs(const SchedulerSnapshot& s, std::vector<MetricFamily>& out) {
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
    MetricFamily tokens =
        MakeFamily("lathe_job_tokens_per_second",
                   "Training tokens per second of rank 0 over the latest step.", MetricType::Gauge);
    MetricFamily mfu = MakeFamily("lathe_job_mfu_ratio",
                                  "Model FLOPs utilisation of rank 0's device, 0 to 1 "
                                  "(docs/training.md, \"MFU\").",
                                  MetricType::Gauge);
    MetricFamily step_seconds =
        MakeFamily("lathe_job_step_seconds", "Mean wall time of a step so far (after the first).",
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
      AddSample(tokens, id, job.progress.tokens_per_second());
      AddSample(mfu, id, job.progress.mfu());
      AddSample(step_seconds, id, job.progress.step_seconds());
      for (MemoryComponent c : kMemoryComponents) {
        const std::vector<ClientMetric::Label> labels = {
            {"component", std::string(MemoryComponentName(c))}, {"job_id", job.job_id}};
        AddSample(measured, labels, static_cast<double>(ComponentBytes(job.peak_memory, c)));
        AddSample(predicted, labels, static_cast<double>(ComponentBytes(job.predicted_memory, c)));
      }
    }
    for (MetricFamily* f :
         {&info, &step, &total, &loss, &lr, &tokens, &mfu, &step_seconds, &measured, &predicted}) {
      out.push_back(std::move(*f));
    }
  }

  const Scheduler* const scheduler_;
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
