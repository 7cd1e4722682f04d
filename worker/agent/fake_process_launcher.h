// A ProcessLauncher for tests: nothing is started; the test plays the child's part, emitting
// output lines and the exit on its own thread, and sees the signals sent to it.
//
//   FakeProcessLauncher launcher;
//   ... code under test calls launcher.Launch(...) ...
//   std::shared_ptr<FakeProcess> child = launcher.process(0);
//   child->EmitStdout(R"({"event": "start", "steps": 10})");
//   child->Exit(ExitStatus::Exited(0));
//
// Thread-safety: thread-safe. Emit* and Exit call the launch callbacks on the calling thread,
// like the real launcher's reader thread would (never two at once for one process is the
// test's job).
#ifndef LATHE_WORKER_AGENT_FAKE_PROCESS_LAUNCHER_H_
#define LATHE_WORKER_AGENT_FAKE_PROCESS_LAUNCHER_H_

#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/agent/process_launcher.h"

namespace lathe {

// The test's side of one launched fake child.
class FakeProcess {
 public:
  FakeProcess(int pid, LaunchOptions options) : pid_(pid), options_(std::move(options)) {}

  int pid() const { return pid_; }
  // What the code under test launched.
  const LaunchOptions& options() const { return options_; }

  void EmitStdout(absl::string_view line);
  void EmitStderr(absl::string_view line);
  // Ends the child: calls on_exit, then wakes waiters. Later calls are ignored.
  void Exit(const ExitStatus& status);

  bool exited() const;
  // Every signal sent by Kill, in order.
  std::vector<int> signals() const;
  // True once `signal` has been sent, false when `timeout` passes first.
  bool WaitForSignal(int signal, absl::Duration timeout) const;

  // ChildProcess's side. Kill records the signal (none once exited); SIGKILL, which no
  // process survives, also ends the fake (on_exit runs on the caller's thread).
  ExitStatus Wait() const;
  std::optional<ExitStatus> TryWait() const;
  absl::Status Kill(int signal);

 private:
  const int pid_;
  const LaunchOptions options_;
  mutable absl::Mutex mu_;
  bool exiting_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<ExitStatus> status_ ABSL_GUARDED_BY(mu_);
  std::vector<int> signals_ ABSL_GUARDED_BY(mu_);
};

class FakeProcessLauncher : public ProcessLauncher {
 public:
  // The handle returned to the code under test. Destroying it while the fake still runs
  // ends it with SIGKILL, as the real launcher does.
  absl::StatusOr<std::unique_ptr<ChildProcess>> Launch(LaunchOptions options) override;

  // The next Launch fails with `status` (and launches nothing).
  void FailNextLaunch(absl::Status status);

  int launch_count() const;
  // The i-th launched process (0-based). REQUIRES: i < launch_count().
  std::shared_ptr<FakeProcess> process(int i) const;
  // Waits until at least `count` processes were launched; false after `timeout`.
  bool WaitForLaunches(int count, absl::Duration timeout) const;

 private:
  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<FakeProcess>> processes_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Status> next_failure_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lathe

#endif  // LATHE_WORKER_AGENT_FAKE_PROCESS_LAUNCHER_H_
