// Runs one rank of one attempt in a child trainer process and turns what it does into
// reports for the coordinator.
//
// Start writes the rank's TrainerTask (proto/lathe/v1/trainer.proto: the spec, the plan, the
// rank, the rendezvous address) to `<work_dir>/<job_id>-g<generation>-r<rank>/task.json` and
// launches
//
//   <trainer_binary> train --task <dir>/task.json --output json [--threads T]
//
// in its own process group. The trainer prints one TrainerEvent per line on stdout
// (common/proto/trainer_io.h); they are kept in `<dir>/events.jsonl` as they come, and become
// reports: "start" and each "step" a PROGRESS, "done" the result of a SUCCEEDED, "error" the
// reason of a FAILED, "profile" a report with RankReport::profile set (RequestProfile). The child's
// stderr goes to `<dir>/trainer.log`; the last lines of it (and of stdout that is not an event) are
// kept as the log tail for error messages.
//
// Reports, in order: STARTED (from Start, once the child runs), PROGRESS*, then exactly one
// terminal report when the child has exited:
//   SUCCEEDED  exit code 0 after a "done" event
//   CANCELLED  Cancel was called before the child exited (whatever its exit status)
//   FAILED     anything else: a non-zero exit, a signal (an out-of-memory kill is SIGKILL,
//              an abort SIGABRT), or exit 0 without "done"; the error holds the trainer's
//              own "error" event when it printed one, the exit status and the log tail.
// A crash of the trainer is only ever a report: nothing here aborts the agent.
//
// Thread-safety: thread-safe. The report callback runs on the caller's thread for STARTED and
// on the child's reader thread for the others, never two at once; it must not call back into
// this supervisor (except Cancel, which only signals) nor destroy it.
#ifndef LATHE_WORKER_AGENT_TRAINER_SUPERVISOR_H_
#define LATHE_WORKER_AGENT_TRAINER_SUPERVISOR_H_

#include <cstdint>
#include <deque>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "lathe/v1/coordinator.pb.h"
#include "lathe/v1/job.pb.h"
#include "lathe/v1/trainer.pb.h"
#include "worker/agent/process_launcher.h"

namespace lathe {

struct TrainerSupervisorOptions {
  // The lathe-worker binary to run `train` with; by default this very executable.
  std::string trainer_binary = "/proc/self/exe";
  // Parent of the per-rank directories. Created when missing.
  std::string work_dir;
  // The coordinator's RendezvousService, written into the task for the ranks to meet.
  std::string coordinator_address;
  // > 0: passed as --threads.
  int64_t trainer_threads = 0;
  // > 0: the device's peak FLOP/s for MFU, written into the task (0: the trainer finds it).
  double peak_flops = 0.0;
  // > 0: how long a trainer's collective waits for the other ranks, written into the task.
  absl::Duration collective_timeout = absl::ZeroDuration();
  // After Cancel's SIGTERM, how long the trainer has to exit before SIGKILL.
  absl::Duration cancel_grace = absl::Seconds(5);
  // Set in the trainer's environment (e.g. CUDA_VISIBLE_DEVICES for the slot's GPU).
  std::vector<std::pair<std::string, std::string>> environment;
  // How many lines the log tail keeps.
  int log_tail_lines = 20;
  // Told every line of the trainer's output that is not an event (its log: stderr, and
  // stray stdout lines), on its reader threads; may be null.
  std::function<void(absl::string_view line)> on_output_line;
};

// What the supervisor tells its owner: one of the coordinator's RankEvents, with what the
// trainer's events said.
struct RankReport {
  v1::RankEvent kind = v1::RANK_EVENT_UNSPECIFIED;
  // PROGRESS: the step just reported (step 0 for "start"). SUCCEEDED: the final numbers,
  // loss = final loss.
  v1::Progress progress;
  // SUCCEEDED: where the trainer put its result (empty when it reported none).
  std::string adapter_path;
  std::string model_path;
  // FAILED and CANCELLED: why, with the exit status and the log tail.
  std::string error;
  // FAILED: a user error when the trainer said so (its error event's code: a bad spec, data
  // or model, a divergence); infrastructure otherwise (a signal, a crash, a timeout).
  v1::FailureKind failure = v1::FAILURE_KIND_UNSPECIFIED;
  // PROGRESS for "start": the checkpoint step the trainer resumed from; 0: fresh.
  int64_t resumed_from_step = 0;
  // Set (kind UNSPECIFIED, no other field) for a "profile" event: the trainer's answer to a
  // RequestProfile, and the directory its files must lie in (<run dir>/profile/<capture_id>).
  std::optional<v1::TrainerProfile> profile;
  std::string profile_dir;
};

class TrainerSupervisor {
 public:
  using EventCallback = std::function<void(const RankReport&)>;

  // `clock` stamps the reports' updated_unix_ms.
  // REQUIRES: `launcher` and `clock` outlive the supervisor; options.work_dir is not empty.
  TrainerSupervisor(v1::Assignment assignment, TrainerSupervisorOptions options,
                    ProcessLauncher* launcher, const Clock* clock, EventCallback on_event);
  // A trainer still running is killed with SIGKILL; its CANCELLED event is still reported
  // before the destructor returns.
  ~TrainerSupervisor();

  TrainerSupervisor(const TrainerSupervisor&) = delete;
  TrainerSupervisor& operator=(const TrainerSupervisor&) = delete;

  // Writes task.json and starts the trainer; reports STARTED. On error nothing runs and no
  // event is reported: INVALID_ARGUMENT for a job id that is not a safe file name,
  // FAILED_PRECONDITION when called twice or after Cancel, INTERNAL when the files cannot
  // be written, and the launcher's errors (NOT_FOUND for a missing trainer binary).
  absl::Status Start();

  // Asks the trainer to stop: SIGTERM to its process group now, SIGKILL after cancel_grace
  // if it is still running. Returns at once; the CANCELLED event follows when it exits.
  // Later calls, and calls after the exit, do nothing.
  void Cancel(absl::string_view reason);

  // Asks the running trainer to profile its next steps: writes `request` to
  // <run dir>/profile/request.json (a temp file renamed, so that the trainer never reads half
  // of one); the trainer answers with a "profile" event, reported with RankReport::profile.
  // FAILED_PRECONDITION when the trainer is not running (not started, or exited);
  // INVALID_ARGUMENT for a capture id that is not [A-Za-z0-9_-]{1,64}; INTERNAL when the file
  // cannot be written.
  absl::Status RequestProfile(const v1::ProfileRequest& request);

  // True once the terminal event has been reported, or Start failed.
  bool finished() const;
  // Blocks until finished(); returns at once when Start was never called.
  void Wait() const;

  const v1::Assignment& assignment() const { return assignment_; }
  // `<work_dir>/<job_id>-g<generation>-r<rank>`.
  const std::string& run_dir() const { return run_dir_; }

 private:
  // Start's work; on error Start marks the supervisor finished.
  absl::Status Launch();
  void OnStdoutLine(absl::string_view line);
  void OnStderrLine(absl::string_view line);
  void OnExit(const ExitStatus& status);
  // SIGTERM now, SIGKILL from killer_ after cancel_grace. REQUIRES: child_ is set.
  void SignalCancel();
  void AddToTail(absl::string_view line) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "; last N lines of its output ...": the tail, less lines that only repeat `error` (the
  // trainer's last line restates its error event).
  std::string TailText(absl::string_view error) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Emit(const RankReport& event);

  const v1::Assignment assignment_;
  const TrainerSupervisorOptions options_;
  ProcessLauncher* const launcher_;
  const Clock* const clock_;
  const EventCallback on_event_;
  const std::string run_dir_;

  // Held while calling on_event_, so that events are delivered one at a time and STARTED
  // (emitted by Start) comes before anything the reader thread reports. Acquired before mu_.
  absl::Mutex emit_mu_;

  mutable absl::Mutex mu_;
  std::unique_ptr<ChildProcess> child_ ABSL_GUARDED_BY(mu_);
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool cancel_requested_ ABSL_GUARDED_BY(mu_) = false;
  std::string cancel_reason_ ABSL_GUARDED_BY(mu_);
  bool exited_ ABSL_GUARDED_BY(mu_) = false;             // on_exit was called
  bool finished_ ABSL_GUARDED_BY(mu_) = false;           // terminal event reported, or Start failed
  std::optional<RankReport> done_ ABSL_GUARDED_BY(mu_);  // from the "done" event
  std::string trainer_error_ ABSL_GUARDED_BY(mu_);       // from the "error" event
  std::string trainer_error_code_ ABSL_GUARDED_BY(mu_);  // its absl status code's name
  v1::Progress last_progress_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> tail_ ABSL_GUARDED_BY(mu_);
  std::thread killer_ ABSL_GUARDED_BY(mu_);  // from SignalCancel; joined by the destructor

  // Written only by the reader thread (and opened by Start before it exists).
  std::ofstream log_file_;
  std::ofstream events_file_;
};

}  // namespace lathe

#endif  // LATHE_WORKER_AGENT_TRAINER_SUPERVISOR_H_
