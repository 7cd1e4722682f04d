// Child processes behind a small interface, so that the agent's supervision logic can be
// tested against a fake (fake_process_launcher.h) as well as against real processes.
//
// A ProcessLauncher starts a program in its own process group with stdout and stderr piped
// back line by line; the returned ChildProcess is the handle to wait for it and to signal
// it (and everything it started) through its process group.
//
// Thread-safety: launchers are thread-safe. A ChildProcess is thread-safe: Wait, TryWait and
// Kill may be called from any thread. Its callbacks run on one thread that the child owns
// (never concurrently with each other, all output before the exit), so they must not destroy
// the ChildProcess, must not call its Wait, and must not block for long.
#ifndef LATHE_WORKER_AGENT_PROCESS_LAUNCHER_H_
#define LATHE_WORKER_AGENT_PROCESS_LAUNCHER_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lathe {

// How a child process ended: exited with a code, or terminated by a signal.
struct ExitStatus {
  bool signaled = false;  // false: exited with `code`
  int code = 0;           // exit code when !signaled
  int signal = 0;         // terminating signal when signaled
  bool core_dumped = false;

  static ExitStatus Exited(int code) { return {false, code, 0, false}; }
  static ExitStatus Signaled(int signal, bool core_dumped = false) {
    return {true, 0, signal, core_dumped};
  }
  // Decodes a status from waitpid().
  static ExitStatus FromWaitStatus(int wait_status);

  bool success() const { return !signaled && code == 0; }
  // "exited with code 3", "killed by signal 9 (SIGKILL)",
  // "killed by signal 6 (SIGABRT), core dumped".
  std::string ToString() const;

  bool operator==(const ExitStatus& other) const {
    return signaled == other.signaled && code == other.code && signal == other.signal;
  }
};

// "SIGKILL" for 9, "signal 77" for numbers without a name.
std::string SignalName(int signal);

struct LaunchOptions {
  // argv[0] is the program: a path, or a name looked up in PATH.
  std::vector<std::string> argv;
  // Set (or replace) these variables on top of the agent's own environment, which the child
  // inherits.
  std::vector<std::pair<std::string, std::string>> environment;
  // Called with each line of the child's stdout / stderr, without the line ending (a final
  // line without one is delivered at end of output; very long lines arrive in pieces).
  std::function<void(absl::string_view line)> on_stdout_line;
  std::function<void(absl::string_view line)> on_stderr_line;
  // Called once, after the last output line, when the child has exited and been reaped.
  std::function<void(const ExitStatus& status)> on_exit;
};

class ChildProcess {
 public:
  virtual ~ChildProcess() = default;

  virtual int pid() const = 0;

  // Blocks until the child has exited and every callback, on_exit included, has returned.
  virtual ExitStatus Wait() = 0;
  // The exit status when Wait would not block, nullopt while the child runs.
  virtual std::optional<ExitStatus> TryWait() = 0;

  // Sends `signal` to the child's process group (the child and whatever it started). OK
  // and nothing sent once the child has been reaped (so a recycled pid is never hit);
  // INTERNAL with errno text when kill() fails otherwise.
  virtual absl::Status Kill(int signal) = 0;
};

class ProcessLauncher {
 public:
  virtual ~ProcessLauncher() = default;

  // Starts the child. NOT_FOUND when the program does not exist, PERMISSION_DENIED when it
  // is not executable, INTERNAL for other spawn errors, INVALID_ARGUMENT for an empty argv;
  // nothing runs then and no callback is called.
  virtual absl::StatusOr<std::unique_ptr<ChildProcess>> Launch(LaunchOptions options) = 0;
};

// Real processes: posix_spawn (fork/exec semantics) with a new process group, stdin from
// /dev/null, stdout and stderr piped, default signal dispositions and an empty signal
// mask in the child (whatever the agent blocks or ignores). When the child exits, whatever
// it left running in its process group is killed with SIGKILL, so that a trainer's helper
// processes never outlive it. Destroying a ChildProcess that still runs kills its group
// with SIGKILL and waits for it.
class PosixProcessLauncher : public ProcessLauncher {
 public:
  absl::StatusOr<std::unique_ptr<ChildProcess>> Launch(LaunchOptions options) override;
};

}  // namespace lathe

#endif  // LATHE_WORKER_AGENT_PROCESS_LAUNCHER_H_
