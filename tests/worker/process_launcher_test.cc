#include "worker/agent/process_launcher.h"

#include <signal.h>
#include <stdlib.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace lathe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// Collects a child's output lines.
struct Output {
  absl::Mutex mu;
  std::vector<std::string> out;
  std::vector<std::string> err;
  std::vector<std::string> order;  // "out:line" / "err:line" / "exit"

  LaunchOptions Options(std::vector<std::string> argv) {
    LaunchOptions options;
    options.argv = std::move(argv);
    options.on_stdout_line = [this](absl::string_view line) {
      absl::MutexLock lock(&mu);
      out.emplace_back(line);
      order.push_back("out:" + std::string(line));
    };
    options.on_stderr_line = [this](absl::string_view line) {
      absl::MutexLock lock(&mu);
      err.emplace_back(line);
    };
    options.on_exit = [this](const ExitStatus&) {
      absl::MutexLock lock(&mu);
      order.push_back("exit");
    };
    return options;
  }
};

std::unique_ptr<ChildProcess> Launch(LaunchOptions options) {
  PosixProcessLauncher launcher;
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = launcher.Launch(std::move(options));
  EXPECT_TRUE(child.ok()) << child.status();
  return child.ok() ? *std::move(child) : nullptr;
}

TEST(ExitStatusTest, DescribesCodesAndSignals) {
  EXPECT_EQ(ExitStatus::Exited(0).ToString(), "exited with code 0");
  EXPECT_TRUE(ExitStatus::Exited(0).success());
  EXPECT_EQ(ExitStatus::Exited(3).ToString(), "exited with code 3");
  EXPECT_FALSE(ExitStatus::Exited(3).success());
  EXPECT_EQ(ExitStatus::Signaled(SIGKILL).ToString(), "killed by signal 9 (SIGKILL)");
  EXPECT_FALSE(ExitStatus::Signaled(SIGKILL).success());
  EXPECT_EQ(ExitStatus::Signaled(SIGABRT, true).ToString(),
            "killed by signal 6 (SIGABRT), core dumped");
  EXPECT_EQ(SignalName(SIGTERM), "SIGTERM");
}

TEST(PosixProcessLauncherTest, DeliversLinesThenExit) {
  Output output;
  auto child = Launch(output.Options(
      {"/bin/sh", "-c", "echo one; echo warn >&2; echo two; printf 'no newline'; exit 0"}));
  ASSERT_NE(child, nullptr);
  EXPECT_GT(child->pid(), 0);
  ExitStatus status = child->Wait();
  EXPECT_EQ(status, ExitStatus::Exited(0));
  ASSERT_TRUE(child->TryWait().has_value());
  EXPECT_EQ(*child->TryWait(), ExitStatus::Exited(0));
  absl::MutexLock lock(&output.mu);
  EXPECT_THAT(output.out, ElementsAre("one", "two", "no newline"));
  EXPECT_THAT(output.err, ElementsAre("warn"));
  EXPECT_EQ(output.order.back(), "exit");
}

TEST(PosixProcessLauncherTest, ReportsExitCode) {
  Output output;
  auto child = Launch(output.Options({"/bin/sh", "-c", "exit 3"}));
  ASSERT_NE(child, nullptr);
  EXPECT_EQ(child->Wait().ToString(), "exited with code 3");
}

TEST(PosixProcessLauncherTest, ReportsKillSignal) {
  Output output;
  auto child = Launch(output.Options({"/bin/sh", "-c", "kill -9 $$"}));
  ASSERT_NE(child, nullptr);
  ExitStatus status = child->Wait();
  EXPECT_TRUE(status.signaled);
  EXPECT_EQ(status.signal, SIGKILL);
  EXPECT_EQ(status.ToString(), "killed by signal 9 (SIGKILL)");
}

TEST(PosixProcessLauncherTest, ReportsAbort) {
  Output output;
  auto child = Launch(output.Options({"/bin/sh", "-c", "kill -ABRT $$"}));
  ASSERT_NE(child, nullptr);
  EXPECT_THAT(child->Wait().ToString(), StartsWith("killed by signal 6 (SIGABRT)"));
}

TEST(PosixProcessLauncherTest, KillSignalsTheProcessGroup) {
  Output output;
  // The shell waits on a child of its own; both must go.
  auto child = Launch(output.Options({"/bin/sh", "-c", "sleep 1000 & echo started; wait"}));
  ASSERT_NE(child, nullptr);
  EXPECT_FALSE(child->TryWait().has_value());
  ASSERT_TRUE(child->Kill(SIGTERM).ok());
  ExitStatus status = child->Wait();
  EXPECT_EQ(status, ExitStatus::Signaled(SIGTERM));
  // Once reaped, Kill is a no-op rather than a signal to a recycled pid.
  EXPECT_TRUE(child->Kill(SIGKILL).ok());
}

TEST(PosixProcessLauncherTest, LeftoverProcessesDieWithTheChild) {
  Output output;
  // The background sleep keeps stdout open; the launcher must not wait for it.
  auto child = Launch(output.Options({"/bin/sh", "-c", "sleep 1000 & echo $!; exit 0"}));
  ASSERT_NE(child, nullptr);
  EXPECT_EQ(child->Wait(), ExitStatus::Exited(0));
  int leftover = 0;
  {
    absl::MutexLock lock(&output.mu);
    ASSERT_EQ(output.out.size(), 1u);
    ASSERT_TRUE(absl::SimpleAtoi(output.out[0], &leftover));
  }
  // The leftover sleep was sent SIGKILL; wait for it to be gone (or a zombie of init's).
  absl::Time deadline = absl::Now() + absl::Seconds(60);
  bool gone = false;
  while (!gone && absl::Now() < deadline) {
    std::ifstream stat("/proc/" + std::to_string(leftover) + "/stat");
    std::string pid, comm, state;
    gone = !(stat >> pid >> comm >> state) || state == "Z";
    if (!gone) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(gone) << "process " << leftover << " outlived its group";
}

TEST(PosixProcessLauncherTest, ChildGetsCleanSignalMask) {
  // The agent blocks SIGTERM (it sigwaits for it); its trainers must still die of it.
  sigset_t block, old;
  sigemptyset(&block);
  sigaddset(&block, SIGTERM);
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &block, &old), 0);
  Output output;
  auto child = Launch(output.Options({"/bin/sh", "-c", "echo ready; while :; do sleep 1; done"}));
  ASSERT_EQ(pthread_sigmask(SIG_SETMASK, &old, nullptr), 0);
  ASSERT_NE(child, nullptr);
  ASSERT_TRUE(child->Kill(SIGTERM).ok());
  EXPECT_EQ(child->Wait(), ExitStatus::Signaled(SIGTERM));
}

TEST(PosixProcessLauncherTest, PassesEnvironmentThrough) {
  ASSERT_EQ(setenv("LATHE_LAUNCHER_TEST_INHERITED", "inherited", 1), 0);
  ASSERT_EQ(setenv("LATHE_LAUNCHER_TEST_REPLACED", "old", 1), 0);
  Output output;
  LaunchOptions options = output.Options(
      {"sh", "-c",  // looked up in PATH
       "echo $LATHE_LAUNCHER_TEST_INHERITED $LATHE_LAUNCHER_TEST_REPLACED $LATHE_LAUNCHER_NEW"});
  options.environment = {{"LATHE_LAUNCHER_TEST_REPLACED", "new"}, {"LATHE_LAUNCHER_NEW", "added"}};
  auto child = Launch(std::move(options));
  ASSERT_NE(child, nullptr);
  EXPECT_EQ(child->Wait(), ExitStatus::Exited(0));
  absl::MutexLock lock(&output.mu);
  EXPECT_THAT(output.out, ElementsAre("inherited new added"));
}

TEST(PosixProcessLauncherTest, MissingProgramIsNotFound) {
  PosixProcessLauncher launcher;
  LaunchOptions options;
  options.argv = {"/nonexistent/lathe-trainer", "train"};
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = launcher.Launch(std::move(options));
  EXPECT_EQ(child.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(child.status().message(), HasSubstr("/nonexistent/lathe-trainer"));
}

TEST(PosixProcessLauncherTest, NonExecutableIsPermissionDenied) {
  testing::TempDir dir;
  std::string path = dir.Write("not-executable", "#!/bin/sh\nexit 0\n");
  PosixProcessLauncher launcher;
  LaunchOptions options;
  options.argv = {path};
  EXPECT_EQ(launcher.Launch(std::move(options)).status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST(PosixProcessLauncherTest, EmptyArgvIsInvalid) {
  PosixProcessLauncher launcher;
  EXPECT_EQ(launcher.Launch(LaunchOptions()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PosixProcessLauncherTest, DestroyingARunningChildKillsIt) {
  Output output;
  auto child = Launch(output.Options({"/bin/sh", "-c", "while :; do sleep 1; done"}));
  ASSERT_NE(child, nullptr);
  child.reset();  // must return: the group is killed and reaped
  absl::MutexLock lock(&output.mu);
  EXPECT_EQ(output.order.back(), "exit");
}

}  // namespace
}  // namespace lathe
