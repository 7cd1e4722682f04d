// The coordinator's state machine: the jobs, the workers, the queue and gang placement.
//
// Jobs wait in a queue ordered by priority (higher first), then submission order. A
// scheduling pass places every queued job whose ranks all fit at once on free slots of live
// workers of its device kind; a job that does not fit stays queued with the reason, and
// later jobs that do fit may go first (backfill). A job is never placed in part.
//
// A placement is an attempt with a generation (1, 2, ...). Workers learn of their ranks in
// the answer to a heartbeat (or pushed on their heartbeat stream), report progress and the
// end of each rank, and every report carries the generation: reports for an attempt that is
// no longer current are refused (fencing). A worker silent for longer than the heartbeat
// timeout is lost, and the attempts with a rank on it fail.
//
// When an attempt fails for the infrastructure (a lost worker, a rank killed by a signal or
// stopped by its worker, a collective timeout: the agent classifies its trainer's end) and
// the spec's max_restarts allows, the job is queued again (at once when the attempt trained,
// else after a backoff that doubles with each attempt in a row that did not), and its next
// attempt resumes from the newest checkpoint in its output directory. A user error (the
// spec, the data, a divergence) fails the job at once.
//
// Scale (issue #13; docs/services.md, "At scale"):
//   - Heartbeats take only the worker registry's lock (worker_registry.h), never the
//     scheduling lock or the store: a heartbeat records its arrival time (liveness is decided
//     from those alone), takes the worker's deliverable mail and leaves what the scheduler
//     must look at (a change in the ranks the worker runs). Settle() digests those reports.
//   - Passes are incremental and coalesced: a change (a job, a worker, a freed slot) only
//     requests a pass; Settle() runs one for everything requested since the last. Queued
//     jobs are indexed by class (device, ranks, memory per rank), each class ordered by
//     priority and submission, and free slots by device: a pass tries the head of each class
//     in global order and stops a class at its first job that does not fit (capacity only
//     shrinks during a pass), so it costs O((placed + classes) log), not O(queued).
//   - Why a queued job waits is derived state: kept per class, shown on read, never written.
//   - Durable writes are batched (group_commit.h): changes mark jobs and workers dirty, each
//     operation stages one batch, and whoever waits for durability writes every staged batch
//     in one transaction. Acknowledged changes (a job created, cancelled or ended, a worker
//     drained or removed) are durable before their call returns; a placement is durable
//     before its assignment can be delivered; progress is written behind, at most once a
//     second per job.
//
// Thread-safety: thread-safe. Four mutexes:
//   - mu_: the jobs, the worker records and slots, the indexes, the watches, the dirty sets
//     and the counters. Never held during a store write (the group commit's or CreateJob).
//   - the WorkerRegistry's (sessions, liveness, mailboxes, heartbeat reports): taken with mu_
//     held or alone (a heartbeat), never held while taking another lock.
//   - the GroupCommit's (staged batches): taken with mu_ held (Stage, so that batches are
//     staged in the order of the changes) or alone (WaitDurable, which runs without mu_),
//     never held while taking another lock.
//   - work_mu_ (the pass request, reports waiting): a leaf, taken with mu_ held or alone.
// So the order is mu_, then any one of the other three; those three are never held together.
#ifndef LATHE_COORDINATOR_SCHEDULER_SCHEDULER_H_
#define LATHE_COORDINATOR_SCHEDULER_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/scheduler/group_commit.h"
#include "coordinator/scheduler/worker_registry.h"
#include "coordinator/store/store.h"
#include "lathe/v1/coordinator.pb.h"
#include "lathe/v1/job.pb.h"
#include "planner/calibration.h"

namespace lathe {

struct SchedulerOptions {
  absl::Duration heartbeat_interval = absl::Seconds(2);
  absl::Duration heartbeat_timeout = absl::Seconds(15);
  // A restart after an attempt that trained at least one step is placed at once; after one
  // that did not, it waits restart_backoff, twice that when the attempt before did not train
  // either, ..., at most the maximum.
  absl::Duration restart_backoff = absl::Seconds(1);
  absl::Duration max_restart_backoff = absl::Seconds(60);
  std::vector<std::string> allowed_roots{};  // sent with every assignment
};

// Who asks (the services fill it in from the caller's token, common/rpc/auth.h): a client
// sees and changes only the jobs it submitted; an admin, or anyone when authentication is
// off, every job. A job another client owns is NOT_FOUND, as if it did not exist.
struct Requester {
  std::string name;       // the token's name: the owner of what it submits ("" without auth)
  bool every_job = true;  // sees every job, whoever owns it
  std::string by;         // who it is in a job's history; empty: "the coordinator"
  bool Sees(const v1::JobStatus& job) const { return every_job || job.owner() == name; }
};

// What ListJobs selects: newest first, below `before_sequence`, at most `limit` jobs.
struct JobQuery {
  std::set<v1::JobState> states;  // empty: every state
  std::string name;               // the spec's name exactly; empty: any
  int64_t since_unix_ms = 0;      // submitted at or after; 0: any time
  int64_t before_sequence = INT64_MAX;
  size_t limit = 100;
  // A page also ends before its jobs' encoded size passes this (0: no bound); it holds at
  // least one job.
  size_t max_bytes = 0;
  Requester requester;  // only the jobs it sees
};

struct JobPage {
  std::vector<v1::JobStatus> jobs;
  // The submission sequence of the last job when more may follow (the next query's
  // before_sequence); -1 on the last page.
  int64_t next_before = -1;
};

// Called with a job's status after each change, the one copy shared by every watcher of it.
using JobWatcher = std::function<void(std::shared_ptr<const v1::JobStatus>)>;

// Counts of observations at or below each bound (cumulative, Prometheus' histogram), in
// seconds; plain data, so that the scheduler needs no metrics library.
struct DurationHistogram {
  std::vector<double> bounds;
  std::vector<uint64_t> counts;  // per bound, cumulative
  uint64_t count = 0;
  double sum = 0;

  explicit DurationHistogram(std::vector<double> upper_bounds = {})
      : bounds(std::move(upper_bounds)), counts(bounds.size(), 0) {}
  void Observe(absl::Duration value);
};

// The scheduler's state and what it has counted since it started, for the metrics
// (docs/observability.md). Jobs: the running ones and those that ended within the grace
// period, so that a finished job's series go away and cardinality stays bounded.
struct SchedulerSnapshot {
  std::map<v1::JobState, int64_t> jobs;        // by state
  int64_t queued_eligible = 0;                 // queued, past any backoff, tried by passes
  std::map<v1::WorkerState, int64_t> workers;  // by state
  std::map<v1::Device, int64_t> slots;         // of ready workers
  std::map<v1::Device, int64_t> free_slots;
  int64_t jobs_submitted = 0;
  int64_t attempts_started = 0;
  std::map<std::pair<v1::AttemptState, v1::FailureKind>, int64_t> attempts_ended;
  int64_t restarts = 0;
  int64_t workers_lost = 0;
  int64_t heartbeats = 0;
  DurationHistogram pass_seconds;
  DurationHistogram queue_seconds;  // submission (or requeue) to placement
  struct Job {
    std::string job_id;
    std::string name;
    v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
    int64_t generation = 0;
    v1::Progress progress;            // rank 0's, of the latest attempt
    int64_t steps_before = 0;         // the highest step an earlier attempt reported
    v1::MemoryBreakdown peak_memory;  // measured, the largest of any rank
    v1::MemoryBreakdown predicted_memory;
    double memory_correction = 1;
  };
  std::vector<Job> jobs_shown;
};

// What the scheduling loop did since the last TakePassStats.
struct PassStats {
  int64_t passes = 0;
  absl::Duration longest;
  absl::Duration total;
  int64_t placed = 0;
  int64_t heartbeat_reports = 0;
};

class Scheduler {
 public:
  // Loads every job and worker from `store`. Workers known from before come back without a
  // session: they must register again within the heartbeat timeout or are marked lost.
  // REQUIRES: store and clock outlive the scheduler.
  static absl::StatusOr<std::unique_ptr<Scheduler>> Create(Store* store, const Clock* clock,
                                                           const SchedulerOptions& options);

  // --- the scheduling loop ------------------------------------------------------------

  // Digests the heartbeat reports, runs one pass when one was requested, writes what the
  // store lacks and pushes new mail to the workers' streams. The server's scheduling loop
  // calls it whenever WaitForWork returns; tests call it to settle the state.
  void Settle();
  // Returns when a pass was requested or a heartbeat report queued, or after `timeout`.
  void WaitForWork(absl::Duration timeout) const;
  PassStats TakePassStats();
  // For the metrics; `grace`: how long an ended job is still shown.
  SchedulerSnapshot Snapshot(absl::Duration grace) const;

  // --- jobs ---------------------------------------------------------------------------

  // Stores `job` (state QUEUED, with its id, spec and plan filled in; owned by the
  // requester), durably, and requests a pass. With a non-empty request_id the requester
  // already used, returns the job it created
  // instead (and `*existing` = true), or ALREADY_EXISTS naming that job when its spec
  // differs. Other errors are the store's.
  absl::StatusOr<v1::JobStatus> AddJob(v1::JobStatus job, absl::string_view request_id,
                                       bool* existing, const Requester& requester = {});
  // NOT_FOUND for an unknown id or a job the requester does not see.
  absl::StatusOr<v1::JobStatus> GetJob(absl::string_view job_id,
                                       const Requester& requester = {}) const;
  bool HasJob(absl::string_view job_id) const;
  // The jobs `query` selects, newest first, in O(page) for a query by state or name.
  JobPage ListJobs(const JobQuery& query) const;
  // Cancels a queued or running job (its running ranks get cancellations). A finished job
  // is returned unchanged. NOT_FOUND for an unknown id or a job the requester does not see.
  absl::StatusOr<v1::JobStatus> CancelJob(absl::string_view job_id, absl::string_view reason,
                                          const Requester& requester = {});
  // Calls `on_change` with the job's status now and after every change, until Unwatch;
  // returns the watch's id. `on_change` runs under the scheduler's lock: it must not block
  // or call the scheduler. NOT_FOUND for an unknown id or a job the requester does not see.
  absl::StatusOr<uint64_t> Watch(absl::string_view job_id, JobWatcher on_change,
                                 const Requester& requester = {});
  // After it returns, the watch's on_change is never called again.
  void Unwatch(uint64_t watch_id);

  // --- workers ------------------------------------------------------------------------

  // Registers (or re-registers) a worker; returns its new session. Its first heartbeat then
  // settles what it runs: a rank the scheduler placed there that the worker neither lists
  // nor has yet to receive is lost (the coordinator or the agent restarted in between), and
  // its attempt fails as an infrastructure failure; ranks it lists carry on.
  absl::StatusOr<v1::RegisterWorkerResponse> RegisterWorker(
      const v1::RegisterWorkerRequest& request);
  // Records a heartbeat and returns the worker's deliverable assignments and cancellations;
  // `listener` (may be null) is told when more arrive before the next heartbeat. Takes only
  // the worker registry's lock. FAILED_PRECONDITION when the worker or its session is unknown
  // (register again).
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request,
                                                  std::shared_ptr<MailListener> listener = nullptr);
  // The deliverable mail of the worker's session now (empty when none or another session).
  v1::HeartbeatResponse TakeMail(absl::string_view worker_id, absl::string_view session_id);
  // A rank's progress or end. FAILED_PRECONDITION for a stale generation or a rank that is
  // not placed on that worker; NOT_FOUND for an unknown job.
  absl::Status ReportProgress(const v1::ReportProgressRequest& request);
  // Marks workers whose last heartbeat is older than the timeout as lost and fails their
  // attempts; queues restarts whose backoff has passed. Call periodically (the server does,
  // every timeout / 4).
  void CheckHeartbeats();
  // After the coordinator itself stood still for `stall` (stopped, a frozen VM): every live
  // worker's heartbeat window starts again now, since their heartbeats could not be received
  // meanwhile; a worker that is really gone is declared lost one timeout later. Logged.
  void RenewHeartbeatWindows(absl::Duration stall);
  std::vector<v1::WorkerStatus> ListWorkers() const;
  // Marks the worker DRAINING (no new placements, kept across its re-registrations) and
  // ends the attempts with a rank on it; their jobs queue again at once, not charged to
  // their max_restarts. NOT_FOUND for an unknown worker.
  absl::StatusOr<v1::WorkerStatus> DrainWorker(absl::string_view worker_id,
                                               const Requester& requester = {});
  // Forgets a LOST worker (in the store too). FAILED_PRECONDITION for a live one (it would
  // only register again); NOT_FOUND for an unknown worker.
  absl::Status RemoveWorker(absl::string_view worker_id);

  // --- the planner's feedback ---------------------------------------------------------

  // The memory corrections learned from every ended attempt that ran at least one step: its
  // rank's largest measured peak against the plan's prediction, under the plan's
  // calibration key (planner/calibration.h). Rebuilt from the store on start.
  MemoryCalibration Calibration() const;
  // Those attempts of the jobs the requester sees, newest `limit` first (by end time), and
  // the corrections (of every job: they are the cluster's).
  v1::GetPlanHistoryResponse PlanHistory(size_t limit, const Requester& requester = {}) const;

  // Whether `worker_id` may send the log of `rank` in attempt `generation`: it was placed
  // there, and the attempt is active or ended at most kLogGrace ago (the last lines of a
  // rank arrive after its end). NOT_FOUND for an unknown job or attempt;
  // FAILED_PRECONDITION otherwise.
  static constexpr absl::Duration kLogGrace = absl::Seconds(60);
  absl::Status CheckLogWriter(absl::string_view job_id, int64_t generation, int64_t rank,
                              absl::string_view worker_id) const;
  // The attempt `lathe logs` reads (`attempt` 0: the latest) and whether it is active.
  // NOT_FOUND for an unknown job, a job not placed yet or an attempt it never had;
  // INVALID_ARGUMENT for a rank the attempt does not have.
  absl::StatusOr<std::pair<int64_t, bool>> LogAttempt(absl::string_view job_id, int64_t attempt,
                                                      int64_t rank,
                                                      const Requester& requester = {}) const;
  // The workers attempt `generation` of the job was placed on: who may use its rendezvous
  // scope. NOT_FOUND for an unknown job or attempt.
  absl::StatusOr<std::vector<std::string>> AttemptWorkers(absl::string_view job_id,
                                                          int64_t generation) const;

  // True when `generation` is the current attempt of the job and that attempt is active:
  // the rendezvous store's fencing check.
  bool IsActiveAttempt(absl::string_view job_id, int64_t generation) const;

  // --- profiling (`lathe profile`, docs/observability.md "Profiling") -----------------

  static constexpr int64_t kDefaultProfileSteps = 3;
  // Captures one attempt may have: with the bounds on a capture's files (services.h), what
  // the coordinator keeps of an attempt's profiles stays bounded.
  static constexpr int kMaxProfilesPerAttempt = 16;
  // Records a capture (PENDING, "prof-<n>") in the job's current attempt, durably, and
  // orders the workers of the chosen ranks to profile their next steps (delivered like a
  // cancellation). NOT_FOUND for an unknown job or one the requester does not see;
  // FAILED_PRECONDITION when the job is not running or a capture of it is pending;
  // INVALID_ARGUMENT for steps outside 1..kMaxProfileSteps or a rank out of range;
  // RESOURCE_EXHAUSTED past kMaxProfilesPerAttempt.
  absl::StatusOr<v1::ProfileJobResponse> ProfileJob(const v1::ProfileJobRequest& request,
                                                    const Requester& requester = {});
  // Whether `worker_id` may upload files and answer for `rank` of the capture: the capture
  // is pending in attempt `generation`, asks that rank, and the rank was placed on the
  // worker. NOT_FOUND for an unknown job, attempt or capture; FAILED_PRECONDITION otherwise.
  absl::Status CheckProfileWriter(absl::string_view job_id, int64_t generation, int64_t rank,
                                  absl::string_view capture_id, absl::string_view worker_id) const;
  // A rank's answer (its files already stored, with those sizes): the capture fails at the
  // first error and is done once every rank answered. Durable before it returns; a repeated
  // answer of a rank is a no-op. The errors of CheckProfileWriter.
  absl::Status ReportProfile(const v1::ReportProfileRequest& request);
  // The capture and the generation of its attempt, for reading its files. NOT_FOUND for an
  // unknown job (or one the requester does not see) or capture.
  absl::StatusOr<std::pair<int64_t, v1::ProfileCapture>> FindProfile(
      absl::string_view job_id, absl::string_view capture_id,
      const Requester& requester = {}) const;

 private:
  struct SlotRef {
    std::string job_id;
    int64_t generation = 0;
    int64_t rank = 0;
    uint64_t memory = 0;  // the job's planned peak per rank
  };
  // Jobs placed alike: a pass stops a class at its first job that does not fit.
  using ClassKey = std::tuple<v1::Device, int64_t /*ranks*/, uint64_t /*bytes per rank*/>;
  // Queue order within a class: priority (higher first), then submission.
  using QueueKey = std::pair<int64_t /*-priority*/, int64_t /*sequence*/>;
  struct JobClass {
    std::set<QueueKey> queue;
    std::string reason;  // why its head did not fit in the last pass; "" when it did
  };
  struct WorkerState {
    v1::WorkerStatus status;          // running and last_heartbeat_unix_ms live in the registry
    std::string session_id;           // the registry's session; empty: must register again
    std::map<int64_t, SlotRef> busy;  // slot -> rank placed there
    uint64_t busy_memory = 0;         // the planned peaks of the ranks in `busy`
    // What IndexWorker last counted for this worker.
    v1::Device indexed_device = v1::DEVICE_UNSPECIFIED;
    int64_t indexed_slots = 0;
    int64_t indexed_free = 0;
  };
  struct JobState {
    v1::JobStatus status;  // reason: the job's own; a queued job's derived one is View's
    int64_t sequence = 0;  // creation order
    ClassKey class_key;
    std::set<int64_t> succeeded_ranks;
    absl::Time last_persisted;
    int64_t live_ranks = 0;    // busy slots holding a rank of any of its attempts
    bool queued = false;       // in its class's queue
    bool backing_off = false;  // in backoff_, at backoff_at
    int64_t backoff_at = 0;
    absl::Time queued_since;  // submitted or queued again
  };
  Scheduler(Store* store, const Clock* clock, const SchedulerOptions& options);

  int64_t NowMs() const;
  // The status as readers see it: a queued job's derived reason filled in.
  v1::JobStatus View(const JobState& job) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Records a change: the update time, a new state in the history (made by acting_), the
  // watchers, and (unless rate-limited progress) the next batch to the store.
  void Touch(JobState& job, bool persist = true) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The active output that is `output`, holds it or lies inside it (normal paths): two jobs
  // there would write one adapter and mix their checkpoints.
  std::map<std::string, std::string>::const_iterator OverlappingOutput(
      const std::string& output) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The job `requester` sees: null for an unknown one and one another client owns.
  const JobState* Find(absl::string_view job_id, const Requester& requester) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void NotifyWatchers(const JobState& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkWorkerDirty(const WorkerState& worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets the job's state and keeps the indexes (by state, active outputs, the queue) true.
  void SetJobState(JobState& job, v1::JobState state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Puts the job in (or takes it out of) its class's queue and the backoff index by what it
  // is now: queued, past its backoff, no rank of an earlier attempt still on a slot.
  void Reindex(JobState& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts the worker's slots in the per-device totals and the free-slot index again.
  void IndexWorker(WorkerState& worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkBusy(WorkerState& worker, int64_t slot, SlotRef ref) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeSlot(const std::string& worker_id, int64_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RequestPass() ABSL_LOCKS_EXCLUDED(work_mu_);

  // Memory a new rank of a job needing `need` bytes per rank would have in `slot`, with
  // `taken` other free slots of this worker already given to the same placement; nullopt
  // when `need` is 0 (no prediction) or the worker did not report its memory.
  std::optional<uint64_t> FreeMemory(const WorkerState& worker, int64_t slot, size_t taken,
                                     uint64_t need) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One pass: places what fits, class by class in queue order.
  void RunPass() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Places the job when its ranks fit; otherwise returns why not.
  std::optional<std::string> TryPlace(JobState& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ProcessReport(const WorkerRegistry::Report& report) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ReportProgress under the lock; `*acknowledge` when the change must be durable before
  // the call returns.
  absl::Status ApplyReport(const v1::ReportProgressRequest& request, bool* acknowledge)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the current attempt of `job` with `state` and `error`, sends cancellations to
  // the other ranks, frees their slots and sets the job's state and reason (not committed).
  void EndAttempt(JobState& job, v1::AttemptState state, v1::JobState job_state,
                  const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the current attempt as failed for `reason`; an infrastructure failure with
  // restarts left queues the job again after a backoff, anything else fails it. Touches.
  // `charged` false (a drain): queued again at once, not counted as a restart.
  void FailAttempt(JobState& job, const std::string& reason, v1::FailureKind kind,
                   bool charged = true) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkLost(WorkerState& worker, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CheckProfileWriter with the lock held.
  absl::Status CheckProfileWriterLocked(absl::string_view job_id, int64_t generation, int64_t rank,
                                        absl::string_view capture_id,
                                        absl::string_view worker_id) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // IsActiveAttempt with the lock held.
  bool IsActiveAttemptLocked(absl::string_view job_id, int64_t generation) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // --- writes ---
  // Moves the dirty jobs and workers into a staged batch; returns the sequence that is
  // durable once everything staged so far is.
  uint64_t Stage() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Store* const store_;
  const Clock* const clock_;
  const SchedulerOptions options_;

  mutable absl::Mutex mu_ ABSL_ACQUIRED_BEFORE(work_mu_);
  std::map<std::string, JobState, std::less<>> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string, std::less<>> request_ids_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> pending_requests_ ABSL_GUARDED_BY(mu_);  // AddJob writing them
  std::map<std::string, WorkerState, std::less<>> workers_ ABSL_GUARDED_BY(mu_);
  int64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  MemoryCalibration calibration_ ABSL_GUARDED_BY(mu_);
  // Indexes over jobs_.
  std::map<int64_t, JobState*> by_sequence_ ABSL_GUARDED_BY(mu_);
  std::map<v1::JobState, std::set<int64_t>> by_state_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::set<int64_t>> by_name_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> active_outputs_ ABSL_GUARDED_BY(mu_);  // -> job id
  std::map<ClassKey, JobClass> classes_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<int64_t, int64_t>> backoff_ ABSL_GUARDED_BY(mu_);  // (restart at, seq)
  // Indexes over workers_ (READY with a session): slots, free slots, workers with free
  // slots by most free first.
  std::map<v1::Device, int64_t> ready_slots_ ABSL_GUARDED_BY(mu_);
  std::map<v1::Device, int64_t> free_slots_ ABSL_GUARDED_BY(mu_);
  std::map<v1::Device, std::set<std::pair<int64_t, std::string>>> free_index_ ABSL_GUARDED_BY(mu_);
  // Watches: id -> (job, callback), and the ids by job.
  std::map<uint64_t, std::pair<std::string, JobWatcher>> watches_ ABSL_GUARDED_BY(mu_);
  std::multimap<std::string, uint64_t, std::less<>> watches_by_job_ ABSL_GUARDED_BY(mu_);
  uint64_t next_watch_ ABSL_GUARDED_BY(mu_) = 0;
  // Not yet staged.
  std::set<std::string> dirty_jobs_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> dirty_workers_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> deleted_workers_ ABSL_GUARDED_BY(mu_);
  PassStats stats_ ABSL_GUARDED_BY(mu_);
  // Counted since the start, for Snapshot.
  SchedulerSnapshot counters_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<int64_t, std::string>> ended_ ABSL_GUARDED_BY(mu_);  // (ms, job id)
  std::string last_write_error_ ABSL_GUARDED_BY(mu_);
  // Who makes the changes of the call in progress (a job's history); empty: the coordinator.
  std::string acting_ ABSL_GUARDED_BY(mu_);
  absl::Time last_write_error_logged_ ABSL_GUARDED_BY(mu_);

  // Sessions, liveness, mailboxes and heartbeat reports; its own lock, after mu_.
  WorkerRegistry registry_;
  // The staged batches and their writes; its own lock, after mu_.
  GroupCommit commit_;

  // What wakes the scheduling loop (WaitForWork): a leaf lock.
  mutable absl::Mutex work_mu_;
  bool pass_requested_ ABSL_GUARDED_BY(work_mu_) = false;
  bool reports_waiting_ ABSL_GUARDED_BY(work_mu_) = false;  // the registry holds reports
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_SCHEDULER_SCHEDULER_H_
