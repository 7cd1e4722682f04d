// The long-lived part of lathe-worker: registers with the coordinator, heartbeats, runs
// the ranks it is assigned in child trainer processes (one TrainerSupervisor per busy slot)
// and reports how they go.
//
// Run() registers (WorkerService.RegisterWorker), opens the Heartbeat stream and sends the
// state of every slot each heartbeat interval (the coordinator's, from the registration).
// Each HeartbeatResponse starts a trainer per Assignment in the slot it names and cancels the
// trainers its Cancellations name (job and generation; generation 0: every generation).
// Trainer events become ReportProgress calls (ProgressReporter): STARTED, PROGRESS, and
// SUCCEEDED / FAILED / CANCELLED at the end, with the generation, rank, error and result
// paths.
//
// Profiling (`lathe profile`): each ProfileOrder in a HeartbeatResponse becomes the rank's
// profile request file (TrainerSupervisor::RequestProfile); the trainer's "profile" event
// goes to the ProfileUploader, which uploads the capture's files and answers the order. A
// rank's end is reported only after its captures were sent, so that the coordinator does not
// end the attempt while they are on the way.
//
// Slots: a slot stays busy in heartbeats from the assignment until the coordinator has been
// told how the rank ended (or has refused to hear it), so "idle" in a heartbeat always means
// "the end was reported". An assignment for a busy slot means the coordinator considers
// what runs there over: that trainer is cancelled and the new one starts once it has exited
// and its end was reported. A repeated assignment (same job, generation and rank as one
// this agent holds) is ignored; one for a slot out of range is reported FAILED.
//
// Failures: a broken stream, or FAILED_PRECONDITION / NOT_FOUND from the coordinator (it
// restarted and forgot the session), leads to a new registration and a new stream with the
// retry policy's backoff (back to the start once a session has received an answer); so does
// a coordinator that answers no heartbeat for its heartbeat timeout (a hung process or a
// dead connection); running trainers are not touched, and the coordinator learns of them
// from the next heartbeat. A coordinator that is unreachable at start is retried the same
// way; one that refuses the very first registration with a code the retry policy does not
// retry ends Run with that error. A trainer that crashes is a FAILED report; nothing it does
// stops the agent.
//
// Work directory: each rank runs in `<trainer.work_dir>/<job>-g<generation>-r<rank>/`
// (TrainerSupervisor). Once its trainer has ended (its end reported and the supervisor
// destroyed) and its log has been shipped to the coordinator or declared lost, the folder is
// removed keep_attempt_dirs later (AttemptDirPruner); Run also removes, when it starts, the
// attempt folders an earlier run left that were last written more than keep_attempt_dirs ago.
// The folder of a rank the agent holds is never removed.
//
// Thread-safety: thread-safe. Run blocks on the calling thread; Shutdown may be called from
// any thread (not from a signal handler).
#ifndef LATHE_WORKER_AGENT_WORKER_AGENT_H_
#define LATHE_WORKER_AGENT_WORKER_AGENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/rpc/retry_policy.h"
#include "grpcpp/client_context.h"
#include "lathe/v1/coordinator.grpc.pb.h"
#include "lathe/v1/coordinator.pb.h"
#include "worker/agent/attempt_dir_pruner.h"
#include "worker/agent/log_shipper.h"
#include "worker/agent/process_launcher.h"
#include "worker/agent/profile_uploader.h"
#include "worker/agent/progress_reporter.h"
#include "worker/agent/trainer_supervisor.h"

namespace lathe {

struct WorkerAgentOptions {
  // What RegisterWorker announces.
  std::string worker_id;  // required
  std::string address;    // host:port of the metrics endpoint; may be empty
  v1::Device device = v1::DEVICE_CPU;
  int64_t slots = 1;
  std::vector<v1::DeviceInfo> devices;
  uint64_t host_memory_bytes = 0;
  std::string version;

  // How trainers run (trainer.work_dir is required; trainer.environment applies to all).
  TrainerSupervisorOptions trainer;
  // Extra environment per slot, e.g. CUDA_VISIBLE_DEVICES; slot i uses entry i when present.
  std::vector<std::vector<std::pair<std::string, std::string>>> slot_environment;
  // How long a finished rank's folder stays in trainer.work_dir once its log has been shipped
  // (0: removed within a heartbeat interval; InfiniteDuration: kept). Must be >= 0.
  absl::Duration keep_attempt_dirs = absl::Hours(24);

  // Heartbeat interval when the coordinator's registration answer gives none.
  absl::Duration default_heartbeat_interval = absl::Seconds(2);
  // Between registration attempts (common/rpc/retry_policy.h; max_attempts is not used). At
  // most a second apart: a restarted coordinator fails the ranks of workers that have not
  // registered again within its heartbeat timeout.
  RetryOptions reconnect = {absl::Milliseconds(200), absl::Seconds(1)};
  // Deadline of RegisterWorker.
  absl::Duration rpc_timeout = absl::Seconds(10);
  // The worker's bearer token (common/rpc/auth.h), sent with every call (the progress
  // reporter's too); none when empty. Trainers get it as $LATHE_TOKEN through
  // trainer.environment.
  std::string token;
  ProgressReporterOptions reporter;
  // Profile captures' uploads (token: the one above).
  ProfileUploaderOptions profiles;
  // Told of every trainer event (and of a rank that could not start), before it is
  // reported: the agent's metrics. Called on trainers' threads; may be null.
  std::function<void(const v1::Assignment&, const RankReport&)> on_event;
};

class WorkerAgent {
 public:
  // `clock` times the coordinator's silence (the heartbeat timeout); waits between
  // heartbeats and retries are real time.
  // REQUIRES: `stub`, `launcher` and `clock` outlive the agent.
  WorkerAgent(WorkerAgentOptions options, v1::WorkerService::StubInterface* stub,
              ProcessLauncher* launcher, const Clock* clock);
  // REQUIRES: Run is not running (it has returned, or was never called).
  ~WorkerAgent();

  WorkerAgent(const WorkerAgent&) = delete;
  WorkerAgent& operator=(const WorkerAgent&) = delete;

  // Serves until Shutdown: returns OK then, after cancelling every trainer, waiting for them
  // to exit and trying once to report how they ended. INVALID_ARGUMENT for bad options;
  // the coordinator's error when it refuses the very first registration with a code that
  // is not retried (common/rpc/retry_policy.h); INTERNAL when the work directory cannot be
  // created. Call at most once.
  absl::Status Run();

  // Makes Run return (promptly: trainers get their cancel grace, no more). Idempotent.
  void Shutdown();

  // True while a heartbeat stream is open and the coordinator has answered on it: the
  // agent's readiness.
  bool Connected() const;

 private:
  struct Slot {
    // Running, stopping, or exited with its end not yet reported; null when idle.
    std::shared_ptr<TrainerSupervisor> trainer;
    // Starts when `trainer` is gone.
    std::optional<v1::Assignment> next;
  };

  absl::Status ValidateOptions() const;
  // `wait_for_ready`: wait (up to rpc_timeout) for the coordinator to come back instead of
  // failing at once while the channel reconnects: a restarted coordinator gives its workers
  // only its heartbeat timeout to register again.
  absl::StatusOr<v1::RegisterWorkerResponse> Register(bool wait_for_ready);
  // One heartbeat stream, until it breaks or Shutdown. `*answered`: a response arrived.
  grpc::Status RunSession(const v1::RegisterWorkerResponse& registration, bool* answered);
  v1::HeartbeatRequest BuildHeartbeat();
  void HandleResponse(const v1::HeartbeatResponse& response);
  void HandleAssignment(const v1::Assignment& assignment);
  void HandleCancellation(const v1::Cancellation& cancellation);
  // Hands the order to its rank's trainer; answers it with an error when the rank does not
  // run here or the request cannot be written.
  void HandleProfileOrder(const v1::ProfileOrder& order);
  std::shared_ptr<TrainerSupervisor> MakeSupervisor(const v1::Assignment& assignment)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts a supervisor placed in `slot`; reports FAILED (and frees the slot) when it cannot.
  void StartTrainer(const std::shared_ptr<TrainerSupervisor>& trainer);
  void OnTrainerEvent(const v1::Assignment& assignment, const RankReport& event);
  // Reports FAILED for an assignment that never ran, then frees its slot (if it holds it).
  void ReportNotStarted(const v1::Assignment& assignment, const std::string& error);
  // The end of `assignment` was reported: the slot is free (or starts its next trainer).
  void ReleaseSlot(const v1::Assignment& assignment);
  void StopTrainers();
  // Destroys the retired trainers and hands their folders to the pruner.
  void DestroyRetired();
  // Removes the folders of attempts that ended long enough ago. Run thread only.
  void PruneAttemptDirs();
  // Whether a slot holds (runs, or is to run) the rank whose folder is `name`.
  bool HoldsAttemptDir(const std::string& name) const;
  // Waits `duration` or until Shutdown.
  void SleepUnlessShutdown(absl::Duration duration);
  std::string worker_id() const;

  const WorkerAgentOptions options_;
  v1::WorkerService::StubInterface* const stub_;
  ProcessLauncher* const launcher_;
  const Clock* const clock_;
  // Declared before the slots: trainers are destroyed first, while it can still take reports.
  ProgressReporter reporter_;
  // The trainers' output for the coordinator (`lathe logs`); before the slots too.
  LogShipper shipper_;
  // The trainers' profile captures (`lathe profile`); before the slots too.
  ProfileUploader uploader_;
  // Finished attempts' folders; used by the Run thread only (and the destructor).
  AttemptDirPruner pruner_;

  mutable absl::Mutex mu_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);  // as the coordinator answered
  std::string session_id_ ABSL_GUARDED_BY(mu_);
  // The Run thread's call in progress (registration or heartbeat stream), for Shutdown to
  // cancel.
  grpc::ClientContext* call_context_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool stream_ended_ ABSL_GUARDED_BY(mu_) = false;
  bool answered_ ABSL_GUARDED_BY(mu_) = false;
  int64_t heartbeats_sent_ ABSL_GUARDED_BY(mu_) = 0;  // the next heartbeat's sequence - 1
  absl::Time last_answer_ ABSL_GUARDED_BY(mu_);
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  // Trainers whose slot was released, destroyed on the Run thread (never on a trainer's own
  // reader thread, which their destructor joins).
  std::vector<std::shared_ptr<TrainerSupervisor>> retired_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lathe

#endif  // LATHE_WORKER_AGENT_WORKER_AGENT_H_
