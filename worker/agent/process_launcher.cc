#include "worker/agent/process_launcher.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <set>
#include <system_error>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

extern char** environ;

namespace lathe {
namespace {

// Longer lines are delivered in pieces of this size, so a child that never prints a newline
// cannot grow the agent's memory without bound.
constexpr size_t kMaxLineBytes = 64 * 1024;
// Once the child has exited and its process group is killed, output can only still be open
// in a process that left the group (setsid); stop waiting for it after this long.
constexpr int kDrainTimeoutMs = 2000;
// Without pidfd_open (kernels before 5.3) the exit is noticed by checking this often.
constexpr int kExitCheckMs = 100;

std::string ErrnoText(int err) { return std::error_code(err, std::generic_category()).message(); }

void CloseFd(int& fd) {
  if (fd >= 0) close(fd);
  fd = -1;
}

// Splits a byte stream into lines for one callback.
class LineSplitter {
 public:
  explicit LineSplitter(const std::function<void(absl::string_view)>& sink) : sink_(sink) {}

  void Append(const char* data, size_t size) {
    buffer_.append(data, size);
    size_t start = 0;
    while (true) {
      size_t newline = buffer_.find('\n', start);
      if (newline == std::string::npos) break;
      Emit(absl::string_view(buffer_).substr(start, newline - start));
      start = newline + 1;
    }
    buffer_.erase(0, start);
    while (buffer_.size() >= kMaxLineBytes) {
      Emit(absl::string_view(buffer_).substr(0, kMaxLineBytes));
      buffer_.erase(0, kMaxLineBytes);
    }
  }

  void Finish() {
    if (!buffer_.empty()) Emit(buffer_);
    buffer_.clear();
  }

 private:
  void Emit(absl::string_view line) {
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (sink_) sink_(line);
  }

  const std::function<void(absl::string_view)>& sink_;
  std::string buffer_;
};

class PosixChildProcess : public ChildProcess {
 public:
  PosixChildProcess(pid_t pid, int stdout_fd, int stderr_fd, LaunchOptions options)
      : pid_(pid), stdout_fd_(stdout_fd), stderr_fd_(stderr_fd), options_(std::move(options)) {}

  ~PosixChildProcess() override {
    {
      absl::MutexLock lock(&mu_);
      if (!reaped_) kill(-pid_, SIGKILL);
    }
    if (monitor_.joinable()) monitor_.join();
  }

  void StartMonitor() {
    monitor_ = std::thread([this] { Monitor(); });
  }

  int pid() const override { return pid_; }

  ExitStatus Wait() override {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    return status_;
  }

  std::optional<ExitStatus> TryWait() override {
    absl::MutexLock lock(&mu_);
    if (!done_) return std::nullopt;
    return status_;
  }

  absl::Status Kill(int signal) override {
    absl::MutexLock lock(&mu_);
    if (reaped_) return absl::OkStatus();
    if (kill(-pid_, signal) != 0 && errno != ESRCH) {
      return absl::InternalError(
          absl::StrCat("kill(-", pid_, ", ", SignalName(signal), "): ", ErrnoText(errno)));
    }
    return absl::OkStatus();
  }

 private:
  // True once the child has exited; it stays a zombie (not reaped) so that its pid, which
  // is also its process group id, cannot be reused before Reap.
  bool HasExited() {
    siginfo_t info;
    memset(&info, 0, sizeof(info));
    int rc = waitid(P_PID, pid_, &info, WEXITED | WNOHANG | WNOWAIT);
    if (rc != 0) return errno == ECHILD;  // reaped by someone else: nothing to wait for
    return info.si_pid == pid_;
  }

  // Kills whatever the child left in its process group, then reaps the child.
  ExitStatus Reap() {
    absl::MutexLock lock(&mu_);
    kill(-pid_, SIGKILL);
    int wait_status = 0;
    pid_t rc;
    do {
      rc = waitpid(pid_, &wait_status, 0);
    } while (rc < 0 && errno == EINTR);
    reaped_ = true;
    return rc == pid_ ? ExitStatus::FromWaitStatus(wait_status) : ExitStatus::Exited(-1);
  }

  void Monitor() {
    int pidfd = -1;
#ifdef SYS_pidfd_open
    pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid_, 0));
#endif
    LineSplitter out(options_.on_stdout_line);
    LineSplitter err(options_.on_stderr_line);
    std::optional<ExitStatus> status;
    char buffer[64 * 1024];
    while (true) {
      if (!status && HasExited()) status = Reap();
      if (stdout_fd_ < 0 && stderr_fd_ < 0) {
        if (!status) {
          siginfo_t info;
          while (waitid(P_PID, pid_, &info, WEXITED | WNOWAIT) != 0 && errno == EINTR) {
          }
          status = Reap();
        }
        break;
      }
      pollfd fds[3];
      int count = 0;
      int out_index = -1, err_index = -1;
      if (stdout_fd_ >= 0) {
        out_index = count;
        fds[count++] = {stdout_fd_, POLLIN, 0};
      }
      if (stderr_fd_ >= 0) {
        err_index = count;
        fds[count++] = {stderr_fd_, POLLIN, 0};
      }
      if (!status && pidfd >= 0) fds[count++] = {pidfd, POLLIN, 0};
      int timeout = status ? kDrainTimeoutMs : (pidfd >= 0 ? -1 : kExitCheckMs);
      int ready = poll(fds, count, timeout);
      if (ready < 0) {
        if (errno == EINTR) continue;
        break;  // cannot happen with valid descriptors; stop reading rather than spin
      }
      if (ready == 0 && status) break;  // output held open outside the process group
      auto drain = [&](int index, int& fd, LineSplitter& splitter) {
        if (index < 0 || fds[index].revents == 0) return;
        ssize_t n = read(fd, buffer, sizeof(buffer));
        if (n > 0) {
          splitter.Append(buffer, static_cast<size_t>(n));
        } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
          CloseFd(fd);
          splitter.Finish();
        }
      };
      drain(out_index, stdout_fd_, out);
      drain(err_index, stderr_fd_, err);
    }
    CloseFd(stdout_fd_);
    CloseFd(stderr_fd_);
    out.Finish();
    err.Finish();
    CloseFd(pidfd);
    if (!status) status = Reap();
    if (options_.on_exit) options_.on_exit(*status);
    absl::MutexLock lock(&mu_);
    status_ = *status;
    done_ = true;
  }

  const pid_t pid_;
  // Owned by the monitor thread.
  int stdout_fd_;
  int stderr_fd_;
  const LaunchOptions options_;
  std::thread monitor_;

  absl::Mutex mu_;
  bool reaped_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  ExitStatus status_ ABSL_GUARDED_BY(mu_);
};

// The agent's environment with `overrides` set on top, as "KEY=VALUE" strings.
std::vector<std::string> ChildEnvironment(
    const std::vector<std::pair<std::string, std::string>>& overrides) {
  std::set<std::string> replaced;
  for (const auto& [key, value] : overrides) replaced.insert(key);
  std::vector<std::string> env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    absl::string_view text(*entry);
    size_t eq = text.find('=');
    if (replaced.count(std::string(text.substr(0, eq)))) continue;
    env.emplace_back(text);
  }
  for (const auto& [key, value] : overrides) env.push_back(absl::StrCat(key, "=", value));
  return env;
}

std::vector<char*> Pointers(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  pointers.reserve(strings.size() + 1);
  for (std::string& s : strings) pointers.push_back(s.data());
  pointers.push_back(nullptr);
  return pointers;
}

}  // namespace

ExitStatus ExitStatus::FromWaitStatus(int wait_status) {
  if (WIFEXITED(wait_status)) return Exited(WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) return Signaled(WTERMSIG(wait_status), WCOREDUMP(wait_status));
  return Exited(-1);
}

std::string ExitStatus::ToString() const {
  if (!signaled) return absl::StrCat("exited with code ", code);
  return absl::StrCat("killed by signal ", signal, " (", SignalName(signal), ")",
                      core_dumped ? ", core dumped" : "");
}

std::string SignalName(int signal) {
  const char* abbrev = sigabbrev_np(signal);
  if (abbrev == nullptr) return absl::StrCat("signal ", signal);
  return absl::StrCat("SIG", abbrev);
}

absl::StatusOr<std::unique_ptr<ChildProcess>> PosixProcessLauncher::Launch(LaunchOptions options) {
  if (options.argv.empty()) return absl::InvalidArgumentError("argv: must not be empty");
  const std::string program = options.argv[0];
  std::vector<std::string> argv_strings = options.argv;
  std::vector<char*> argv = Pointers(argv_strings);
  std::vector<std::string> env_strings = ChildEnvironment(options.environment);
  std::vector<char*> envp = Pointers(env_strings);

  int out[2] = {-1, -1};
  int err[2] = {-1, -1};
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) {
    int error = errno;
    for (int& fd : out) CloseFd(fd);
    for (int& fd : err) CloseFd(fd);
    return absl::InternalError(absl::StrCat("pipe: ", ErrnoText(error)));
  }

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_adddup2(&actions, err[1], 2);
  posix_spawn_file_actions_addclosefrom_np(&actions, 3);

  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attr, 0);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  sigset_t all;
  sigfillset(&all);
  sigdelset(&all, SIGKILL);
  sigdelset(&all, SIGSTOP);
  posix_spawnattr_setsigdefault(&attr, &all);

  pid_t pid = -1;
  int rc = posix_spawnp(&pid, program.c_str(), &actions, &attr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  CloseFd(out[1]);
  CloseFd(err[1]);
  if (rc != 0) {
    CloseFd(out[0]);
    CloseFd(err[0]);
    std::string message = absl::StrCat("starting ", program, ": ", ErrnoText(rc));
    if (rc == ENOENT) return absl::NotFoundError(message);
    if (rc == EACCES) return absl::PermissionDeniedError(message);
    return absl::InternalError(message);
  }
  auto child = std::make_unique<PosixChildProcess>(pid, out[0], err[0], std::move(options));
  child->StartMonitor();
  return child;
}

}  // namespace lathe
