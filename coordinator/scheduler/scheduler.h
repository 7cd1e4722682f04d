// The coordinator's state machine: the jobs, the workers, the queue and gang placement.
//
// Jobs wait in a queue ordered by priority (higher first), then submission time. Whenever
// something changes (a job arrives, a worker registers, a slot frees up) the scheduler walks
// the queue and places every job whose ranks all fit at once on free slots of live workers
// of its device kind; a job that does not fit stays queued with the reason, and later jobs
// that do fit may go first (backfill). A job is never placed in part.
//
// A placement is an attempt with a generation (1, 2, ...). Workers learn of their ranks in
// the answer to their next heartbeat, report progress and the end of each rank, and every
// report carries the generation: reports for an attempt that is no longer current are
// refused (fencing). A worker silent for longer than the heartbeat timeout is lost, and the
// attempts with a rank on it fail.
//
// When an attempt fails for the infrastructure (a lost worker, a rank killed by a signal or
// stopped by its worker, a collective timeout: the agent classifies its trainer's end) and
// the spec's max_restarts allows, the job is queued again (at once when the attempt trained,
// else after a backoff that doubles with each attempt in a row that did not), and its next
// attempt resumes from the newest checkpoint in its output
// directory. A user error (the spec, the data, a divergence) fails the job at once.
//
// Every change to a job is written through to the Store before the call returns, so a
// restarted coordinator (which loads the store in Create) still knows every job it
// acknowledged. Progress reports are written at most once per second per job; why a queued
// job waits is recomputed by every pass and not written on its own (SetQueueReason).
//
// Thread-safety: thread-safe; every public method takes the one mutex. Watchers wait on it
// with a condition (no polling).
#ifndef LATHE_COORDINATOR_SCHEDULER_SCHEDULER_H_
#define LATHE_COORDINATOR_SCHEDULER_SCHEDULER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/planner/calibration.h"
#include "coordinator/store/store.h"
#include "lathe/v1/coordinator.pb.h"
#include "lathe/v1/job.pb.h"

namespace lathe {

struct SchedulerOptions {
  absl::Duration heartbeat_interval = absl::Seconds(2);
  absl::Duration heartbeat_timeout = absl::Seconds(15);
  // A restart after an attempt that trained at least one step is placed at once; after one
  // that did not, it waits restart_backoff, twice that when the attempt before did not train
  // either, ..., at most the maximum.
  absl::Duration restart_backoff = absl::Seconds(1);
  absl::Duration max_restart_backoff = absl::Seconds(60);
};

class Scheduler {
 public:
  // Loads every job and worker from `store`. Workers known from before come back without a
  // session: they must register again within the heartbeat timeout or are marked lost.
  // REQUIRES: store and clock outlive the scheduler.
  static absl::StatusOr<std::unique_ptr<Scheduler>> Create(Store* store, const Clock* clock,
                                                           const SchedulerOptions& options);

  // --- jobs ---------------------------------------------------------------------------

  // Stores `job` (state QUEUED, with its id, spec and plan filled in) and tries to place it.
  // With a non-empty request_id already used, returns the job it created instead (and
  // `*existing` = true), or ALREADY_EXISTS naming that job when its spec differs. Other
  // errors are the store's.
  absl::StatusOr<v1::JobStatus> AddJob(v1::JobStatus job, absl::string_view request_id,
                                       bool* existing);
  // NOT_FOUND for an unknown id.
  absl::StatusOr<v1::JobStatus> GetJob(absl::string_view job_id) const;
  // Jobs in `states` (all when empty), newest first.
  std::vector<v1::JobStatus> ListJobs(const std::set<v1::JobState>& states) const;
  // Cancels a queued or running job (its running ranks get cancellations). A finished job
  // is returned unchanged. NOT_FOUND for an unknown id.
  absl::StatusOr<v1::JobStatus> CancelJob(absl::string_view job_id, absl::string_view reason);
  // Waits until the job's version differs from `*version` or `deadline` passes, then
  // returns its status and sets `*version`. Start with *version = 0.
  absl::StatusOr<v1::JobStatus> WaitForJobChange(absl::string_view job_id, uint64_t* version,
                                                 absl::Time deadline) const;

  // --- workers ------------------------------------------------------------------------

  // Registers (or re-registers) a worker; returns its new session. Its first heartbeat then
  // settles what it runs: a rank the scheduler placed there that the worker neither lists
  // nor has yet to receive is lost (the coordinator or the agent restarted in between), and
  // its attempt fails as an infrastructure failure; ranks it lists carry on.
  absl::StatusOr<v1::RegisterWorkerResponse> RegisterWorker(
      const v1::RegisterWorkerRequest& request);
  // Records a heartbeat and returns the assignments and cancellations for the worker.
  // FAILED_PRECONDITION when the worker or its session is unknown (register again).
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);
  // A rank's progress or end. FAILED_PRECONDITION for a stale generation or a rank that is
  // not placed on that worker; NOT_FOUND for an unknown job.
  absl::Status ReportProgress(const v1::ReportProgressRequest& request);
  // Marks workers whose last heartbeat is older than the timeout as lost and fails their
  // attempts. Call periodically (the server does, every timeout / 4).
  void CheckHeartbeats();
  std::vector<v1::WorkerStatus> ListWorkers() const;
  // Marks the worker DRAINING (no new placements, kept across its re-registrations) and
  // ends the attempts with a rank on it; their jobs queue again at once, not charged to
  // their max_restarts. NOT_FOUND for an unknown worker.
  absl::StatusOr<v1::WorkerStatus> DrainWorker(absl::string_view worker_id);
  // Forgets a LOST worker (in the store too). FAILED_PRECONDITION for a live one (it would
  // only register again); NOT_FOUND for an unknown worker.
  absl::Status RemoveWorker(absl::string_view worker_id);

  // --- the planner's feedback ---------------------------------------------------------

  // The memory corrections learned from every ended attempt that ran at least one step: its
  // rank's largest measured peak against the plan's prediction, under the plan's
  // calibration key (coordinator/planner/calibration.h). Rebuilt from the store on start.
  MemoryCalibration Calibration() const;
  // Those attempts, newest `limit` first (by end time), and the corrections.
  v1::GetPlanHistoryResponse PlanHistory(size_t limit) const;

  // True when `generation` is the current attempt of the job and that attempt is active:
  // the rendezvous store's fencing check.
  bool IsActiveAttempt(absl::string_view job_id, int64_t generation) const;

 private:
  struct SlotRef {
    std::string job_id;
    int64_t generation = 0;
    int64_t rank = 0;
  };
  struct WorkerState {
    v1::WorkerStatus status;
    std::string session_id;  // empty: must register again
    absl::Time last_heartbeat;
    std::map<int64_t, SlotRef> busy;  // slot -> rank placed there
    std::vector<v1::Assignment> pending_assignments;
    std::vector<v1::Cancellation> pending_cancellations;
    // Set by a registration: the next heartbeat says which ranks the worker really runs.
    bool reconcile = false;
  };
  struct JobState {
    v1::JobStatus status;
    std::string request_id;
    uint64_t version = 1;
    int64_t sequence = 0;  // creation order
    std::set<int64_t> succeeded_ranks;
    absl::Time last_persisted;
  };

  Scheduler(Store* store, const Clock* clock, const SchedulerOptions& options);

  // Memory a new rank of a job needing `need` bytes per rank would have in `slot`, with
  // `taken` other free slots of this worker already given to the same placement; nullopt
  // when `need` is 0 (no prediction) or the worker did not report its memory.
  std::optional<uint64_t> FreeMemory(const WorkerState& worker, int64_t slot, size_t taken,
                                     uint64_t need) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Writes the job to the store and wakes its watchers.
  absl::Status Commit(JobState& job, bool force_persist = true) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why a queued job waits: derived state, recomputed by every pass, so kept in memory (for
  // readers and watchers) and written only with the job's next real change. A pass over
  // thousands of queued jobs must not be thousands of fsyncs (issue #13).
  void SetQueueReason(JobState& job, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Places every queued job that fits.
  void Schedule() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the current attempt of `job` with `state` and `error`, sends cancellations to
  // the other ranks, frees their slots and sets the job's state and reason (not committed).
  void EndAttempt(JobState& job, v1::AttemptState state, v1::JobState job_state,
                  const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the current attempt as failed for `reason`; an infrastructure failure with
  // restarts left queues the job again after a backoff, anything else fails it. Commits.
  // `charged` false (a drain): queued again at once, not counted as a restart.
  void FailAttempt(JobState& job, const std::string& reason, v1::FailureKind kind,
                   bool charged = true) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeSlot(const std::string& worker_id, int64_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // IsActiveAttempt with the lock held.
  bool IsActiveAttemptLocked(absl::string_view job_id, int64_t generation) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void PersistWorker(const WorkerState& worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t NowMs() const;

  Store* const store_;
  const Clock* const clock_;
  const SchedulerOptions options_;

  mutable absl::Mutex mu_;
  std::map<std::string, JobState, std::less<>> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string, std::less<>> request_ids_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, WorkerState, std::less<>> workers_ ABSL_GUARDED_BY(mu_);
  int64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_session_ ABSL_GUARDED_BY(mu_) = 0;
  MemoryCalibration calibration_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_SCHEDULER_SCHEDULER_H_
