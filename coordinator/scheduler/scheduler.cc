#include "coordinator/scheduler/scheduler.h"

#include <algorithm>
#include <filesystem>
#include <queue>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "common/profile_limits.h"
#include "common/proto/job_state.h"
#include "common/proto/memory_breakdown.h"
#include "common/status_macros.h"
#include "google/protobuf/util/message_differencer.h"
#include "spdlog/spdlog.h"

namespace lathe {
namespace {

// A rank's error is untrusted input: whatever the coordinator keeps of it stays small.
constexpr size_t kMaxErrorBytes = 16 << 10;

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

void DurationHistogram::Observe(absl::Duration value) {
  const double seconds = absl::ToDoubleSeconds(value);
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (seconds <= bounds[i]) ++counts[i];
  }
  ++count;
  sum += seconds;
}

Scheduler::Scheduler(Store* store, const Clock* clock, const SchedulerOptions& options)
    : store_(store),
      clock_(clock),
      options_(options),
      registry_(clock, options.heartbeat_timeout),
      commit_(store) {
  counters_.pass_seconds =
      DurationHistogram({0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1});
  counters_.queue_seconds = DurationHistogram({1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600});
}

int64_t Scheduler::NowMs() const { return absl::ToUnixMillis(clock_->Now()); }

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(Store* store, const Clock* clock,
                                                             const SchedulerOptions& options) {
  std::unique_ptr<Scheduler> scheduler(new Scheduler(store, clock, options));
  LATHE_ASSIGN_OR_RETURN(std::vector<v1::JobStatus> jobs, store->LoadJobs());
  LATHE_ASSIGN_OR_RETURN(std::vector<v1::WorkerStatus> workers, store->LoadWorkers());
  Scheduler& s = *scheduler;
  absl::MutexLock lock(&s.mu_);
  const absl::Time now = clock->Now();
  for (v1::WorkerStatus& status : workers) {
    WorkerState& worker = s.workers_[status.worker_id()];
    worker.status = std::move(status);
    worker.status.set_busy_slots(0);
    worker.status.clear_running();
    s.registry_.Restore(worker.status.worker_id(), worker.status.state() != v1::WORKER_STATE_LOST);
  }
  for (v1::JobStatus& status : jobs) {
    JobState& job = s.jobs_[status.job_id()];
    job.status = std::move(status);
    job.sequence = s.next_sequence_++;
    job.class_key = {DeviceOf(job.status), RanksOf(job.status), PlannedPeak(job.status.plan())};
    job.last_persisted = now;
    s.by_sequence_[job.sequence] = &job;
    s.by_state_[job.status.state()].insert(job.sequence);
    s.by_name_[job.status.spec().name()].insert(job.sequence);
    const std::string output = NormalPath(job.status.spec().output());
    if (!IsFinalState(job.status.state()) && !output.empty()) {
      s.active_outputs_[output] = job.status.job_id();
    }
  }
  for (auto& [id, job] : s.jobs_) {
    if (job.status.attempts().empty()) continue;
    const v1::Attempt& attempt = *job.status.attempts().rbegin();
    if (!IsActive(attempt)) continue;
    for (const v1::RankPlacement& p : attempt.placements()) {
      auto worker = s.workers_.find(p.worker_id());
      if (worker == s.workers_.end()) continue;
      s.MarkBusy(worker->second, p.slot(),
                 {id, attempt.generation(), p.rank(), std::get<2>(job.class_key)});
    }
  }
  for (auto& [id, job] : s.jobs_) s.Reindex(job);
  // The corrections, learned again in the order the attempts ended.
  std::vector<std::pair<const v1::Plan*, const v1::Attempt*>> ended;
  for (const auto& [id, job] : s.jobs_) {
    for (const v1::Attempt& attempt : job.status.attempts()) {
      ended.emplace_back(&job.status.plan(), &attempt);
    }
  }
  std::stable_sort(ended.begin(), ended.end(), [](const auto& a, const auto& b) {
    return a.second->ended_unix_ms() < b.second->ended_unix_ms();
  });
  for (const auto& [plan, attempt] : ended) Learn(*plan, *attempt, s.calibration_);
  return scheduler;
}

// --- the scheduling loop --------------------------------------------------------------

void Scheduler::RequestPass() {
  absl::MutexLock lock(&work_mu_);
  pass_requested_ = true;
}

void Scheduler::WaitForWork(absl::Duration timeout) const {
  auto work = [this]() ABSL_SHARED_LOCKS_REQUIRED(work_mu_) {
    return pass_requested_ || reports_waiting_;
  };
  work_mu_.LockWhenWithTimeout(absl::Condition(&work), timeout);
  work_mu_.Unlock();
}

void Scheduler::Settle() {
  uint64_t sequence = 0;
  std::set<std::string> notify;
  {
    absl::MutexLock lock(&mu_);
    {
      // Cleared before the reports are taken: one left after this still wakes the loop.
      absl::MutexLock work_lock(&work_mu_);
      reports_waiting_ = false;
    }
    const std::vector<WorkerRegistry::Report> reports = registry_.TakeReports();
    for (const WorkerRegistry::Report& report : reports) ProcessReport(report);
    stats_.heartbeat_reports += static_cast<int64_t>(reports.size());
    bool pass = false;
    {
      absl::MutexLock work_lock(&work_mu_);
      std::swap(pass, pass_requested_);
    }
    if (pass) {
      const absl::Time start = absl::Now();
      RunPass();
      const absl::Duration took = absl::Now() - start;
      ++stats_.passes;
      counters_.pass_seconds.Observe(took);
      stats_.total += took;
      stats_.longest = std::max(stats_.longest, took);
    }
    sequence = Stage();
    // Every mail posted so far is in a batch up to `sequence` (posts happen under mu_).
    notify = registry_.TakeWaiting();
  }
  absl::Status durable = commit_.WaitDurable(sequence);
  if (!durable.ok()) {
    // Retried by every Settle (10 a second): logged when it changes, else every minute.
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (durable.message() != last_write_error_ ||
        now - last_write_error_logged_ > absl::Minutes(1)) {
      spdlog::error("persisting the scheduler's changes failed (retried with the next ones): {}",
                    durable.ToString());
      last_write_error_ = std::string(durable.message());
      last_write_error_logged_ = now;
    }
    return;  // assignments wait for their placement to be durable
  }
  registry_.Notify(notify);
}

PassStats Scheduler::TakePassStats() {
  absl::MutexLock lock(&mu_);
  PassStats stats = stats_;
  stats_ = PassStats();
  return stats;
}

SchedulerSnapshot Scheduler::Snapshot(absl::Duration grace) const {
  absl::MutexLock lock(&mu_);
  SchedulerSnapshot snapshot = counters_;
  snapshot.heartbeats = registry_.heartbeats();
  for (const auto& [state, sequences] : by_state_) {
    snapshot.jobs[state] = static_cast<int64_t>(sequences.size());
  }
  for (const auto& [key, c] : classes_) {
    snapshot.queued_eligible += static_cast<int64_t>(c.queue.size());
  }
  for (const auto& [id, worker] : workers_) ++snapshot.workers[worker.status.state()];
  for (const auto& [device, slots] : ready_slots_) snapshot.slots[device] = slots;
  for (const auto& [device, free] : free_slots_) snapshot.free_slots[device] = free;
  auto show = [&](const JobState& job) {
    SchedulerSnapshot::Job& shown = snapshot.jobs_shown.emplace_back();
    shown.job_id = job.status.job_id();
    shown.name = job.status.spec().name();
    shown.state = job.status.state();
    shown.predicted_memory = job.status.plan().predicted_memory();
    shown.memory_correction = job.status.plan().memory_correction();
    if (job.status.attempts().empty()) return;
    const v1::Attempt& attempt = *job.status.attempts().rbegin();
    for (const v1::Attempt& earlier : job.status.attempts()) {
      if (&earlier != &attempt) {
        shown.steps_before = std::max(shown.steps_before, earlier.progress().step());
      }
    }
    shown.generation = attempt.generation();
    shown.progress = attempt.progress();
    shown.peak_memory = attempt.peak_memory();
  };
  if (auto running = by_state_.find(v1::JOB_STATE_RUNNING); running != by_state_.end()) {
    for (int64_t sequence : running->second) show(*by_sequence_.at(sequence));
  }
  const int64_t since = NowMs() - absl::ToInt64Milliseconds(grace);
  std::set<std::string> shown_ended;
  for (auto it = ended_.rbegin(); it != ended_.rend() && it->first >= since; ++it) {
    auto job = jobs_.find(it->second);
    if (job != jobs_.end() && shown_ended.insert(it->second).second) show(job->second);
  }
  return snapshot;
}

// --- writes ---------------------------------------------------------------------------

void Scheduler::Touch(JobState& job, bool persist) {
  job.status.set_updated_unix_ms(NowMs());
  auto* history = job.status.mutable_history();
  if (history->empty() || history->rbegin()->state() != job.status.state()) {
    v1::StateChange* change = history->Add();
    change->set_state(job.status.state());
    change->set_unix_ms(job.status.updated_unix_ms());
    change->set_by(acting_.empty() ? "the coordinator" : acting_);
    change->set_reason(job.status.reason().substr(0, 1024));
    // The submission and the latest changes: a job restarted again and again stays small.
    constexpr int kMaxHistory = 64;
    if (history->size() > kMaxHistory) history->DeleteSubrange(1, history->size() - kMaxHistory);
    persist = true;
  }
  NotifyWatchers(job);
  const absl::Time now = clock_->Now();
  if (!persist && now - job.last_persisted < absl::Seconds(1)) return;
  job.last_persisted = now;
  dirty_jobs_.insert(job.status.job_id());
}

void Scheduler::MarkWorkerDirty(const WorkerState& worker) {
  dirty_workers_.insert(worker.status.worker_id());
}

uint64_t Scheduler::Stage() {
  StoreBatch batch;
  for (const std::string& id : dirty_jobs_) batch.jobs.push_back(jobs_.at(id).status);
  for (const std::string& id : dirty_workers_) {
    auto worker = workers_.find(id);
    if (worker != workers_.end()) batch.workers.push_back(worker->second.status);
  }
  batch.deleted_workers.assign(deleted_workers_.begin(), deleted_workers_.end());
  dirty_jobs_.clear();
  dirty_workers_.clear();
  deleted_workers_.clear();
  return commit_.Stage(std::move(batch));
}

// --- indexes --------------------------------------------------------------------------

v1::JobStatus Scheduler::View(const JobState& job) const {
  v1::JobStatus view = job.status;
  if (job.status.state() != v1::JOB_STATE_QUEUED || job.status.restart_after_unix_ms() > NowMs()) {
    return view;  // a restart waiting out its backoff keeps its reason
  }
  if (job.live_ranks > 0 && !job.status.attempts().empty()) {
    view.set_reason(absl::StrCat("waiting for the ranks of attempt ",
                                 job.status.attempts().rbegin()->generation(),
                                 " to end (they may be writing a checkpoint)"));
  } else if (auto c = classes_.find(job.class_key);
             job.queued && c != classes_.end() && !c->second.reason.empty()) {
    view.set_reason(c->second.reason);
  }
  return view;
}

void Scheduler::NotifyWatchers(const JobState& job) {
  auto [begin, end] = watches_by_job_.equal_range(job.status.job_id());
  if (begin == end) return;
  auto view = std::make_shared<const v1::JobStatus>(View(job));
  for (auto it = begin; it != end; ++it) watches_.at(it->second).second(view);
}

void Scheduler::SetJobState(JobState& job, v1::JobState state) {
  const v1::JobState before = job.status.state();
  if (before != state) {
    by_state_[before].erase(job.sequence);
    by_state_[state].insert(job.sequence);
    job.status.set_state(state);
    if (state == v1::JOB_STATE_QUEUED) job.queued_since = clock_->Now();
    if (IsFinalState(state)) {
      // Shown by Snapshot for a grace period (at most an hour).
      const int64_t now_ms = NowMs();
      ended_.emplace_back(now_ms, job.status.job_id());
      while (ended_.front().first < now_ms - 3600 * 1000) ended_.pop_front();
      auto output = active_outputs_.find(NormalPath(job.status.spec().output()));
      if (output != active_outputs_.end() && output->second == job.status.job_id()) {
        active_outputs_.erase(output);
      }
    }
  }
  Reindex(job);
}

std::map<std::string, std::string>::const_iterator Scheduler::OverlappingOutput(
    const std::string& output) const {
  for (std::filesystem::path p(output);; p = p.parent_path()) {  // itself and its parents
    if (auto it = active_outputs_.find(p.string()); it != active_outputs_.end()) return it;
    if (p == p.parent_path()) break;
  }
  const std::string below = output == "/" ? output : output + "/";
  auto it = active_outputs_.lower_bound(below);  // the first directory inside it, if any
  if (it != active_outputs_.end() && absl::StartsWith(it->first, below)) return it;
  return active_outputs_.end();
}

void Scheduler::Reindex(JobState& job) {
  const bool is_queued = job.status.state() == v1::JOB_STATE_QUEUED;
  const int64_t restart_at = job.status.restart_after_unix_ms();
  const bool backing_off = is_queued && restart_at > NowMs();
  const bool queue = is_queued && !backing_off && job.live_ranks == 0;
  const QueueKey key{-job.status.spec().priority(), job.sequence};
  if (queue != job.queued) {
    JobClass& c = classes_[job.class_key];
    if (queue) {
      c.queue.insert(key);
      RequestPass();
    } else {
      c.queue.erase(key);
      if (c.queue.empty()) classes_.erase(job.class_key);
    }
    job.queued = queue;
  }
  if (job.backing_off) backoff_.erase({job.backoff_at, job.sequence});
  job.backing_off = backing_off;
  job.backoff_at = restart_at;
  if (backing_off) backoff_.insert({restart_at, job.sequence});
}

void Scheduler::IndexWorker(WorkerState& worker) {
  const std::string& id = worker.status.worker_id();
  const v1::Device before = worker.indexed_device;
  ready_slots_[before] -= worker.indexed_slots;
  free_slots_[before] -= worker.indexed_free;
  if (worker.indexed_free > 0) free_index_[before].erase({-worker.indexed_free, id});
  const bool ready = worker.status.state() == v1::WORKER_STATE_READY && !worker.session_id.empty();
  const int64_t slots = ready ? worker.status.slots() : 0;
  const int64_t free = std::max<int64_t>(0, slots - static_cast<int64_t>(worker.busy.size()));
  const v1::Device device = worker.status.device();
  ready_slots_[device] += slots;
  free_slots_[device] += free;
  if (free > 0) free_index_[device].insert({-free, id});
  worker.indexed_device = device;
  worker.indexed_slots = slots;
  worker.indexed_free = free;
  worker.status.set_busy_slots(static_cast<int64_t>(worker.busy.size()));
}

void Scheduler::MarkBusy(WorkerState& worker, int64_t slot, SlotRef ref) {
  auto job = jobs_.find(ref.job_id);
  if (job != jobs_.end()) ++job->second.live_ranks;
  worker.busy_memory += ref.memory;
  worker.busy[slot] = std::move(ref);
  IndexWorker(worker);
}

void Scheduler::FreeSlot(const std::string& worker_id, int64_t slot) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return;
  WorkerState& worker = it->second;
  auto busy = worker.busy.find(slot);
  if (busy == worker.busy.end()) return;
  const SlotRef ref = busy->second;
  worker.busy.erase(busy);
  worker.busy_memory -= std::min(worker.busy_memory, ref.memory);
  IndexWorker(worker);
  RequestPass();
  auto job = jobs_.find(ref.job_id);
  if (job != jobs_.end() && --job->second.live_ranks == 0) {
    Reindex(job->second);
    NotifyWatchers(job->second);
  }
}

// --- placement ------------------------------------------------------------------------

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
  const uint64_t used = taken * need + worker.busy_memory;
  return used >= host ? 0 : host - used;
}

void Scheduler::RunPass() {
  // The head of every class, best first; a class leaves at its first job that does not fit.
  using Head = std::pair<QueueKey, ClassKey>;
  std::priority_queue<Head, std::vector<Head>, std::greater<Head>> heads;
  for (const auto& [key, c] : classes_) heads.push({*c.queue.begin(), key});
  while (!heads.empty()) {
    const auto [head, key] = heads.top();
    heads.pop();
    JobState& job = *by_sequence_.at(head.second);
    std::optional<std::string> why = TryPlace(job);
    auto c = classes_.find(key);  // placing the last job of a class removes it
    if (!why) {
      ++stats_.placed;
      if (c != classes_.end()) heads.push({*c->second.queue.begin(), key});
      continue;
    }
    if (c->second.reason != *why) {
      c->second.reason = *why;
      // Its queued jobs' reason changed: tell their watchers (a few), not every job.
      for (const auto& [id, watch] : watches_) {
        auto watched = jobs_.find(watch.first);
        if (watched != jobs_.end() && watched->second.queued && watched->second.class_key == key) {
          watch.second(std::make_shared<const v1::JobStatus>(View(watched->second)));
        }
      }
    }
  }
}

std::optional<std::string> Scheduler::TryPlace(JobState& job) {
  const auto& [device, ranks, need] = job.class_key;
  const int64_t registered = ready_slots_[device];
  const int64_t free = free_slots_[device];
  if (registered < ranks) {
    return absl::StrFormat("needs %d %s slots; %d registered", ranks, DeviceName(device),
                           registered);
  }
  if (free < ranks) {
    return absl::StrFormat("waiting for %d free %s slots; %d of %d free", ranks, DeviceName(device),
                           free, registered);
  }
  // Workers with free slots, most free first, so that ranks stay together.
  struct Pick {
    WorkerState* worker;
    std::vector<int64_t> slots;
  };
  std::vector<Pick> picks;
  int64_t fitting = 0;
  uint64_t largest_free = 0;  // memory of the roomiest free slot, when memory decides
  for (const auto& [negative_free, id] : free_index_[device]) {
    WorkerState& worker = workers_.find(id)->second;
    Pick pick{&worker, {}};
    for (int64_t slot = 0; slot < worker.status.slots() && fitting < ranks; ++slot) {
      if (worker.busy.count(slot)) continue;
      const std::optional<uint64_t> memory = FreeMemory(worker, slot, pick.slots.size(), need);
      if (memory) largest_free = std::max(largest_free, *memory);
      if (!memory || *memory >= need) {
        pick.slots.push_back(slot);
        ++fitting;
      }
    }
    if (!pick.slots.empty()) picks.push_back(std::move(pick));
    if (fitting == ranks) break;
  }
  if (fitting < ranks) {
    return absl::StrFormat(
        "needs %s per rank on %d %s slots; %d of the %d free slots have that much (largest "
        "free %s)",
        FormatBytes(need), ranks, DeviceName(device), fitting, free, FormatBytes(largest_free));
  }
  v1::Attempt* attempt = job.status.add_attempts();
  attempt->set_generation(job.status.attempts_size());
  attempt->set_state(v1::ATTEMPT_STATE_STARTING);
  attempt->set_started_unix_ms(NowMs());
  *attempt->mutable_predicted_memory() = job.status.plan().predicted_memory();
  // Deliverable once the batch with this placement is durable: the next one staged.
  const uint64_t batch = commit_.NextSequence();
  const std::string& job_id = job.status.job_id();
  int64_t rank = 0;
  for (Pick& pick : picks) {
    const std::string& worker_id = pick.worker->status.worker_id();
    std::vector<v1::Assignment> assignments;
    for (int64_t slot : pick.slots) {
      v1::RankPlacement* p = attempt->add_placements();
      p->set_rank(rank);
      p->set_worker_id(worker_id);
      p->set_slot(slot);
      MarkBusy(*pick.worker, slot, {job_id, attempt->generation(), rank, need});
      v1::Assignment& a = assignments.emplace_back();
      a.set_job_id(job_id);
      a.set_generation(attempt->generation());
      a.set_rank(rank);
      a.set_world_size(ranks);
      a.set_slot(slot);
      *a.mutable_spec() = job.status.spec();
      *a.mutable_plan() = job.status.plan();
      for (const std::string& root : options_.allowed_roots) a.add_allowed_roots(root);
      ++rank;
    }
    registry_.Post(worker_id, batch, std::move(assignments));
  }
  ++counters_.attempts_started;
  counters_.queue_seconds.Observe(clock_->Now() - job.queued_since);
  job.succeeded_ranks.clear();
  job.status.clear_restart_after_unix_ms();
  job.status.set_reason("");
  SetJobState(job, v1::JOB_STATE_RUNNING);
  spdlog::info("job={} attempt={} placed: {} ranks", job_id, attempt->generation(), ranks);
  Touch(job);
  return std::nullopt;
}

// --- jobs -----------------------------------------------------------------------------

absl::StatusOr<v1::JobStatus> Scheduler::AddJob(v1::JobStatus job, absl::string_view request_id,
                                                bool* existing, const Requester& requester) {
  *existing = false;
  // Each client's request ids are its own: another's retry neither finds nor blocks its job.
  const std::string request = request_id.empty() || requester.name.empty()
                                  ? std::string(request_id)
                                  : absl::StrCat(requester.name, "/", request_id);
  // A retry gets the job it created; another spec under the same id is a mistake.
  auto same = [&](const v1::JobStatus& earlier) -> absl::StatusOr<v1::JobStatus> {
    if (!google::protobuf::util::MessageDifferencer::Equals(earlier.spec(), job.spec())) {
      return absl::AlreadyExistsError(absl::StrCat("request_id ", request, " already created job ",
                                                   earlier.job_id(),
                                                   " with another spec; use a new request id"));
    }
    *existing = true;
    return earlier;
  };
  if (!request.empty()) {
    {
      absl::MutexLock lock(&mu_);
      if (auto it = request_ids_.find(request); it != request_ids_.end()) {
        return same(View(jobs_.at(it->second)));
      }
    }
    // Created before the coordinator restarted (an indexed read, outside the lock).
    LATHE_ASSIGN_OR_RETURN(std::optional<v1::JobStatus> stored,
                           store_->FindJobByRequestId(request));
    if (stored) {
      absl::MutexLock lock(&mu_);
      request_ids_[request] = stored->job_id();
      auto it = jobs_.find(stored->job_id());
      return same(it != jobs_.end() ? View(it->second) : *stored);
    }
  }
  // An output directory belongs to one job at a time: two would write one adapter and mix
  // their checkpoints. Reserved (with the request id) while the job is written.
  const std::string output = NormalPath(job.spec().output());
  {
    absl::MutexLock lock(&mu_);
    if (!request.empty()) {
      if (auto it = request_ids_.find(request); it != request_ids_.end()) {
        return same(View(jobs_.at(it->second)));
      }
      if (pending_requests_.count(request)) {
        return absl::UnavailableError(
            absl::StrCat("request_id ", request, ": the same submission is being stored; retry"));
      }
    }
    if (!output.empty()) {
      if (auto owner = OverlappingOutput(output); owner != active_outputs_.end()) {
        auto other = jobs_.find(owner->second);
        const bool queued =
            other == jobs_.end() || other->second.status.state() == v1::JOB_STATE_QUEUED;
        const bool seen = other != jobs_.end() && requester.Sees(other->second.status);
        const std::string holder =
            seen ? absl::StrCat("job ", owner->second) : "another client's job";
        const std::string where =
            owner->first == output ? absl::StrCat("belongs to ", holder)
            : owner->first.size() < output.size()
                ? absl::StrCat("lies inside ", owner->first, ", the output of ", holder)
                : absl::StrCat("holds ", owner->first, ", the output of ", holder);
        return absl::FailedPreconditionError(absl::StrCat(
            "spec: output: ", job.spec().output(), " ", where, " (", queued ? "queued" : "running",
            "); wait for it to end or choose another directory"));
      }
      active_outputs_[output] = job.job_id();
    }
    if (!request.empty()) pending_requests_.insert(request);
  }
  job.set_state(v1::JOB_STATE_QUEUED);
  job.set_reason("waiting to be scheduled");
  job.set_submitted_unix_ms(NowMs());
  job.set_updated_unix_ms(job.submitted_unix_ms());
  job.set_owner(requester.name);
  v1::StateChange* submitted = job.add_history();
  submitted->set_state(v1::JOB_STATE_QUEUED);
  submitted->set_unix_ms(job.submitted_unix_ms());
  submitted->set_by(requester.by.empty() ? "the coordinator" : requester.by);
  submitted->set_reason("submitted");
  // Durable before it is acknowledged; outside the lock, so that passes and registrations
  // do not wait for the fsync.
  const absl::Status created = store_->CreateJob(job, request);
  absl::MutexLock lock(&mu_);
  pending_requests_.erase(request);
  if (!created.ok()) {
    if (!output.empty()) active_outputs_.erase(output);
    return created;
  }
  const std::string id = job.job_id();
  JobState& state = jobs_[id];
  state.status = std::move(job);
  state.sequence = next_sequence_++;
  state.class_key = {DeviceOf(state.status), RanksOf(state.status),
                     PlannedPeak(state.status.plan())};
  state.last_persisted = clock_->Now();
  state.queued_since = state.last_persisted;
  ++counters_.jobs_submitted;
  by_sequence_[state.sequence] = &state;
  by_state_[v1::JOB_STATE_QUEUED].insert(state.sequence);
  by_name_[state.status.spec().name()].insert(state.sequence);
  if (!request.empty()) request_ids_[request] = id;
  Reindex(state);  // requests a pass
  spdlog::info("job={} submitted", id);
  return View(state);
}

const Scheduler::JobState* Scheduler::Find(absl::string_view job_id,
                                           const Requester& requester) const {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || !requester.Sees(it->second.status)) return nullptr;
  return &it->second;
}

namespace {

absl::Status JobNotFound(absl::string_view job_id) {
  return absl::NotFoundError(absl::StrCat("job ", job_id, " not found"));
}

// Who a call's changes are made by, for as long as it holds the scheduler's lock.
class ActingAs {
 public:
  ActingAs(std::string* acting, std::string who) : acting_(acting) { *acting_ = std::move(who); }
  ~ActingAs() { acting_->clear(); }

 private:
  std::string* const acting_;
};

}  // namespace

absl::StatusOr<v1::JobStatus> Scheduler::GetJob(absl::string_view job_id,
                                                const Requester& requester) const {
  absl::MutexLock lock(&mu_);
  const JobState* job = Find(job_id, requester);
  if (job == nullptr) return JobNotFound(job_id);
  return View(*job);
}

bool Scheduler::HasJob(absl::string_view job_id) const {
  absl::MutexLock lock(&mu_);
  return jobs_.count(job_id) > 0;
}

JobPage Scheduler::ListJobs(const JobQuery& query) const {
  absl::MutexLock lock(&mu_);
  // The candidates' sequence sets (by name, else by the wanted states), merged newest first.
  std::vector<const std::set<int64_t>*> sources;
  if (!query.name.empty()) {
    if (auto it = by_name_.find(query.name); it != by_name_.end()) sources.push_back(&it->second);
  } else {
    for (const auto& [state, sequences] : by_state_) {
      if (query.states.empty() || query.states.count(state)) sources.push_back(&sequences);
    }
  }
  // Per source, the next candidate: the largest sequence below the cursor.
  std::vector<std::set<int64_t>::const_reverse_iterator> next;
  for (const std::set<int64_t>* source : sources) {
    next.emplace_back(source->lower_bound(query.before_sequence));
  }
  JobPage page;
  size_t bytes = 0;
  int64_t last = -1;
  while (true) {
    int best = -1;
    for (size_t i = 0; i < sources.size(); ++i) {
      if (next[i] == sources[i]->rend()) continue;
      if (best < 0 || *next[i] > *next[best]) best = static_cast<int>(i);
    }
    if (best < 0) break;  // no more jobs
    const int64_t sequence = *next[best]++;
    const JobState& job = *by_sequence_.at(sequence);
    if (query.since_unix_ms > 0 && job.status.submitted_unix_ms() < query.since_unix_ms) break;
    if (!query.requester.Sees(job.status)) continue;
    if (!query.name.empty() && !query.states.empty() && !query.states.count(job.status.state())) {
      continue;
    }
    v1::JobStatus view = View(job);
    bytes += view.ByteSizeLong();
    if (page.jobs.size() == query.limit ||
        (!page.jobs.empty() && query.max_bytes > 0 && bytes > query.max_bytes)) {
      page.next_before = last;  // more follow
      break;
    }
    page.jobs.push_back(std::move(view));
    last = sequence;
  }
  return page;
}

absl::StatusOr<v1::JobStatus> Scheduler::CancelJob(absl::string_view job_id,
                                                   absl::string_view reason,
                                                   const Requester& requester) {
  uint64_t sequence = 0;
  v1::JobStatus result;
  {
    absl::MutexLock lock(&mu_);
    if (Find(job_id, requester) == nullptr) return JobNotFound(job_id);
    JobState& job = jobs_.find(job_id)->second;
    const std::string who = requester.by.empty() ? "the user" : requester.by;
    ActingAs acting(&acting_, who);
    if (!IsFinalState(job.status.state())) {
      const std::string why = reason.empty() ? absl::StrCat("cancelled by ", who)
                                             : absl::StrCat("cancelled by ", who, ": ", reason);
      if (job.status.state() == v1::JOB_STATE_QUEUED) {
        job.status.set_reason(why);
        SetJobState(job, v1::JOB_STATE_CANCELLED);
      } else {
        EndAttempt(job, v1::ATTEMPT_STATE_CANCELLED, v1::JOB_STATE_CANCELLED, why);
      }
      Touch(job);
      spdlog::info("job={} {}", job.status.job_id(), why);
    }
    result = View(job);
    sequence = Stage();
  }
  LATHE_RETURN_IF_ERROR(commit_.WaitDurable(sequence));
  return result;
}

absl::StatusOr<uint64_t> Scheduler::Watch(absl::string_view job_id, JobWatcher on_change,
                                          const Requester& requester) {
  absl::MutexLock lock(&mu_);
  const JobState* job = Find(job_id, requester);
  if (job == nullptr) return JobNotFound(job_id);
  const uint64_t id = ++next_watch_;
  on_change(std::make_shared<const v1::JobStatus>(View(*job)));
  watches_.emplace(id, std::make_pair(std::string(job_id), std::move(on_change)));
  watches_by_job_.emplace(std::string(job_id), id);
  return id;
}

void Scheduler::Unwatch(uint64_t watch_id) {
  absl::MutexLock lock(&mu_);
  auto it = watches_.find(watch_id);
  if (it == watches_.end()) return;
  auto [begin, end] = watches_by_job_.equal_range(it->second.first);
  for (auto w = begin; w != end; ++w) {
    if (w->second == watch_id) {
      watches_by_job_.erase(w);
      break;
    }
  }
  watches_.erase(it);
}

void Scheduler::EndAttempt(JobState& job, v1::AttemptState state, v1::JobState job_state,
                           const std::string& reason) {
  v1::Attempt* attempt = job.status.mutable_attempts(job.status.attempts_size() - 1);
  attempt->set_state(state);
  attempt->set_ended_unix_ms(NowMs());
  ++counters_.attempts_ended[{state, attempt->failure()}];
  if (state == v1::ATTEMPT_STATE_FAILED) attempt->set_error(reason);
  Learn(job.status.plan(), *attempt, calibration_);
  const std::string& job_id = job.status.job_id();
  for (const v1::RankPlacement& p : attempt->placements()) {
    auto worker = workers_.find(p.worker_id());
    if (worker == workers_.end()) continue;
    auto busy = worker->second.busy.find(p.slot());
    if (busy == worker->second.busy.end() || busy->second.job_id != job_id ||
        busy->second.generation != attempt->generation()) {
      continue;  // that rank already ended
    }
    if (worker->second.status.state() == v1::WORKER_STATE_LOST) {
      FreeSlot(p.worker_id(), p.slot());
      continue;
    }
    // Drop the assignment if it was never delivered; otherwise stop the trainer. The slot
    // stays busy until the worker says the rank is gone.
    if (registry_.WithdrawOrCancel(p.worker_id(), job_id, attempt->generation(), p.rank(),
                                   reason)) {
      FreeSlot(p.worker_id(), p.slot());
    }
  }
  // A capture the trainers have not answered never will: it fails with the attempt.
  for (v1::ProfileCapture& capture : *attempt->mutable_profiles()) {
    if (capture.state() != v1::PROFILE_STATE_PENDING) continue;
    capture.set_state(v1::PROFILE_STATE_FAILED);
    capture.set_ended_unix_ms(NowMs());
    capture.set_error(absl::StrCat("attempt ", attempt->generation(), " ended (",
                                   absl::AsciiStrToLower(v1::AttemptState_Name(state).substr(14)),
                                   ") before every rank answered", reason.empty() ? "" : ": ",
                                   reason.substr(0, 512)));
  }
  job.status.set_reason(reason);
  SetJobState(job, job_state);
}

void Scheduler::FailAttempt(JobState& job, const std::string& reason, v1::FailureKind kind,
                            bool charged) {
  v1::Attempt* attempt = job.status.mutable_attempts(job.status.attempts_size() - 1);
  attempt->set_failure(kind);
  if (!charged) {  // moved by an operator: at once, and not one of the job's restarts
    EndAttempt(job, v1::ATTEMPT_STATE_FAILED, v1::JOB_STATE_QUEUED, reason);
    job.status.set_reason(
        absl::StrCat("moving after attempt ", attempt->generation(), " was stopped: ", reason));
    Touch(job);
    return;
  }
  const int64_t max_restarts = job.status.spec().max_restarts();
  if (kind != v1::FAILURE_KIND_INFRASTRUCTURE || job.status.restarts() >= max_restarts) {
    EndAttempt(job, v1::ATTEMPT_STATE_FAILED, v1::JOB_STATE_FAILED, reason);
    if (kind == v1::FAILURE_KIND_INFRASTRUCTURE && max_restarts > 0) {
      job.status.set_reason(
          absl::StrCat(reason, " (no restarts left: max_restarts ", max_restarts, ")"));
    }
    Touch(job);
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
  job.status.set_restarts(restart);
  ++counters_.restarts;
  job.status.set_restart_after_unix_ms(absl::ToUnixMillis(clock_->Now() + backoff));
  EndAttempt(job, v1::ATTEMPT_STATE_FAILED, v1::JOB_STATE_QUEUED, reason);
  job.status.set_reason(
      absl::StrCat("restart ", restart, " of ", max_restarts, stalled == 0 ? " at once" : " in ",
                   stalled == 0 ? "" : absl::FormatDuration(backoff), " after attempt ",
                   attempt->generation(), " failed: ", reason));
  spdlog::warn("job={} {}", job.status.job_id(), job.status.reason());
  Touch(job);
}

// --- workers --------------------------------------------------------------------------

absl::StatusOr<v1::RegisterWorkerResponse> Scheduler::RegisterWorker(
    const v1::RegisterWorkerRequest& request) {
  LATHE_RETURN_IF_ERROR(WorkerRegistry::CheckRegistration(request));
  absl::MutexLock lock(&mu_);
  // ALREADY_EXISTS while another live agent holds the id (issue #27).
  LATHE_ASSIGN_OR_RETURN(std::string session, registry_.Open(request.worker_id()));
  WorkerState& worker = workers_[request.worker_id()];
  worker.session_id = std::move(session);
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
  IndexWorker(worker);
  // Not acknowledged durably: a registration lost in a crash is simply made again, and the
  // record is written with the first placement on the worker at the latest.
  MarkWorkerDirty(worker);
  RequestPass();
  spdlog::info("worker={} registered: {} {} slots", request.worker_id(), DeviceName(s.device()),
               request.slots());
  v1::RegisterWorkerResponse response;
  response.set_worker_id(request.worker_id());
  response.set_session_id(worker.session_id);
  response.set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
  response.set_heartbeat_timeout_ms(absl::ToInt64Milliseconds(options_.heartbeat_timeout));
  return response;
}

absl::StatusOr<v1::HeartbeatResponse> Scheduler::Heartbeat(const v1::HeartbeatRequest& request,
                                                           std::shared_ptr<MailListener> listener) {
  bool reported = false;
  absl::StatusOr<v1::HeartbeatResponse> response =
      registry_.Heartbeat(request, std::move(listener), commit_.Durable(), &reported);
  if (reported) {
    absl::MutexLock lock(&work_mu_);
    reports_waiting_ = true;
  }
  return response;
}

v1::HeartbeatResponse Scheduler::TakeMail(absl::string_view worker_id,
                                          absl::string_view session_id) {
  return registry_.TakeMail(worker_id, session_id, commit_.Durable());
}

void Scheduler::ProcessReport(const WorkerRegistry::Report& report) {
  auto it = workers_.find(report.worker_id);
  if (it == workers_.end() || it->second.session_id != report.session_id) return;
  WorkerState& worker = it->second;
  // Ranks of attempts that are no longer current are told to stop.
  std::set<int64_t> reported;
  std::vector<WorkerRegistry::AttemptRef> stale;
  for (const v1::SlotStatus& slot : report.running) {
    if (slot.job_id().empty()) continue;
    reported.insert(slot.slot());
    if (!IsActiveAttemptLocked(slot.job_id(), slot.generation())) {
      stale.emplace_back(slot.job_id(), slot.generation());
    }
  }
  registry_.CancelUnlessPending(report.worker_id, stale, "the attempt is no longer current");
  // After a registration: ranks placed here that the worker does not run, was not sent
  // since (in an answer or pushed) and will not receive are lost.
  std::set<std::string> lost_jobs;
  if (report.reconcile) {
    std::vector<WorkerRegistry::AttemptRef> placed;
    for (const auto& [slot, ref] : worker.busy) {
      if (reported.count(slot) || !IsActiveAttemptLocked(ref.job_id, ref.generation)) continue;
      placed.emplace_back(ref.job_id, ref.generation);
    }
    for (const auto& [job_id, generation] : registry_.Reconcile(report.worker_id, placed)) {
      lost_jobs.insert(job_id);
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
  std::vector<int64_t> ended;
  for (const auto& [slot, ref] : worker.busy) {
    if (!IsActiveAttemptLocked(ref.job_id, ref.generation) && !reported.count(slot)) {
      ended.push_back(slot);
    }
  }
  for (int64_t slot : ended) FreeSlot(report.worker_id, slot);
}

absl::Status Scheduler::ReportProgress(const v1::ReportProgressRequest& request) {
  bool acknowledge = false;
  uint64_t sequence = 0;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    status = ApplyReport(request, &acknowledge);
    sequence = Stage();
  }
  // A rank's start and end are durable before the agent hears they were received.
  if (acknowledge) LATHE_RETURN_IF_ERROR(commit_.WaitDurable(sequence));
  return status;
}

absl::Status Scheduler::ApplyReport(const v1::ReportProgressRequest& request, bool* acknowledge) {
  ActingAs acting(&acting_, absl::StrCat("worker ", request.worker_id()));
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
      Touch(job);
      *acknowledge = true;
      return absl::OkStatus();
    case v1::RANK_EVENT_PROGRESS:
      attempt->set_state(v1::ATTEMPT_STATE_RUNNING);
      if (request.rank() == 0) {
        *attempt->mutable_progress() = request.progress();
        attempt->mutable_progress()->set_updated_unix_ms(NowMs());
        if (request.resumed_from_step() > 0) {
          attempt->set_resumed_from_step(request.resumed_from_step());
        }
      }
      Touch(job, /*persist=*/request.resumed_from_step() > 0);
      return absl::OkStatus();
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
        ++counters_.attempts_ended[{v1::ATTEMPT_STATE_SUCCEEDED, v1::FAILURE_KIND_UNSPECIFIED}];
        Learn(job.status.plan(), *attempt, calibration_);
        job.status.set_reason("");
        SetJobState(job, v1::JOB_STATE_SUCCEEDED);
        spdlog::info("job={} succeeded", job.status.job_id());
      }
      Touch(job);
      *acknowledge = true;
      return absl::OkStatus();
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
      *acknowledge = true;
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError("event: must be set");
  }
}

void Scheduler::MarkLost(WorkerState& worker, const std::string& reason) {
  const std::string& id = worker.status.worker_id();
  spdlog::warn("{}", reason);
  ++counters_.workers_lost;
  worker.status.set_state(v1::WORKER_STATE_LOST);
  worker.session_id.clear();
  registry_.Lose(id);
  IndexWorker(worker);
  MarkWorkerDirty(worker);
  std::set<std::string> failed;
  for (const auto& [slot, ref] : worker.busy) {
    if (IsActiveAttemptLocked(ref.job_id, ref.generation)) failed.insert(ref.job_id);
  }
  for (const std::string& job_id : failed) {
    FailAttempt(jobs_.find(job_id)->second, reason, v1::FAILURE_KIND_INFRASTRUCTURE);
  }
  std::vector<int64_t> slots;
  for (const auto& [slot, ref] : worker.busy) slots.push_back(slot);
  for (int64_t slot : slots) FreeSlot(id, slot);
}

void Scheduler::RenewHeartbeatWindows(absl::Duration stall) {
  const int64_t renewed = registry_.RenewWindows();
  spdlog::warn(
      "the coordinator stood still for {}: {} workers get a fresh heartbeat window of {} "
      "before any is declared lost",
      absl::FormatDuration(absl::Trunc(stall, absl::Milliseconds(100))), renewed,
      absl::FormatDuration(options_.heartbeat_timeout));
}

void Scheduler::CheckHeartbeats() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  // Liveness from the heartbeats' arrival times alone.
  for (const auto& [id, silence] : registry_.Silent()) {
    auto worker = workers_.find(id);
    if (worker == workers_.end() || worker->second.status.state() == v1::WORKER_STATE_LOST) {
      continue;
    }
    MarkLost(worker->second,
             absl::StrCat("worker ", id, " lost: no heartbeat for ",
                          absl::FormatDuration(absl::Trunc(silence, absl::Seconds(1)))));
  }
  // Restarts whose backoff has passed join the queue.
  const int64_t now_ms = absl::ToUnixMillis(now);
  while (!backoff_.empty() && backoff_.begin()->first <= now_ms) {
    JobState& job = *by_sequence_.at(backoff_.begin()->second);
    Reindex(job);  // leaves backoff_
    NotifyWatchers(job);
  }
}

std::vector<v1::WorkerStatus> Scheduler::ListWorkers() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::WorkerStatus> result;
  for (const auto& [id, worker] : workers_) result.push_back(worker.status);
  registry_.Describe(result);  // what each one with a session runs, and when it was heard
  return result;
}

MemoryCalibration Scheduler::Calibration() const {
  absl::MutexLock lock(&mu_);
  return calibration_;
}

v1::GetPlanHistoryResponse Scheduler::PlanHistory(size_t limit, const Requester& requester) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<const v1::JobStatus*, const v1::Attempt*>> measured;
  for (const auto& [id, job] : jobs_) {
    if (!requester.Sees(job.status)) continue;
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

absl::StatusOr<v1::WorkerStatus> Scheduler::DrainWorker(absl::string_view worker_id,
                                                        const Requester& requester) {
  uint64_t sequence = 0;
  v1::WorkerStatus result;
  {
    absl::MutexLock lock(&mu_);
    ActingAs acting(&acting_, requester.by);
    auto it = workers_.find(worker_id);
    if (it == workers_.end()) {
      return absl::NotFoundError(absl::StrCat("worker ", worker_id, " not found"));
    }
    WorkerState& worker = it->second;
    if (worker.status.state() == v1::WORKER_STATE_READY) {
      worker.status.set_state(v1::WORKER_STATE_DRAINING);
      IndexWorker(worker);
      MarkWorkerDirty(worker);
      spdlog::info("worker={} draining", std::string(worker_id));
    }
    // Its ranks' attempts end (the trainers checkpoint on SIGTERM) and their jobs queue again.
    std::set<std::string> moving;
    for (const auto& [slot, ref] : worker.busy) {
      if (IsActiveAttemptLocked(ref.job_id, ref.generation)) moving.insert(ref.job_id);
    }
    for (const std::string& job_id : moving) {
      FailAttempt(jobs_.find(job_id)->second,
                  absl::StrCat("worker ", worker_id, " is being drained"),
                  v1::FAILURE_KIND_INFRASTRUCTURE, /*charged=*/false);
    }
    result = worker.status;
    sequence = Stage();
  }
  LATHE_RETURN_IF_ERROR(commit_.WaitDurable(sequence));
  return result;
}

absl::Status Scheduler::RemoveWorker(absl::string_view worker_id) {
  uint64_t sequence = 0;
  {
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
    dirty_workers_.erase(it->second.status.worker_id());
    deleted_workers_.insert(it->second.status.worker_id());
    workers_.erase(it);
    registry_.Remove(std::string(worker_id));
    sequence = Stage();
  }
  LATHE_RETURN_IF_ERROR(commit_.WaitDurable(sequence));
  spdlog::info("worker={} removed", std::string(worker_id));
  return absl::OkStatus();
}

absl::Status Scheduler::CheckLogWriter(absl::string_view job_id, int64_t generation, int64_t rank,
                                       absl::string_view worker_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job ", job_id, " not found"));
  const auto& attempts = it->second.status.attempts();
  if (generation < 1 || generation > attempts.size()) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " has no attempt ", generation));
  }
  const v1::Attempt& attempt = attempts[static_cast<int>(generation - 1)];
  bool placed = false;
  for (const v1::RankPlacement& p : attempt.placements()) {
    placed = placed || (p.rank() == rank && p.worker_id() == worker_id);
  }
  if (!placed) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, ": rank ", rank,
                                                      " of attempt ", generation,
                                                      " was not placed on worker ", worker_id));
  }
  if (!IsActive(attempt) &&
      NowMs() - attempt.ended_unix_ms() > absl::ToInt64Milliseconds(kLogGrace)) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, ": attempt ", generation, " ended ",
                     (NowMs() - attempt.ended_unix_ms()) / 1000, "s ago; its logs are closed"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> Scheduler::AttemptWorkers(absl::string_view job_id,
                                                                   int64_t generation) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return JobNotFound(job_id);
  const auto& attempts = it->second.status.attempts();
  if (generation < 1 || generation > attempts.size()) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " has no attempt ", generation));
  }
  std::vector<std::string> workers;
  for (const v1::RankPlacement& p : attempts[static_cast<int>(generation - 1)].placements()) {
    workers.push_back(p.worker_id());
  }
  return workers;
}

absl::StatusOr<std::pair<int64_t, bool>> Scheduler::LogAttempt(absl::string_view job_id,
                                                               int64_t attempt, int64_t rank,
                                                               const Requester& requester) const {
  absl::MutexLock lock(&mu_);
  const JobState* job = Find(job_id, requester);
  if (job == nullptr) return JobNotFound(job_id);
  const auto& attempts = job->status.attempts();
  if (attempts.empty()) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " has not started: no logs yet"));
  }
  const int64_t generation = attempt == 0 ? attempts.size() : attempt;
  if (generation < 1 || generation > attempts.size()) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " has no attempt ", attempt,
                                            " (it has ", attempts.size(), ")"));
  }
  const v1::Attempt& a = attempts[static_cast<int>(generation - 1)];
  if (rank < 0 || rank >= a.placements_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: attempt ", generation, " of job ", job_id,
                                                   " has ranks 0 to ", a.placements_size() - 1,
                                                   ", not ", rank));
  }
  return std::make_pair(generation, IsActive(a));
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

// --- profiling ------------------------------------------------------------------------

namespace {

v1::ProfileCapture* FindCapture(v1::Attempt& attempt, absl::string_view capture_id) {
  for (v1::ProfileCapture& capture : *attempt.mutable_profiles()) {
    if (capture.capture_id() == capture_id) return &capture;
  }
  return nullptr;
}

}  // namespace

absl::StatusOr<v1::ProfileJobResponse> Scheduler::ProfileJob(const v1::ProfileJobRequest& request,
                                                             const Requester& requester) {
  const int64_t steps = request.steps() == 0 ? kDefaultProfileSteps : request.steps();
  if (steps < 1 || steps > kMaxProfileSteps) {
    return absl::InvalidArgumentError(
        absl::StrCat("steps: must be in 1..", kMaxProfileSteps, ", got ", request.steps()));
  }
  uint64_t sequence = 0;
  v1::ProfileJobResponse response;
  {
    absl::MutexLock lock(&mu_);
    if (Find(request.job_id(), requester) == nullptr) return JobNotFound(request.job_id());
    JobState& job = jobs_.find(request.job_id())->second;
    const std::string& job_id = job.status.job_id();
    if (job.status.state() != v1::JOB_STATE_RUNNING || job.status.attempts().empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", job_id, " is ",
                       absl::AsciiStrToLower(v1::JobState_Name(job.status.state()).substr(10)),
                       ", not running: only a running job can be profiled"));
    }
    v1::Attempt* attempt = job.status.mutable_attempts(job.status.attempts_size() - 1);
    const int64_t ranks = attempt->placements_size();
    if (!request.all_ranks() && (request.rank() < 0 || request.rank() >= ranks)) {
      return absl::InvalidArgumentError(absl::StrCat("rank: attempt ", attempt->generation(),
                                                     " of job ", job_id, " has ranks 0 to ",
                                                     ranks - 1, ", not ", request.rank()));
    }
    for (const v1::ProfileCapture& capture : attempt->profiles()) {
      if (capture.state() == v1::PROFILE_STATE_PENDING) {
        // The trainer reads one request at a time: a second would replace the first.
        return absl::FailedPreconditionError(
            absl::StrCat("job ", job_id, ": capture ", capture.capture_id(),
                         " is still pending; wait for it to end (lathe status ", job_id, ")"));
      }
    }
    if (attempt->profiles_size() >= kMaxProfilesPerAttempt) {
      return absl::ResourceExhaustedError(
          absl::StrCat("job ", job_id, ": attempt ", attempt->generation(), " already has ",
                       kMaxProfilesPerAttempt, " captures, the most one attempt keeps"));
    }
    int64_t captures = 0;
    for (const v1::Attempt& a : job.status.attempts()) captures += a.profiles_size();
    v1::ProfileCapture* capture = attempt->add_profiles();
    capture->set_capture_id(absl::StrCat("prof-", captures + 1));
    capture->set_steps(steps);
    capture->set_memory(request.memory());
    capture->set_state(v1::PROFILE_STATE_PENDING);
    capture->set_requested_unix_ms(NowMs());
    capture->set_requested_by(requester.by.empty() ? "the user" : requester.by);
    for (const v1::RankPlacement& p : attempt->placements()) {
      if (!request.all_ranks() && p.rank() != request.rank()) continue;
      capture->add_ranks(p.rank());
      v1::ProfileOrder order;
      order.set_job_id(job_id);
      order.set_generation(attempt->generation());
      order.set_rank(p.rank());
      order.set_capture_id(capture->capture_id());
      order.set_steps(steps);
      order.set_memory(request.memory());
      registry_.PostProfile(p.worker_id(), std::move(order));
    }
    std::sort(capture->mutable_ranks()->begin(), capture->mutable_ranks()->end());
    spdlog::info("job={} attempt={} capture {} of {} step(s) on rank(s) {} asked by {}", job_id,
                 attempt->generation(), capture->capture_id(), steps,
                 absl::StrJoin(capture->ranks(), ","), capture->requested_by());
    response.set_generation(attempt->generation());
    *response.mutable_capture() = *capture;
    Touch(job);
    sequence = Stage();
  }
  RequestPass();  // the scheduling loop pushes the orders (Settle)
  LATHE_RETURN_IF_ERROR(commit_.WaitDurable(sequence));
  return response;
}

absl::Status Scheduler::CheckProfileWriter(absl::string_view job_id, int64_t generation,
                                           int64_t rank, absl::string_view capture_id,
                                           absl::string_view worker_id) const {
  absl::MutexLock lock(&mu_);
  return CheckProfileWriterLocked(job_id, generation, rank, capture_id, worker_id);
}

absl::Status Scheduler::CheckProfileWriterLocked(absl::string_view job_id, int64_t generation,
                                                 int64_t rank, absl::string_view capture_id,
                                                 absl::string_view worker_id) const {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return JobNotFound(job_id);
  const auto& attempts = it->second.status.attempts();
  if (generation < 1 || generation > attempts.size()) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " has no attempt ", generation));
  }
  const v1::Attempt& attempt = attempts[static_cast<int>(generation - 1)];
  const v1::ProfileCapture* capture = nullptr;
  for (const v1::ProfileCapture& c : attempt.profiles()) {
    if (c.capture_id() == capture_id) capture = &c;
  }
  if (capture == nullptr) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, ": attempt ", generation,
                                            " has no capture \"", capture_id.substr(0, 64), "\""));
  }
  if (capture->state() != v1::PROFILE_STATE_PENDING) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, ": capture ", capture_id, " is no longer pending (",
                     v1::ProfileState_Name(capture->state()), ")"));
  }
  if (std::find(capture->ranks().begin(), capture->ranks().end(), rank) == capture->ranks().end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, ": capture ", capture_id, " did not ask rank ", rank));
  }
  for (const v1::RankPlacement& p : attempt.placements()) {
    if (p.rank() == rank && p.worker_id() == worker_id) return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat("job ", job_id, ": rank ", rank, " of attempt ",
                                                    generation, " was not placed on worker ",
                                                    worker_id));
}

absl::Status Scheduler::ReportProfile(const v1::ReportProfileRequest& request) {
  uint64_t sequence = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request.job_id());
    if (it == jobs_.end()) return JobNotFound(request.job_id());
    JobState& job = it->second;
    const int64_t generation = request.generation();
    if (generation < 1 || generation > job.status.attempts_size()) {
      return absl::NotFoundError(
          absl::StrCat("job ", request.job_id(), " has no attempt ", generation));
    }
    v1::Attempt& attempt = *job.status.mutable_attempts(static_cast<int>(generation - 1));
    v1::ProfileCapture* capture = FindCapture(attempt, request.capture_id());
    if (capture != nullptr) {
      for (const v1::ProfileRankResult& r : capture->results()) {
        if (r.rank() == request.rank()) return absl::OkStatus();  // a resend
      }
    }
    LATHE_RETURN_IF_ERROR(CheckProfileWriterLocked(request.job_id(), generation, request.rank(),
                                                   request.capture_id(), request.worker_id()));
    v1::ProfileRankResult* result = capture->add_results();
    result->set_rank(request.rank());
    result->set_first_step(request.first_step());
    result->set_last_step(request.last_step());
    result->set_error(request.error().substr(0, kMaxErrorBytes));
    for (const v1::ProfileFile& file : request.files()) {
      v1::ProfileFile* kept = capture->add_files();
      *kept = file;
      kept->set_rank(request.rank());
    }
    if (!request.error().empty()) {
      capture->set_state(v1::PROFILE_STATE_FAILED);
      capture->set_error(absl::StrCat("rank ", request.rank(), ": ", result->error()));
    } else if (capture->results_size() == capture->ranks_size()) {
      capture->set_state(v1::PROFILE_STATE_DONE);
    }
    if (capture->state() != v1::PROFILE_STATE_PENDING) capture->set_ended_unix_ms(NowMs());
    spdlog::info("job={} attempt={} rank={} capture {}: {} file(s){}{}", request.job_id(),
                 generation, request.rank(), capture->capture_id(), request.files_size(),
                 request.error().empty() ? "" : ", error: ", result->error());
    Touch(job);
    sequence = Stage();
  }
  return commit_.WaitDurable(sequence);
}

absl::StatusOr<std::pair<int64_t, v1::ProfileCapture>> Scheduler::FindProfile(
    absl::string_view job_id, absl::string_view capture_id, const Requester& requester) const {
  absl::MutexLock lock(&mu_);
  const JobState* job = Find(job_id, requester);
  if (job == nullptr) return JobNotFound(job_id);
  for (const v1::Attempt& attempt : job->status.attempts()) {
    for (const v1::ProfileCapture& capture : attempt.profiles()) {
      if (capture.capture_id() == capture_id) return std::make_pair(attempt.generation(), capture);
    }
  }
  return absl::NotFoundError(
      absl::StrCat("job ", job_id, " has no capture \"", capture_id.substr(0, 64), "\""));
}

}  // namespace lathe
