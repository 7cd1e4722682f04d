#include "coordinator/scheduler/job_manager.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/allowed_roots.h"
#include "common/capabilities.h"
#include "common/data_check.h"
#include "common/file_util.h"
#include "common/job_spec.h"
#include "common/model_config.h"
#include "common/plan.h"
#include "common/proto/job_spec_proto.h"
#include "common/status_macros.h"
#include "common/weights_check.h"
#include "planner/model_shape.h"
#include "planner/plan_proto.h"
#include "planner/plan_spec.h"
#include "planner/planner.h"

namespace lathe {
namespace {

namespace fs = std::filesystem;

absl::Status SpecError(absl::string_view field, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("spec: ", field, ": ", problem));
}

constexpr size_t kMaxRequestIdBytes = 128;
constexpr size_t kMaxListBytes = 2 << 20;  // gRPC's default message limit is 4 MiB

}  // namespace

JobManager::JobManager(Scheduler* scheduler, JobManagerOptions options)
    : scheduler_(scheduler), options_(std::move(options)) {}

absl::Status JobManager::CanonicalizePaths(JobSpec& spec) const {
  for (const auto& [field, path] :
       {std::pair{"model.path", &spec.model.path}, std::pair{"data.train", &spec.data.train},
        std::pair{"data.eval", &spec.data.eval}, std::pair{"lora.init_from", &spec.lora.init_from},
        std::pair{"output", &spec.output}}) {
    if (path->empty()) continue;
    absl::StatusOr<std::string> canonical = CanonicalInRoots(*path, options_.allowed_roots, field);
    if (!canonical.ok()) return Annotate(canonical.status(), "spec");
    *path = *std::move(canonical);
  }
  return absl::OkStatus();
}

absl::StatusOr<JobManager::Admitted> JobManager::Admit(const v1::JobSpec& proto) const {
  LATHE_ASSIGN_OR_RETURN(JobSpec spec, JobSpecFromProto(proto, "spec"));
  LATHE_RETURN_IF_ERROR(Annotate(CheckEngineSupports(spec), "spec"));
  LATHE_RETURN_IF_ERROR(CanonicalizePaths(spec));
  if (std::error_code error; !fs::exists(spec.model.path, error)) {
    // "Qwen/Qwen2.5-0.5B" in a spec is a relative path here, not a hub id (issue #32).
    return SpecError("model.path",
                     absl::StrCat(spec.model.path,
                                  " does not exist: a model is read from a local directory (a "
                                  "Hugging Face hub model must be downloaded first, e.g. "
                                  "`huggingface-cli download ORG/NAME --local-dir DIR`)"));
  }
  absl::StatusOr<ModelConfig> model = LoadModelConfig(spec.model.path);
  if (!model.ok()) return SpecError("model.path", model.status().message());
  if (spec.data.seq_len > model->max_position_embeddings) {
    return SpecError("data.seq_len", absl::StrCat(spec.data.seq_len,
                                                  " exceeds the model's max_position_embeddings ",
                                                  model->max_position_embeddings));
  }
  // What the trainer would refuse within a second of starting, checked now rather than
  // after the job's wait in the queue (issue #32): the weights' headers and tensors (no
  // tensor data is read) and the first lines of each data file (common/data_check.h).
  if (absl::Status weights = CheckModelWeights(spec.model.path, *model); !weights.ok()) {
    return SpecError("model.path", weights.message());
  }
  if (!spec.lora.init_from.empty() && TrainsLora(spec)) {
    if (absl::Status init = CheckLoraInitFrom(spec.lora.init_from, *model, spec.lora); !init.ok()) {
      return SpecError("lora.init_from", init.message());
    }
  }
  for (const auto& [field, path] :
       {std::pair{"data.train", spec.data.train}, std::pair{"data.eval", spec.data.eval}}) {
    if (path.empty()) continue;
    if (!fs::is_regular_file(path)) return SpecError(field, absl::StrCat(path, ": no such file"));
    // The checker's message begins with the field and the path.
    if (absl::Status data = CheckDataFile(path, field, model->vocab_size, spec.model.path);
        !data.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("spec: ", data.message()));
    }
  }
  LATHE_RETURN_IF_ERROR(Annotate(CheckNoFinishedRun(spec.output), "spec"));
  const auto [pool, rates] = PoolFor(spec);
  LATHE_ASSIGN_OR_RETURN(PlanOptions options, PlanOptionsFor(spec, pool, rates));
  const MemoryCalibration calibration = scheduler_->Calibration();
  options.calibration = &calibration;
  // The config read above is the one the planner sizes (config.json is read once).
  absl::StatusOr<PlanResult> plan = PlanJob(spec, ModelShapeOf(*model), options);
  if (!plan.ok()) return Annotate(plan.status(), "spec");
  return Admitted{std::move(spec), *std::move(plan), options.rates.memory_bytes};
}

std::pair<std::string, DeviceRates> JobManager::PoolFor(const JobSpec& spec) const {
  // The registered worker of the job's device where one rank would have the most memory (a
  // GPU's; a CPU host's over the job's ranks, which share it), and its pool.
  const bool cuda = spec.resources.device == DeviceKind::kCuda;
  std::string pool = cuda ? "h100" : "cpu";
  uint64_t best = 0;
  for (const v1::WorkerStatus& w : scheduler_->ListWorkers()) {
    if ((w.device() == v1::DEVICE_CUDA) != cuda) continue;
    if (cuda) {
      for (const v1::DeviceInfo& d : w.devices()) {
        if (d.memory_bytes() <= best) continue;
        best = d.memory_bytes();
        pool = PoolOf(options_.pools, true, d.name());
      }
    } else {
      best = std::max<uint64_t>(
          best, w.host_memory_bytes() / static_cast<uint64_t>(spec.resources.ranks));
    }
  }
  auto it = options_.pools.find(pool);
  DeviceRates rates = it != options_.pools.end() ? it->second : DeviceRates{};
  if (best > 0) rates.memory_bytes = best;
  return {pool, rates};
}

absl::StatusOr<v1::PlanJobResponse> JobManager::Plan(const v1::PlanJobRequest& request) const {
  LATHE_ASSIGN_OR_RETURN(Admitted admitted, Admit(request.spec()));
  v1::PlanJobResponse response = PlanResultToProto(admitted.plan, admitted.memory_per_rank);
  // A job needs all its ranks placed at once (gang scheduling): with fewer slots registered
  // it would wait in the queue until more workers register (issue #32).
  const bool cuda = admitted.spec.resources.device == DeviceKind::kCuda;
  int64_t slots = 0;
  for (const v1::WorkerStatus& w : scheduler_->ListWorkers()) {
    if ((w.device() == v1::DEVICE_CUDA) == cuda && w.state() != v1::WORKER_STATE_LOST) {
      slots += w.slots();
    }
  }
  if (admitted.spec.resources.ranks > slots) {
    response.add_warnings(absl::StrCat(
        "needs ", admitted.spec.resources.ranks, " ", cuda ? "cuda" : "cpu", " slots at once; ",
        slots, " registered: it would wait in the queue until more workers register"));
  }
  return response;
}

absl::StatusOr<v1::GetPlanHistoryResponse> JobManager::PlanHistory(
    const v1::GetPlanHistoryRequest& request, const Requester& requester) const {
  if (request.limit() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("limit: must be >= 0, got ", request.limit()));
  }
  return scheduler_->PlanHistory(request.limit() == 0 ? 20 : std::min(request.limit(), 1000),
                                 requester);
}

absl::StatusOr<v1::SubmitJobResponse> JobManager::Submit(const v1::SubmitJobRequest& request,
                                                         const Requester& requester) {
  if (request.request_id().size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("request_id: must be at most ",
                                                   kMaxRequestIdBytes, " bytes, got ",
                                                   request.request_id().size()));
  }
  LATHE_ASSIGN_OR_RETURN(Admitted admitted, Admit(request.spec()));
  const JobSpec& spec = admitted.spec;
  v1::JobStatus job;
  // "<name>-<6 hex digits>": short to type, and drawn again when taken (10,000 jobs of one
  // name would otherwise collide a few times; the store's unique key backs this up).
  absl::BitGen bits;
  do {
    job.set_job_id(absl::StrFormat("%s-%06x", spec.name, absl::Uniform<uint32_t>(bits) & 0xFFFFFF));
  } while (scheduler_->HasJob(job.job_id()));
  *job.mutable_spec() = JobSpecToProto(spec);  // defaults filled in
  *job.mutable_plan() = PlanToProto(admitted.plan.plan);
  bool existing = false;
  LATHE_ASSIGN_OR_RETURN(
      v1::JobStatus status,
      scheduler_->AddJob(std::move(job), request.request_id(), &existing, requester));
  v1::SubmitJobResponse response;
  response.set_job_id(status.job_id());
  *response.mutable_status() = std::move(status);
  response.set_existing(existing);
  return response;
}

absl::StatusOr<v1::ListJobsResponse> JobManager::List(const v1::ListJobsRequest& request,
                                                      const Requester& requester) const {
  if (request.page_size() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size: must be >= 0, got ", request.page_size()));
  }
  JobQuery query;
  query.requester = requester;
  query.limit = request.page_size() == 0 ? 100 : std::min(request.page_size(), 1000);
  for (int state : request.states()) query.states.insert(static_cast<v1::JobState>(state));
  query.name = request.name();
  query.since_unix_ms = request.since_unix_ms();
  // A page also ends before it would pass kMaxListBytes (at least one job), so that no page
  // exceeds gRPC's message limit whatever the jobs hold.
  query.max_bytes = kMaxListBytes;
  // The token is the position after the previous page: the submission sequence of its last
  // job ("s<sequence>").
  if (!request.page_token().empty()) {
    int64_t before = 0;
    if (!absl::StartsWith(request.page_token(), "s") ||
        !absl::SimpleAtoi(request.page_token().substr(1), &before) || before < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("page_token: unknown token \"", request.page_token().substr(0, 64), "\""));
    }
    query.before_sequence = before;
  }
  JobPage page = scheduler_->ListJobs(query);
  v1::ListJobsResponse response;
  for (v1::JobStatus& job : page.jobs) *response.add_jobs() = std::move(job);
  if (page.next_before >= 0) response.set_next_page_token(absl::StrCat("s", page.next_before));
  return response;
}

}  // namespace lathe
