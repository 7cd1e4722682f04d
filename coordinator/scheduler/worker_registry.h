// The workers' sessions, liveness and mailboxes: everything a heartbeat touches, under a
// lock of its own, so that answering a heartbeat never waits for the scheduling lock or the
// store (docs/services.md, "At scale").
//
// Per worker id:
//   - a session: a registration opens a new one (ending the previous); a heartbeat names its
//     session, and one naming an ended session is refused (the agent registers again). An id
//     is not taken over from a live agent (its heartbeat stream open, its last heartbeat
//     within the timeout: issue #27).
//   - liveness: the arrival time of its last heartbeat. A live worker silent for longer than
//     the heartbeat timeout is Silent(); the scheduler then declares it lost (Lose).
//   - a mailbox: the assignments placed on it, each deliverable once the store batch holding
//     its placement is durable (GroupCommit's sequence), the cancellations for it, and its
//     heartbeat stream's MailListener, told when there is mail to push.
//   - what it last said it runs, and the reports left for the scheduler to digest: a
//     heartbeat whose ranks changed, the first one of a registration (which the scheduler
//     reconciles against what it placed there), and now and then one while it runs
//     something (a cancellation may have been lost).
//
// The worker records themselves (what a worker registered, READY / DRAINING / LOST, which
// rank holds which slot) are the Scheduler's: placement reads them under the scheduling lock.
// The session here is always the one the scheduler's record names (both are set by a
// registration and cleared when the worker is lost or removed, under the scheduling lock).
//
// Thread-safety: thread-safe. One mutex, which a caller may take while holding its own (the
// Scheduler's mu_ comes first); it is never held while calling out: listeners are told after
// it is released.
#ifndef LATHE_COORDINATOR_SCHEDULER_WORKER_REGISTRY_H_
#define LATHE_COORDINATOR_SCHEDULER_WORKER_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "lathe/v1/coordinator.pb.h"

namespace lathe {

// Told when a worker's heartbeat stream has new mail (assignments placed after its last
// heartbeat). Called without the registry's or the scheduler's locks; implementations must
// not block.
class MailListener {
 public:
  virtual ~MailListener() = default;
  virtual void OnMail() = 0;
};

class WorkerRegistry {
 public:
  // Bounds on what workers send: a registration or a heartbeat is untrusted input, and
  // whatever the coordinator keeps of it must stay small.
  static constexpr size_t kMaxWorkerIdBytes = 128;
  static constexpr int64_t kMaxSlots = 1024;
  static constexpr size_t kMaxShortFieldBytes = 256;  // address, version, device names

  // An attempt's rank on a worker, by (job id, generation).
  using AttemptRef = std::pair<std::string, int64_t>;

  // What a heartbeat leaves for the scheduler.
  struct Report {
    std::string worker_id;
    std::string session_id;
    std::vector<v1::SlotStatus> running;
    bool reconcile = false;  // the first heartbeat of a registration
  };

  // REQUIRES: `clock` outlives the registry.
  WorkerRegistry(const Clock* clock, absl::Duration heartbeat_timeout)
      : clock_(clock), heartbeat_timeout_(heartbeat_timeout) {}

  // INVALID_ARGUMENT for a registration outside the bounds: the worker id's length and
  // characters, the slots, the devices, the short fields' sizes.
  static absl::Status CheckRegistration(const v1::RegisterWorkerRequest& request);

  // --- sessions and liveness ---

  // A worker known from before a restart, without a session. A live one (not lost) has one
  // heartbeat timeout from now to register again before it is Silent().
  void Restore(const std::string& worker_id, bool live) ABSL_LOCKS_EXCLUDED(mu_);
  // Opens a new session for the worker (its previous one ends): live, its heartbeat window
  // starting now, no ranks listed, no stream until its first heartbeat, and that heartbeat
  // reported for reconciliation. Its waiting mail is kept. ALREADY_EXISTS while a live agent
  // holds the id (its stream open, its last heartbeat within the timeout).
  absl::StatusOr<std::string> Open(const std::string& worker_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Records a heartbeat of the worker's current session (its arrival, the ranks it lists, its
  // stream's `listener` when not null) and returns the deliverable mail: the assignments whose
  // batch is at most `durable`, and every cancellation. `*reported`: a report was left for
  // the scheduler. FAILED_PRECONDITION for an unknown worker or session (register again);
  // INVALID_ARGUMENT for more than kMaxSlots slots.
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request,
                                                  std::shared_ptr<MailListener> listener,
                                                  uint64_t durable, bool* reported)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The reports left since the last call, oldest first.
  std::vector<Report> TakeReports() ABSL_LOCKS_EXCLUDED(mu_);
  // The live workers silent for longer than the heartbeat timeout, with their silence.
  std::vector<std::pair<std::string, absl::Duration>> Silent() const ABSL_LOCKS_EXCLUDED(mu_);
  // The worker is lost: its session ends, it is no longer checked for liveness, and its
  // mailbox and listed ranks are emptied.
  void Lose(const std::string& worker_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Every live worker's heartbeat window starts again now (after the coordinator stood
  // still); returns how many.
  int64_t RenewWindows() ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets the worker.
  void Remove(const std::string& worker_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Fills in, for each worker with a session, the ranks it last listed and the arrival of its
  // last heartbeat (ListWorkers).
  void Describe(std::vector<v1::WorkerStatus>& workers) const ABSL_LOCKS_EXCLUDED(mu_);
  // Heartbeats accepted since the start.
  int64_t heartbeats() const { return heartbeats_.load(std::memory_order_relaxed); }

  // --- mailboxes ---

  // Queues assignments for the worker, deliverable once batch `batch` is durable; the worker
  // is waiting for a push (TakeWaiting).
  void Post(const std::string& worker_id, uint64_t batch, std::vector<v1::Assignment> assignments)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Queues a profile order for the worker, deliverable at once like a cancellation (the
  // worker waits for a push).
  void PostProfile(const std::string& worker_id, v1::ProfileOrder order) ABSL_LOCKS_EXCLUDED(mu_);
  // Takes back the assignment of (job, generation, rank) when it was not delivered yet and
  // returns true; otherwise queues a cancellation of (job, generation) with `reason` (the
  // worker waits for a push) and returns false.
  bool WithdrawOrCancel(const std::string& worker_id, const std::string& job_id, int64_t generation,
                        int64_t rank, const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);
  // Queues a cancellation of each of `attempts` on the worker with `reason`, except those
  // for which one is already waiting.
  void CancelUnlessPending(const std::string& worker_id, const std::vector<AttemptRef>& attempts,
                           const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the reconciliation of a registration's first heartbeat: returns those of `placed`
  // (the active ranks the scheduler placed there that the worker did not list) which were
  // neither delivered since the registration (in an answer or pushed: the worker could not
  // have listed them) nor are still waiting to be. Those are lost.
  std::vector<AttemptRef> Reconcile(const std::string& worker_id,
                                    const std::vector<AttemptRef>& placed) ABSL_LOCKS_EXCLUDED(mu_);
  // The deliverable mail of the worker's session now (empty when none or another session).
  v1::HeartbeatResponse TakeMail(absl::string_view worker_id, absl::string_view session_id,
                                 uint64_t durable) ABSL_LOCKS_EXCLUDED(mu_);
  // The workers with mail posted since the last call, to be pushed once it is deliverable.
  std::set<std::string> TakeWaiting() ABSL_LOCKS_EXCLUDED(mu_);
  // Tells the listeners of `workers` (those with an open stream) that they have mail.
  void Notify(const std::set<std::string>& workers) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Mailbox {
    std::string session_id;  // empty: no heartbeats accepted
    bool live = false;       // not lost: liveness is checked
    absl::Time last_heartbeat;
    int64_t last_heartbeat_unix_ms = 0;
    std::vector<v1::SlotStatus> running;  // as of the last heartbeat
    absl::Time last_report;
    bool reconcile = false;  // the next heartbeat is the first of a registration
    // From a registration until the scheduler has reconciled it: every rank delivered
    // meanwhile (in answers or pushed), which the worker cannot have been expected to list.
    bool reconciling = false;
    std::vector<AttemptRef> delivered;
    // An assignment is deliverable once the batch with its placement (that sequence) is
    // durable.
    std::vector<std::pair<uint64_t, v1::Assignment>> assignments;
    std::vector<v1::Cancellation> cancellations;
    std::vector<v1::ProfileOrder> profiles;
    std::weak_ptr<MailListener> listener;
  };

  // Moves the deliverable mail into `response`.
  static void TakeDeliverable(Mailbox& mailbox, uint64_t durable, v1::HeartbeatResponse* response);

  const Clock* const clock_;
  const absl::Duration heartbeat_timeout_;
  mutable absl::Mutex mu_;
  std::map<std::string, Mailbox, std::less<>> mail_ ABSL_GUARDED_BY(mu_);
  std::vector<Report> reports_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> waiting_ ABSL_GUARDED_BY(mu_);
  uint64_t next_session_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int64_t> heartbeats_{0};
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_SCHEDULER_WORKER_REGISTRY_H_
