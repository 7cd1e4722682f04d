#include "worker/agent/fake_process_launcher.h"

#include <signal.h>

#include <algorithm>
#include <utility>

namespace lathe {
namespace {

class FakeChildProcess : public ChildProcess {
 public:
  explicit FakeChildProcess(std::shared_ptr<FakeProcess> process) : process_(std::move(process)) {}
  ~FakeChildProcess() override {
    if (!process_->exited()) process_->Exit(ExitStatus::Signaled(SIGKILL));
  }

  int pid() const override { return process_->pid(); }
  ExitStatus Wait() override { return process_->Wait(); }
  std::optional<ExitStatus> TryWait() override { return process_->TryWait(); }
  absl::Status Kill(int signal) override { return process_->Kill(signal); }

 private:
  std::shared_ptr<FakeProcess> process_;
};

}  // namespace

void FakeProcess::EmitStdout(absl::string_view line) {
  if (options_.on_stdout_line) options_.on_stdout_line(line);
}

void FakeProcess::EmitStderr(absl::string_view line) {
  if (options_.on_stderr_line) options_.on_stderr_line(line);
}

void FakeProcess::Exit(const ExitStatus& status) {
  {
    absl::MutexLock lock(&mu_);
    if (exiting_) return;
    exiting_ = true;
  }
  if (options_.on_exit) options_.on_exit(status);
  absl::MutexLock lock(&mu_);
  status_ = status;
}

bool FakeProcess::exited() const {
  absl::MutexLock lock(&mu_);
  return exiting_;
}

std::vector<int> FakeProcess::signals() const {
  absl::MutexLock lock(&mu_);
  return signals_;
}

bool FakeProcess::WaitForSignal(int signal, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto sent = [this, signal]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return std::find(signals_.begin(), signals_.end(), signal) != signals_.end();
  };
  return mu_.AwaitWithTimeout(absl::Condition(&sent), timeout);
}

ExitStatus FakeProcess::Wait() const {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return status_.has_value(); };
  mu_.Await(absl::Condition(&done));
  return *status_;
}

std::optional<ExitStatus> FakeProcess::TryWait() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

absl::Status FakeProcess::Kill(int signal) {
  {
    absl::MutexLock lock(&mu_);
    if (exiting_) return absl::OkStatus();
    signals_.push_back(signal);
  }
  if (signal == SIGKILL) Exit(ExitStatus::Signaled(SIGKILL));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ChildProcess>> FakeProcessLauncher::Launch(LaunchOptions options) {
  absl::MutexLock lock(&mu_);
  if (next_failure_) {
    absl::Status failure = *std::move(next_failure_);
    next_failure_.reset();
    return failure;
  }
  if (options.argv.empty()) return absl::InvalidArgumentError("argv: must not be empty");
  auto process = std::make_shared<FakeProcess>(10000 + static_cast<int>(processes_.size()),
                                               std::move(options));
  processes_.push_back(process);
  return std::unique_ptr<ChildProcess>(new FakeChildProcess(std::move(process)));
}

void FakeProcessLauncher::FailNextLaunch(absl::Status status) {
  absl::MutexLock lock(&mu_);
  next_failure_ = std::move(status);
}

int FakeProcessLauncher::launch_count() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(processes_.size());
}

std::shared_ptr<FakeProcess> FakeProcessLauncher::process(int i) const {
  absl::MutexLock lock(&mu_);
  return processes_.at(static_cast<size_t>(i));
}

bool FakeProcessLauncher::WaitForLaunches(int count, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto launched = [this, count]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return static_cast<int>(processes_.size()) >= count;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&launched), timeout);
}

}  // namespace lathe
