#include "coordinator/scheduler/scheduler.h"

#include <algorithm>
#include <filesystem>
#include <tuple>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/job_spec.h"
#include "common/proto/job_state.h"
#include "common/proto/memory_breakdown.h"
#include "common/status_macros.h"
#include "google/protobuf/util/message_differencer.h"
#include "spdlog/spdlog.h"

namespace lathe {
namespace {

// Bounds on what workers send: a registration or a report is untrusted input, and whatever
// the coordinator keeps of it must stay small.
constexpr size_t kMaxWorkerIdBytes = 128;
constexpr int64_t kMaxSlots = 1024;
constexpr size_t kMaxShortFieldBytes = 256;  // address, version, device names
constexpr size_t kMaxErrorBytes = 16 << 10;

absl::Status CheckRegistration(const v1::RegisterWorkerRequest& request) {
  const std::string& id = request.worker_id();
  if (id.empty() || id.size() > kMaxWorkerIdBytes || !std::all_of(id.begin(), id.end(), [](char c) {
        return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-';
      })) {
    return absl::InvalidArgumentError(absl::StrCat("worker_id: must be 1 to ", kMaxWorkerIdBytes,
                                                   " characters from A-Z a-z 0-9 . _ -"));
  }
  if (request.slots() < 1 || request.slots() > kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("slots: must be 1 to ", kMaxSlots, ", got ", request.slots()));
  }
  if (request.devices_size() > kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("devices: at most ", kMaxSlots, ", got ", request.devices_size()));
  }
  bool short_fields = request.address().size() <= kMaxShortFieldBytes &&
                      request.version().size() <= kMaxShortFieldBytes;
  for (const v1::DeviceInfo& d : request.devices()) {
    short_fields = short_fields && d.name().size() <= kMaxShortFieldBytes;
  }
  if (!short_fields) {
    return absl::InvalidArgumentError(absl::StrCat("address, version and device names: at most ",
                                                   kMaxShortFieldBytes, " bytes each"));
  }
  return absl::OkStatus();
}

// `path` without "." and ".." and a trailing slash, for comparing directories.
std::string NormalPath(const std::string& path) {
  std::string normal = std::filesystem::path(path).lexically_normal().string();
  while (normal.size() > 1 && normal.back() == '/') normal.pop_back();
  return normal;
}

bool IsActive(const v1::Attempt& attempt) {
  return attempt.state() == v1::ATTEMPT_STATE_STARTING ||
         attempt.state() == v1::ATTEMPT_STATE_RUNNING;
}

std::string DeviceName(v1::Device device) { return device == v1::DEVICE_CUDA ? "cuda" : "cpu"; }

v1::Device DeviceOf(const v1::JobStatus& job) {
  return job.plan().device() == v1::DEVICE_UNSPECIFIED ? v1::DEVICE_CPU : job.plan().device();
}

int64_t RanksOf(const v1::JobStatus& job) { return std::max<int64_t>(1, job.plan().ranks()); }

// The per-rank peak a job is placed by: the memory model's, corrected by what earlier
// attempts measured; 0 while the planner does not predict it.
uint64_t PlannedPeak(const v1::Plan& plan) {
  return CorrectedTotal(plan.predicted_memory(), plan.memory_correction());
}

// An ended attempt whose measured peak can be held against its prediction: it ran a whole
// step and both are known.
bool Measured(const v1::Attempt& attempt) {
  return !IsActive(attempt) && attempt.progress().step() >= 1 &&
         attempt.predicted_memory().total() > 0 && attempt.peak_memory().total() > 0;
}

// Teaches `calibration` an ended attempt's measured peak.
void Learn(const v1::Plan& plan, const v1::Attempt& attempt, MemoryCalibration& calibration) {
  if (!Measured(attempt)) return;
  calibration.Record(plan.calibration_key(), attempt.predicted_memory().total(),
                     attempt.peak_memory().total());
}

}  // namespace

Scheduler::Scheduler(Store* store, const Clock* clock, const SchedulerOptions& options)
    : store_(store), clock_(clock), options_(options) {}

int64_t Scheduler::NowMs() const { return absl::ToUnixMillis(clock_->Now()); }

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(Store* store, const Clock* clock,
                                                             const SchedulerOptions& options) {
  std::unique_ptr<Scheduler> scheduler(new Scheduler(store, clock, options));
  LATHE_ASSIGN_OR_RETURN(std::vector<v1::JobStatus> jobs, store->LoadJobs());
  LATHE_ASSIGN_OR_RETURN(std::vector<v1::WorkerStatus> workers, store->LoadWorkers());
  absl::MutexLock lock(&scheduler->mu_);
  const absl::Time now = clock->Now();
  for (v1::WorkerStatus& status : workers) {
    WorkerState& worker = scheduler->workers_[status.worker_id()];
    worker.status = std::move(status);
    worker.status.set_busy_slots(0);
    worker.status.clear_running();
    worker.last_heartbeat = now;  // a grace period to register again
  }
  for (v1::JobStatus& status : jobs) {
    JobState& job = scheduler->jobs_[status.job_id()];
    job.status = std::move(status);
    job.sequence = scheduler->next_sequence_++;
    job.last_persisted = now;
    if (job.status.attempts().empty()) continue;
    const v1::Attempt& attempt = *job.status.attempts().rbegin();
    if (!IsActive(attempt)) continue;
    for (const v1::RankPlacement& p : attempt.placements()) {
      auto worker = scheduler->workers_.find(p.worker_id());
      if (worker == scheduler->workers_.end()) continue;
      worker->second.busy[p.slot()] = {job.status.job_id(), attempt.generation(), p.rank()};
      worker->second.status.set_busy_slots(static_cast<int64_t>(worker->second.busy.size()));
    }
  }
  // The corrections, learned again in the order the attempts ended.
  std::vector<std::pair<const v1::Plan*, const v1::Attempt*>> ended;
  for (const auto& [id, job] : scheduler->jobs_) {
    for (const v1::Attempt& attempt : job.status.attempts()) {
      ended.emplace_back(&job.status.plan(), &attempt);
    }
  }
  std::stable_sort(ended.begin(), ended.end(), [](const auto& a, const auto& b) {
    return a.second->ended_unix_ms() < b.second->ended_unix_ms();
  });
  for (const auto& [plan, attempt] : ended) Learn(*plan, *attempt, scheduler->calibration_);
  return scheduler;
}

absl::Status Scheduler::Commit(JobState& job, bool force_persist) {
  ++job.version;
  job.status.set_updated_unix_ms(NowMs());
  const absl::Time now = clock_->Now();
  if (!force_persist && now - job.last_persisted < absl::Seconds(1)) return absl::OkStatus();
  job.last_persisted = now;
  absl::Status status = store_->UpdateJob(job.status);
  if (!status.ok()) {
    spdlog::error("job={} persisting failed: {}", job.status.job_id(), status.ToString());
  }
  return status;
}

void Scheduler::SetQueueReason(JobState& job, const std::string& reason) {
  if (job.status.reason() == reason) return;
  job.status.set_reason(reason);
  ++job.version;  // watchers see it
  job.status.set_updated_unix_ms(NowMs());
}

void Scheduler::PersistWorker(const WorkerState& worker) {
  absl::Status status = store_->PutWorker(worker.status);
  if (!status.ok()) {
    spdlog::error("worker={} persisting failed: {}", worker.status.worker_id(), status.ToString());
  }
}

absl::StatusOr<v1::JobStatus> Scheduler::AddJob(v1::JobStatus job, absl::string_view request_id,
                                                bool* existing) {
  absl::MutexLock lock(&mu_);
  *existing = false;
  if (!request_id.empty()) {
    // A retry gets the job it created; another spec under the same id is a mistake.
    auto same = [&](const v1::JobStatus& earlier) -> absl::StatusOr<v1::JobStatus> {
      if (!google::protobuf::util::MessageDifferencer::Equals(earlier.spec(), job.spec())) {
        return absl::AlreadyExistsError(absl::StrCat("request_id ", request_id,
                                                     " already created job ", earlier.job_id(),
                                                     " with another spec; use a new request id"));
      }
      *existing = true;
      return earlier;
    };
    if (auto it = request_ids_.find(request_id); it != request_ids_.end()) {
      return same(jobs_.at(it->second).status);
    }
    LATHE_ASSIGN_OR_RETURN(std::optional<v1::JobStatus> stored,
                           store_->FindJobByRequestId(request_id));
    if (stored) {
      request_ids_[std::string(request_id)] = stored->job_id();
      auto it = jobs_.find(stored->job_id());
      return same(it != jobs_.end() ? it->second.status : *stored);
    }
  }
  // An output directory belongs to one job at a time: two would write one adapter and mix
  // their checkpoints.
  const std::string output = NormalPath(job.spec().output());
  for (const auto& [id, other] : jobs_) {
    if (!output.empty() && !IsFinalState(other.status.state()) &&
        NormalPath(other.status.spec().output()) == output) {
      return absl::FailedPreconditionError(
          absl::StrCat("spec: output: ", job.spec().output(), " belongs to job ", id, " (",
                       other.status.state() == v1::JOB_STATE_QUEUED ? "queued" : "running",
                       "); wait for it to end or choose another directory"));
    }
  }
  job.set_state(v1::JOB_STATE_QUEUED);
  job.set_reason("waiting to be scheduled");
  job.set_submitted_unix_ms(NowMs());
  job.set_updated_unix_ms(job.submitted_unix_ms());
  LATHE_RETURN_IF_ERROR(store_->CreateJob(job, request_id));
  const std::string id = job.job_id();
  JobState& state = jobs_[id];
  state.status = std::move(job);
  state.request_id = std::string(request_id);
  state.sequence = next_sequence_++;
  state.last_persisted = clock_->Now();
  if (!request_id.empty()) request_ids_[std::string(request_id)] = id;
  spdlog::info("job={} submitted", id);
  Schedule();
  return jobs_.at(id).status;
}

absl::StatusOr<v1::JobStatus> Scheduler::GetJob(absl::string_view job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job ", job_id, " not found"));
  return it->second.status;
}

std::vector<v1::JobStatus> Scheduler::ListJobs(const std::set<v1::JobState>& states) const {
  absl::MutexLock lock(&mu_);
  std::vector<const JobState*> selected;
  for (const auto& [id, job] : jobs_) {
    if (states.empty() || states.count(job.status.state())) selected.push_back(&job);
  }
  std::sort(selected.begin(), selected.end(),
            [](const JobState* a, const JobState* b) { return a->sequence > b->sequence; });
  std::vector<v1::JobStatus> result;
  result.reserve(selected.size());
  for (const JobState* job : selected) result.push_back(job->status);
  return result;
}

absl::StatusOr<v1::JobStatus> Scheduler::CancelJob(absl::string_view job_id,
                                                   absl::string_view reason) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job ", job_id, " not found"));
  JobState& job = it->second;
  if (IsFinalState(job.status.state())) return job.status;
  const std::string why =
      reason.empty() ? "cancelled by the user" : absl::StrCat("cancelled: ", reason);
  if (job.status.state() == v1::JOB_STATE_QUEUED) {
    job.status.set_state(v1::JOB_STATE_CANCELLED);
    job.status.set_reason(why);
    LATHE_RETURN_IF_ERROR(Commit(job));
  } else {
    EndAttempt(job, v1::ATTEMPT_STATE_CANCELLED, v1::JOB_STATE_CANCELLED, why);
    LATHE_RETURN_IF_ERROR(Commit(job));
  }
  spdlog::info("job={} {}", job.status.job_id(), why);
  Schedule();
  return job.status;
}

absl::StatusOr<v1::JobStatus> Scheduler::WaitForJobChange(absl::string_view job_id,
                                                          uint64_t* version,
                                                          absl::Time deadline) const {
  auto changed = [this, job_id, version]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    auto it = jobs_.find(job_id);
    return it == jobs_.end() || it->second.version != *version;
  };
  mu_.LockWhenWithDeadline(absl::Condition(&changed), deadline);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    mu_.Unlock();
    return absl::NotFoundError(absl::StrCat("job ", job_id, " not found"));
  }
  *version = it->second.version;
  v1::JobStatus status = it->second.status;
  mu_.Unlock();
  return status;
}

std::optional<uint64_t> Scheduler::FreeMemory(const WorkerState& worker, int64_t slot, size_t taken,
                                              uint64_t need) const {
  if (need == 0) return std::nullopt;
  if (worker.status.device() == v1::DEVICE_CUDA) {
    // One rank per GPU: the slot's device memory.
    for (const v1::DeviceInfo& d : worker.status.devices()) {
      if (d.index() == slot && d.memory_bytes() > 0) return d.memory_bytes();
    }
    return std::nullopt;
  }
  // CPU slots share the host's memory: what the ranks placed there (and the `taken` slots
  // of this placement) leave of it.
  const uint64_t host = worker.status.host_memory_bytes();
  if (host == 0) return std::nullopt;
  uint64_t used = taken * need;
  for (const auto& [busy_slot, ref] : worker.busy) {
    auto job = jobs_.find(ref.job_id);
    if (job != jobs_.end()) used += PlannedPeak(job->second.status.plan());
  }
  return used >= host ? 0 : host - used;
}

void Scheduler::Schedule() {
  std::vector<JobState*> queued;
  for (auto& [id, job] : jobs_) {
    if (job.status.state() == v1::JOB_STATE_QUEUED) queued.push_back(&job);
  }
  std::sort(queued.begin(), queued.end(), [](const JobState* a, const JobState* b) {
    if (a->status.spec().priority() != b->status.spec().priority()) {
      return a->status.spec().priority() > b->status.spec().priority();
    }
    return a->sequence < b->sequence;
  });
  // Jobs with ranks of an earlier attempt still on a slot: those may be writing the
  // checkpoint the next attempt should resume from (a drain, a cancelled peer), so the next
  // attempt waits for their end (the agent kills a rank 5 s after asking it to stop).
  std::map<std::string, int64_t> ending;  // job -> generation of a live rank
  for (const auto& [id, worker] : workers_) {
    for (const auto& [slot, ref] : worker.busy) ending[ref.job_id] = ref.generation;
  }
  const int64_t now_ms = NowMs();
  for (JobState* job : queued) {
    // A restart waiting out its backoff keeps its reason (CheckHeartbeats schedules again).
    if (job->status.restart_after_unix_ms() > now_ms) continue;
    if (auto live = ending.find(job->status.job_id()); live != ending.end()) {
      const std::string reason = absl::StrCat("waiting for the ranks of attempt ", live->second,
                                              " to end (they may be writing a checkpoint)");
      SetQueueReason(*job, reason);
      continue;
    }
    const int64_t ranks = RanksOf(job->status);
    const v1::Device device = DeviceOf(job->status);
    const uint64_t need = PlannedPeak(job->status.plan());
    // Live workers of the job's device, most free slots first, so ranks stay together.
    struct Candidate {
      WorkerState* worker;
      std::vector<int64_t> free_slots;
    };
    std::vector<Candidate> candidates;
    int64_t registered = 0, free = 0, fitting = 0;
    uint64_t largest_free = 0;  // memory of the roomiest free slot, when memory decides
    for (auto& [id, worker] : workers_) {
      if (worker.status.state() != v1::WORKER_STATE_READY || worker.session_id.empty() ||
          worker.status.device() != device) {
        continue;
      }
      registered += worker.status.slots();
      Candidate c{&worker, {}};
      int64_t free_here = 0;
      for (int64_t slot = 0; slot < worker.status.slots(); ++slot) {
        if (worker.busy.count(slot)) continue;
        ++free_here;
        const std::optional<uint64_t> memory = FreeMemory(worker, slot, c.free_slots.size(), need);
        if (memory) largest_free = std::max(largest_free, *memory);
        if (!memory || *memory >= need) c.free_slots.push_back(slot);
      }
      free += free_here;
      fitting += static_cast<int64_t>(c.free_slots.size());
      if (!c.free_slots.empty()) candidates.push_back(std::move(c));
    }
    if (fitting < ranks) {
      std::string reason =
          registered < ranks ? absl::StrFormat("needs %d %s slots; %d registered", ranks,
                                               DeviceName(device), registered)
          : free < ranks     ? absl::StrFormat("waiting for %d free %s slots; %d of %d free", ranks,
                                               DeviceName(device), free, registered)
                             : absl::StrFormat(
                                   "needs %s per rank on %d %s slots; %d of the %d free slots "
                                       "have that much (largest free %s)",
                                   FormatBytes(need), ranks, DeviceName(device), fitting, free,
                                   FormatBytes(largest_free));
      SetQueueReason(*job, reason);
      continue;
    }
    std::stable_sort(candidates.begin(), candidates.end(),
                     [](const Candidate& a, const Candidate& b) {
                       return a.free_slots.size() > b.free_slots.size();
                     });
    v1::Attempt* attempt = job->status.add_attempts();
    attempt->set_generation(job->status.attempts_size());
    attempt->set_state(v1::ATTEMPT_STATE_STARTING);
    attempt->set_started_unix_ms(NowMs());
    *attempt->mutable_predicted_memory() = job->status.plan().predicted_memory();
    int64_t rank = 0;
    for (Candidate& c : candidates) {
      for (int64_t slot : c.free_slots) {
        if (rank == ranks) break;
        v1::RankPlacement* p = attempt->add_placements();
        p->set_rank(rank);
        p->set_worker_id(c.worker->status.worker_id());
        p->set_slot(slot);
        c.worker->busy[slot] = {job->status.job_id(), attempt->generation(), rank};
        c.worker->status.set_busy_slots(static_cast<int64_t>(c.worker->busy.size()));
        v1::Assignment& a = c.worker->pending_assignments.emplace_back();
        a.set_job_id(job->status.job_id());
        a.set_generation(attempt->generation());
        a.set_rank(rank);
        a.set_world_size(ranks);
        a.set_slot(slot);
        *a.mutable_spec() = job->status.spec();
        *a.mutable_plan() = job->status.plan();
        ++rank;
      }
    }
    job->succeeded_ranks.clear();
    job->status.clear_restart_after_unix_ms();
    job->status.set_state(v1::JOB_STATE_RUNNING);
    job->status.set_reason("");
    spdlog::info("job={} attempt={} placed: {} ranks", job->status.job_id(), attempt->generation(),
                 ranks);
    (void)Commit(*job);
  }
}

void Scheduler::FreeSlot(const std::string& worker_id, int64_t slot) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return;
  it->second.busy.erase(slot);
  it->second.status.set_busy_slots(static_cast<int64_t>(it->second.busy.size()));
}

void Scheduler::EndAttempt(JobState& job, v1::AttemptState state, v1::JobState job_state,
                           const std::string& reason) {
  v1::Attempt* attempt = job.status.mutable_attempts(job.status.attempts_size() - 1);
  attempt->set_state(state);
  attempt->set_ended_unix_ms(NowMs());
  if (state == v1::ATTEMPT_STATE_FAILED) attempt->set_error(reason);
  Learn(job.status.plan(), *attempt, calibration_);
  for (const v1::RankPlacement& p : attempt->placements()) {
    auto worker = workers_.find(p.worker_id());
    if (worker == workers_.end()) continue;
    auto busy = worker->second.busy.find(p.slot());
    if (busy == worker->second.busy.end() || busy->second.job_id != job.status.job_id() ||
        busy->second.generation != attempt->generation()) {
      continue;  // that rank already ended
    }
    if (worker->second.status.state() == v1::WORKER_STATE_LOST) {
      FreeSlot(p.worker_id(), p.slot());
      continue;
    }
    // Drop the assignment if it was never delivered; otherwise stop the trainer. The slot
    // stays busy until the worker says the rank is gone.
    auto& pending = worker->second.pending_assignments;
    auto undelivered = std::find_if(pending.begin(), pending.end(), [&](const v1::Assignment& a) {
      return a.job_id() == job.status.job_id() && a.generation() == attempt->generation();
    });
    if (undelivered != pending.end()) {
      pending.erase(undelivered);
      FreeSlot(p.worker_id(), p.slot());
      continue;
    }
    v1::Cancellation& c = worker->second.pending_cancellations.emplace_back();
    c.set_job_id(job.status.job_id());
    c.set_generation(attempt->generation());
    c.set_reason(reason);
  }
  job.status.set_state(job_state);
  job.status.set_reason(reason);
}

void Scheduler::FailAttempt(JobState& job, const std::string& reason, v1::FailureKind kind,
                            bool charged) {
  v1::Attempt* attempt = job.status.mutable_attempts(job.status.attempts_size() - 1);
  attempt->set_failure(kind);
  if (!charged) {  // moved by an operator: at once, and not one of the job's restarts
    EndAttempt(job, v1::ATTEMPT_STATE_FAILED, v1::JOB_STATE_QUEUED, reason);
    job.status.set_reason(
        absl::StrCat("moving after attempt ", attempt->generation(), " was stopped: ", reason));
    (void)Commit(job);
    return;
  }
  const int64_t max_restarts = job.status.spec().max_restarts();
  if (kind != v1::FAILURE_KIND_INFRASTRUCTURE || job.status.restarts() >= max_restarts) {
    EndAttempt(job, v1::ATTEMPT_STATE_FAILED, v1::JOB_STATE_FAILED, reason);
    if (kind == v1::FAILURE_KIND_INFRASTRUCTURE && max_restarts > 0) {
      job.status.set_reason(
          absl::StrCat(reason, " (no restarts left: max_restarts ", max_restarts, ")"));
    }
    (void)Commit(job);
    return;
  }
  // Again from the newest checkpoint (the trainer finds it in the output directory): at
  // once when the failed attempt trained, else after a backoff that doubles with each
  // attempt in a row that did not (a crash loop).
  int64_t stalled = 0;
  for (auto a = job.status.attempts().rbegin(); a != job.status.attempts().rend(); ++a) {
    if (a->progress().step() > a->resumed_from_step()) break;
    ++stalled;
  }
  const int64_t restart = job.status.restarts() + 1;
  const absl::Duration backoff =
      stalled == 0
          ? absl::ZeroDuration()
          : std::min(options_.restart_backoff * (int64_t{1} << std::min<int64_t>(stalled - 1, 20)),
                     options_.max_restart_backoff);
  EndAttempt(job, v1::ATTEMPT_STATE_FAILED, v1::JOB_STATE_QUEUED, reason);
  job.status.set_restarts(restart);
  job.status.set_restart_after_unix_ms(absl::ToUnixMillis(clock_->Now() + backoff));
  job.status.set_reason(
      absl::StrCat("restart ", restart, " of ", max_restarts, stalled == 0 ? " at once" : " in ",
                   stalled == 0 ? "" : absl::FormatDuration(backoff), " after attempt ",
                   attempt->generation(), " failed: ", reason));
  spdlog::warn("job={} {}", job.status.job_id(), job.status.reason());
  (void)Commit(job);
}

absl::StatusOr<v1::RegisterWorkerResponse> Scheduler::RegisterWorker(
    const v1::RegisterWorkerRequest& request) {
  LATHE_RETURN_IF_ERROR(CheckRegistration(request));
  absl::MutexLock lock(&mu_);
  WorkerState& worker = workers_[request.worker_id()];
  worker.session_id = absl::StrFormat("%s/%d/%016x", request.worker_id(), ++next_session_,
                                      absl::Uniform<uint64_t>(absl::BitGen()));
  worker.last_heartbeat = clock_->Now();
  worker.reconcile = true;
  v1::WorkerStatus& s = worker.status;
  s.set_worker_id(request.worker_id());
  // A drained worker stays drained when its agent registers again.
  if (s.state() != v1::WORKER_STATE_DRAINING) s.set_state(v1::WORKER_STATE_READY);
  s.set_address(request.address());
  s.set_device(request.device() == v1::DEVICE_UNSPECIFIED ? v1::DEVICE_CPU : request.device());
  s.set_slots(request.slots());
  *s.mutable_devices() = request.devices();
  s.set_host_memory_bytes(request.host_memory_bytes());
  s.set_last_heartbeat_unix_ms(NowMs());
  s.set_busy_slots(static_cast<int64_t>(worker.busy.size()));
  PersistWorker(worker);
  spdlog::info("worker={} registered: {} {} slots", request.worker_id(), DeviceName(s.device()),
               request.slots());
  Schedule();
  v1::RegisterWorkerResponse response;
  response.set_worker_id(request.worker_id());
  response.set_session_id(worker.session_id);
  response.set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
  response.set_heartbeat_timeout_ms(absl::ToInt64Milliseconds(options_.heartbeat_timeout));
  return response;
}

absl::StatusOr<v1::HeartbeatResponse> Scheduler::Heartbeat(const v1::HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(request.worker_id());
  if (it == workers_.end() || it->second.session_id.empty() ||
      it->second.session_id != request.session_id()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker ", request.worker_id(), ": unknown or expired session; register again"));
  }
  WorkerState& worker = it->second;
  worker.last_heartbeat = clock_->Now();
  worker.status.set_last_heartbeat_unix_ms(NowMs());
  worker.status.clear_running();
  std::set<int64_t> reported;
  v1::HeartbeatResponse response;
  for (const v1::SlotStatus& slot : request.slots()) {
    if (slot.job_id().empty()) continue;
    *worker.status.add_running() = slot;
    reported.insert(slot.slot());
    if (!IsActiveAttemptLocked(slot.job_id(), slot.generation())) {
      bool pending =
          std::any_of(worker.pending_cancellations.begin(), worker.pending_cancellations.end(),
                      [&](const v1::Cancellation& c) {
                        return c.job_id() == slot.job_id() && c.generation() == slot.generation();
                      });
      if (!pending) {
        v1::Cancellation& c = worker.pending_cancellations.emplace_back();
        c.set_job_id(slot.job_id());
        c.set_generation(slot.generation());
        c.set_reason("the attempt is no longer current");
      }
    }
  }
  // After a registration: ranks placed here that the worker does not run and will not
  // receive are lost.
  std::set<std::string> lost_jobs;
  if (worker.reconcile) {
    worker.reconcile = false;
    for (const auto& [slot, ref] : worker.busy) {
      if (reported.count(slot) || !IsActiveAttemptLocked(ref.job_id, ref.generation)) continue;
      const bool pending =
          std::any_of(worker.pending_assignments.begin(), worker.pending_assignments.end(),
                      [&](const v1::Assignment& a) {
                        return a.job_id() == ref.job_id && a.generation() == ref.generation;
                      });
      if (!pending) lost_jobs.insert(ref.job_id);
    }
  }
  for (const std::string& job_id : lost_jobs) {
    FailAttempt(jobs_.find(job_id)->second,
                absl::StrCat("worker ", worker.status.worker_id(),
                             " registered again without its rank of this attempt (the "
                             "coordinator or the agent restarted)"),
                v1::FAILURE_KIND_INFRASTRUCTURE);
  }
  // Slots of ended attempts that the worker no longer runs are free again.
  bool freed = !lost_jobs.empty();
  for (auto busy = worker.busy.begin(); busy != worker.busy.end();) {
    if (!IsActiveAttemptLocked(busy->second.job_id, busy->second.generation) &&
        !reported.count(busy->first)) {
      busy = worker.busy.erase(busy);
      freed = true;
    } else {
      ++busy;
    }
  }
  worker.status.set_busy_slots(static_cast<int64_t>(worker.busy.size()));
  for (v1::Assignment& a : worker.pending_assignments) *response.add_assignments() = std::move(a);
  worker.pending_assignments.clear();
  for (v1::Cancellation& c : worker.pending_cancellations) {
    *response.add_cancellations() = std::move(c);
  }
  worker.pending_cancellations.clear();
  if (freed) Schedule();
  return response;
}

absl::Status Scheduler::ReportProgress(const v1::ReportProgressRequest& request) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(request.job_id());
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job ", request.job_id(), " not found"));
  }
  JobState& job = it->second;
  if (job.status.attempts().empty() ||
      job.status.attempts().rbegin()->generation() != request.generation()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", request.job_id(), ": stale generation ", request.generation(),
                     " (current is ", job.status.attempts_size(), ")"));
  }
  v1::Attempt* attempt = job.status.mutable_attempts(job.status.attempts_size() - 1);
  const v1::RankPlacement* placement = nullptr;
  for (const v1::RankPlacement& p : attempt->placements()) {
    if (p.rank() == request.rank() && p.worker_id() == request.worker_id()) placement = &p;
  }
  if (placement == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("job ", request.job_id(), ": rank ",
                                                      request.rank(), " is not placed on worker ",
                                                      request.worker_id()));
  }
  // A result lies where the trainer writes it, in the job's output directory.
  const std::string output = NormalPath(job.status.spec().output());
  for (const auto& [field, path, name] :
       {std::tuple{"adapter_path", &request.adapter_path(), "adapter"},
        std::tuple{"model_path", &request.model_path(), "model"}}) {
    if (!path->empty() && NormalPath(*path) != absl::StrCat(output, "/", name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", path->substr(0, 256), " is not ", output, "/", name));
    }
  }
  const bool terminal_event = request.event() == v1::RANK_EVENT_SUCCEEDED ||
                              request.event() == v1::RANK_EVENT_FAILED ||
                              request.event() == v1::RANK_EVENT_CANCELLED;
  if (!IsActive(*attempt)) {
    if (terminal_event) {
      FreeSlot(placement->worker_id(), placement->slot());
      Schedule();
      return absl::OkStatus();
    }
    return absl::FailedPreconditionError(absl::StrCat("job ", request.job_id(), ": attempt ",
                                                      request.generation(), " has already ended"));
  }
  const std::string where =
      absl::StrCat("rank ", request.rank(), " on worker ", request.worker_id());
  if (request.progress().memory().total() > attempt->peak_memory().total()) {
    *attempt->mutable_peak_memory() = request.progress().memory();
  }
  switch (request.event()) {
    case v1::RANK_EVENT_STARTED:
      attempt->set_state(v1::ATTEMPT_STATE_RUNNING);
      return Commit(job);
    case v1::RANK_EVENT_PROGRESS:
      attempt->set_state(v1::ATTEMPT_STATE_RUNNING);
      if (request.rank() == 0) {
        *attempt->mutable_progress() = request.progress();
        attempt->mutable_progress()->set_updated_unix_ms(NowMs());
        if (request.resumed_from_step() > 0) {
          attempt->set_resumed_from_step(request.resumed_from_step());
        }
      }
      return Commit(job, /*force_persist=*/request.resumed_from_step() > 0);
    case v1::RANK_EVENT_SUCCEEDED: {
      FreeSlot(placement->worker_id(), placement->slot());
      job.succeeded_ranks.insert(request.rank());
      if (request.rank() == 0) {
        if (request.has_progress()) *attempt->mutable_progress() = request.progress();
        if (request.progress().has_loss()) job.status.set_final_loss(request.progress().loss());
        job.status.set_adapter_path(request.adapter_path());
        job.status.set_model_path(request.model_path());
      }
      if (static_cast<int64_t>(job.succeeded_ranks.size()) == attempt->placements_size()) {
        attempt->set_state(v1::ATTEMPT_STATE_SUCCEEDED);
        attempt->set_ended_unix_ms(NowMs());
        Learn(job.status.plan(), *attempt, calibration_);
        job.status.set_state(v1::JOB_STATE_SUCCEEDED);
        job.status.set_reason("");
        spdlog::info("job={} succeeded", job.status.job_id());
      }
      absl::Status status = Commit(job);
      Schedule();
      return status;
    }
    case v1::RANK_EVENT_FAILED:
    case v1::RANK_EVENT_CANCELLED: {
      FreeSlot(placement->worker_id(), placement->slot());
      // The error's head names the cause and its tail the last log lines: a long one keeps
      // both ends.
      std::string error = request.error();
      if (error.size() > kMaxErrorBytes) {
        error = absl::StrCat(error.substr(0, kMaxErrorBytes / 2), "\n[... ",
                             error.size() - kMaxErrorBytes, " bytes left out ...]\n",
                             error.substr(error.size() - kMaxErrorBytes / 2));
      }
      std::string reason = request.event() == v1::RANK_EVENT_FAILED
                               ? absl::StrCat(where, " failed: ", error)
                               : absl::StrCat(where, " was stopped by its worker");
      spdlog::warn("job={} attempt={} {}", job.status.job_id(), request.generation(), reason);
      FailAttempt(job, reason,
                  request.event() == v1::RANK_EVENT_CANCELLED ? v1::FAILURE_KIND_INFRASTRUCTURE
                                                              : request.failure());
      Schedule();
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError("event: must be set");
  }
}

void Scheduler::CheckHeartbeats() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  bool changed = false;
  for (auto& [id, worker] : workers_) {
    if (worker.status.state() == v1::WORKER_STATE_LOST ||
        now - worker.last_heartbeat <= options_.heartbeat_timeout) {
      continue;
    }
    const std::string reason = absl::StrCat(
        "worker ", id, " lost: no heartbeat for ",
        absl::FormatDuration(absl::Trunc(now - worker.last_heartbeat, absl::Seconds(1))));
    spdlog::warn("{}", reason);
    worker.status.set_state(v1::WORKER_STATE_LOST);
    worker.session_id.clear();
    worker.pending_assignments.clear();
    worker.pending_cancellations.clear();
    std::map<int64_t, SlotRef> busy = std::move(worker.busy);
    worker.busy.clear();
    worker.status.set_busy_slots(0);
    worker.status.clear_running();
    PersistWorker(worker);
    for (const auto& [slot, ref] : busy) {
      if (IsActiveAttemptLocked(ref.job_id, ref.generation)) {
        FailAttempt(jobs_.find(ref.job_id)->second, reason, v1::FAILURE_KIND_INFRASTRUCTURE);
      }
    }
    changed = true;
  }
  // Restarts whose backoff has passed.
  for (const auto& [id, job] : jobs_) {
    changed = changed || (job.status.state() == v1::JOB_STATE_QUEUED &&
                          job.status.restart_after_unix_ms() > 0 &&
                          job.status.restart_after_unix_ms() <= absl::ToUnixMillis(now));
  }
  if (changed) Schedule();
}

std::vector<v1::WorkerStatus> Scheduler::ListWorkers() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::WorkerStatus> result;
  for (const auto& [id, worker] : workers_) result.push_back(worker.status);
  return result;
}

MemoryCalibration Scheduler::Calibration() const {
  absl::MutexLock lock(&mu_);
  return calibration_;
}

v1::GetPlanHistoryResponse Scheduler::PlanHistory(size_t limit) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<const v1::JobStatus*, const v1::Attempt*>> measured;
  for (const auto& [id, job] : jobs_) {
    for (const v1::Attempt& attempt : job.status.attempts()) {
      if (Measured(attempt)) measured.emplace_back(&job.status, &attempt);
    }
  }
  std::sort(measured.begin(), measured.end(), [](const auto& a, const auto& b) {
    return a.second->ended_unix_ms() > b.second->ended_unix_ms();
  });
  v1::GetPlanHistoryResponse response;
  for (size_t i = 0; i < measured.size() && i < limit; ++i) {
    const auto& [job, attempt] = measured[i];
    v1::PlanHistoryEntry* e = response.add_attempts();
    e->set_job_id(job->job_id());
    e->set_generation(attempt->generation());
    e->set_state(attempt->state());
    e->set_ended_unix_ms(attempt->ended_unix_ms());
    e->set_calibration_key(job->plan().calibration_key());
    *e->mutable_predicted() = attempt->predicted_memory();
    e->set_memory_correction(job->plan().memory_correction());
    *e->mutable_measured() = attempt->peak_memory();
  }
  for (const auto& [key, correction] : calibration_.All()) {
    v1::MemoryCorrection* c = response.add_corrections();
    c->set_calibration_key(key);
    c->set_factor(correction.factor);
    c->set_attempts(correction.samples);
  }
  return response;
}

absl::StatusOr<v1::WorkerStatus> Scheduler::DrainWorker(absl::string_view worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("worker ", worker_id, " not found"));
  }
  WorkerState& worker = it->second;
  if (worker.status.state() == v1::WORKER_STATE_READY) {
    worker.status.set_state(v1::WORKER_STATE_DRAINING);
    PersistWorker(worker);
    spdlog::info("worker={} draining", std::string(worker_id));
  }
  // Its ranks' attempts end (the trainers checkpoint on SIGTERM) and their jobs queue again.
  std::set<std::string> moving;
  for (const auto& [slot, ref] : worker.busy) {
    if (IsActiveAttemptLocked(ref.job_id, ref.generation)) moving.insert(ref.job_id);
  }
  for (const std::string& job_id : moving) {
    FailAttempt(jobs_.find(job_id)->second, absl::StrCat("worker ", worker_id, " is being drained"),
                v1::FAILURE_KIND_INFRASTRUCTURE, /*charged=*/false);
  }
  Schedule();
  return worker.status;
}

absl::Status Scheduler::RemoveWorker(absl::string_view worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("worker ", worker_id, " not found"));
  }
  // A live worker would only register again: it must be lost (its agent stopped) first.
  if (it->second.status.state() != v1::WORKER_STATE_LOST) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", worker_id, " is not lost; drain it (lathe workers drain), stop ",
                     "its agent, and remove it once the coordinator has lost it"));
  }
  LATHE_RETURN_IF_ERROR(store_->DeleteWorker(worker_id));
  workers_.erase(it);
  spdlog::info("worker={} removed", std::string(worker_id));
  return absl::OkStatus();
}

bool Scheduler::IsActiveAttempt(absl::string_view job_id, int64_t generation) const {
  absl::MutexLock lock(&mu_);
  return IsActiveAttemptLocked(job_id, generation);
}

bool Scheduler::IsActiveAttemptLocked(absl::string_view job_id, int64_t generation) const {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || it->second.status.attempts().empty()) return false;
  const v1::Attempt& attempt = *it->second.status.attempts().rbegin();
  return attempt.generation() == generation && IsActive(attempt);
}

}  // namespace lathe
