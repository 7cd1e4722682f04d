#include "worker/agent/trainer_supervisor.h"

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"
#include "common/proto/trainer_io.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "tests/worker/agent_test_util.h"
#include "worker/agent/fake_process_launcher.h"
#include "worker/agent/process_launcher.h"

namespace lathe {
namespace {

using testing::DoneLine;
using ::testing::ElementsAre;
using testing::ErrorLine;
using testing::EventRecorder;
using ::testing::HasSubstr;
using testing::kWaitLimit;
using ::testing::Not;
using testing::StartLine;
using testing::StepLine;
using testing::WriteScript;

v1::Assignment MakeAssignment(const std::string& job_id = "job-1") {
  v1::Assignment assignment;
  assignment.set_job_id(job_id);
  assignment.set_generation(3);
  assignment.set_rank(1);
  assignment.set_world_size(2);
  assignment.set_slot(0);
  v1::JobSpec& spec = *assignment.mutable_spec();
  spec.set_name("demo");
  spec.mutable_model()->set_path("/models/m");
  spec.mutable_data()->set_train("/data/train.jsonl");
  spec.mutable_train()->set_steps(2);
  spec.mutable_train()->set_global_batch(8);
  spec.set_output("/runs/demo");
  assignment.mutable_plan()->mutable_strategy()->set_micro_batch(4);
  return assignment;
}

class TrainerSupervisorTest : public ::testing::Test {
 protected:
  TrainerSupervisorOptions Options(const std::string& trainer_binary) {
    TrainerSupervisorOptions options;
    options.trainer_binary = trainer_binary;
    options.work_dir = dir_.Path("work");
    options.coordinator_address = "127.0.0.1:7070";
    options.trainer_threads = 2;
    options.peak_flops = 2e12;
    options.cancel_grace = absl::Milliseconds(50);
    return options;
  }

  // A supervisor running `body` as its trainer script.
  TrainerSupervisor& Make(const std::string& body, const std::string& job_id = "job-1") {
    std::string script = WriteScript(dir_, "trainer.sh", body);
    supervisor_ = std::make_unique<TrainerSupervisor>(MakeAssignment(job_id), Options(script),
                                                      &launcher_, &clock_, events_.Callback());
    return *supervisor_;
  }

  testing::TempDir dir_;
  PosixProcessLauncher launcher_;
  FakeClock clock_;
  EventRecorder events_;
  std::unique_ptr<TrainerSupervisor> supervisor_;  // destroyed before events_
};

TEST_F(TrainerSupervisorTest, SucceedsAfterDoneAndExitZero) {
  TrainerSupervisor& supervisor =
      Make(absl::StrCat("printf '%s\\n' \"$@\" > \"$(dirname \"$0\")/args.txt\"\n",  //
                        "echo '", StartLine(2), "'\n",                               //
                        "echo '", StepLine(1, 2, "2.5"), "'\n",                      //
                        "echo 'plain text on stdout'\n",                             //
                        "echo 'warning: from stderr' >&2\n",                         //
                        "echo '", StepLine(2, 2, "null"), "'\n",                     //
                        "echo '", DoneLine(2, "2.25", "/runs/demo/adapter"), "'\n",  //
                        "exit 0\n"));
  ASSERT_TRUE(supervisor.Start().ok());
  RankReport end = events_.WaitForEnd();
  EXPECT_EQ(end.kind, v1::RANK_EVENT_SUCCEEDED) << end.error;
  EXPECT_EQ(end.adapter_path, "/runs/demo/adapter");
  EXPECT_EQ(end.model_path, "");
  EXPECT_EQ(end.error, "");
  EXPECT_EQ(end.progress.step(), 2);
  EXPECT_EQ(end.progress.total_steps(), 2);
  ASSERT_TRUE(end.progress.has_loss());
  EXPECT_DOUBLE_EQ(end.progress.loss(), 2.25);
  EXPECT_DOUBLE_EQ(end.progress.tokens_per_second(), 900.0);
  supervisor.Wait();
  EXPECT_TRUE(supervisor.finished());

  EXPECT_THAT(events_.kinds(),
              ElementsAre(v1::RANK_EVENT_STARTED, v1::RANK_EVENT_PROGRESS, v1::RANK_EVENT_PROGRESS,
                          v1::RANK_EVENT_PROGRESS, v1::RANK_EVENT_SUCCEEDED));
  std::vector<RankReport> events = events_.events();
  EXPECT_EQ(events[1].progress.step(), 0);  // "start"
  EXPECT_EQ(events[1].progress.total_steps(), 2);
  const v1::Progress& step1 = events[2].progress;
  EXPECT_EQ(step1.step(), 1);
  EXPECT_EQ(step1.total_steps(), 2);
  ASSERT_TRUE(step1.has_loss());
  EXPECT_DOUBLE_EQ(step1.loss(), 2.5);
  EXPECT_DOUBLE_EQ(step1.lr(), 0.001);
  EXPECT_DOUBLE_EQ(step1.grad_norm(), 0.5);
  EXPECT_DOUBLE_EQ(step1.tokens_per_second(), 1000.0);
  EXPECT_GT(step1.updated_unix_ms(), 0);
  EXPECT_FALSE(events[3].progress.has_loss());  // a skipped step: "loss": null

  // The command line, the spec file and the log.
  const std::string run_dir = dir_.Path("work") + "/job-1-g3-r1";
  EXPECT_EQ(supervisor.run_dir(), run_dir);
  absl::StatusOr<std::string> args = ReadFile(dir_.Path("args.txt"));
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_EQ(*args,
            absl::StrCat("train\n--task\n", run_dir, "/task.json\n--output\njson\n--threads\n2\n"));
  // The task carries the assignment: spec, plan, rank, rendezvous.
  absl::StatusOr<v1::TrainerTask> task = ReadTrainerTask(run_dir + "/task.json");
  ASSERT_TRUE(task.ok()) << task.status();
  EXPECT_EQ(task->job_id(), "job-1");
  EXPECT_EQ(task->generation(), 3);
  EXPECT_EQ(task->rank(), 1);
  EXPECT_EQ(task->world_size(), 2);
  EXPECT_EQ(task->spec().name(), "demo");
  EXPECT_EQ(task->plan().strategy().micro_batch(), 4);
  EXPECT_EQ(task->rendezvous_address(), "127.0.0.1:7070");
  EXPECT_EQ(task->peak_flops(), 2e12);
  absl::StatusOr<std::string> log = ReadFile(run_dir + "/trainer.log");
  ASSERT_TRUE(log.ok()) << log.status();
  EXPECT_EQ(*log, "warning: from stderr\n");
  // Every event, and nothing else, in events.jsonl.
  absl::StatusOr<std::string> events_text = ReadFile(run_dir + "/events.jsonl");
  ASSERT_TRUE(events_text.ok()) << events_text.status();
  EXPECT_EQ(*events_text,
            absl::StrCat(StartLine(2), "\n", StepLine(1, 2, "2.5"), "\n", StepLine(2, 2, "null"),
                         "\n", DoneLine(2, "2.25", "/runs/demo/adapter"), "\n"));
}

TEST_F(TrainerSupervisorTest, NonZeroExitFailsWithCodeAndLogTail) {
  TrainerSupervisor& supervisor = Make(
      "echo 'not json on stdout'\n"
      "i=1; while [ $i -le 30 ]; do echo \"stderr line $i\" >&2; i=$((i+1)); done\n"
      "exit 3\n");
  ASSERT_TRUE(supervisor.Start().ok());
  RankReport end = events_.WaitForEnd();
  ASSERT_EQ(end.kind, v1::RANK_EVENT_FAILED);
  EXPECT_THAT(end.error, HasSubstr("the trainer exited with code 3"));
  // The last 20 lines only.
  EXPECT_THAT(end.error, HasSubstr("last 20 lines"));
  EXPECT_THAT(end.error, HasSubstr("stderr line 11\n"));
  EXPECT_THAT(end.error, HasSubstr("stderr line 30"));
  EXPECT_THAT(end.error, Not(HasSubstr("stderr line 10\n")));
  EXPECT_THAT(end.error, Not(HasSubstr("not json on stdout")));
  // trainer.log keeps all of stderr.
  absl::StatusOr<std::string> log = ReadFile(supervisor.run_dir() + "/trainer.log");
  ASSERT_TRUE(log.ok()) << log.status();
  std::vector<std::string> lines = absl::StrSplit(*log, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 30u);
  EXPECT_EQ(lines.front(), "stderr line 1");
}

TEST_F(TrainerSupervisorTest, SigkillFailsAndSaysSo) {
  TrainerSupervisor& supervisor =
      Make(absl::StrCat("echo '", StartLine(5), "'\necho 'allocating a lot' >&2\nkill -9 $$\n"));
  ASSERT_TRUE(supervisor.Start().ok());
  RankReport end = events_.WaitForEnd();
  ASSERT_EQ(end.kind, v1::RANK_EVENT_FAILED);
  EXPECT_THAT(end.error, HasSubstr("the trainer was killed by signal 9 (SIGKILL)"));
  EXPECT_THAT(end.error, HasSubstr("out-of-memory"));
  EXPECT_THAT(end.error, HasSubstr("allocating a lot"));
}

TEST_F(TrainerSupervisorTest, AbortFails) {
  TrainerSupervisor& supervisor = Make("echo 'Assertion `x` failed.' >&2\nkill -ABRT $$\n");
  ASSERT_TRUE(supervisor.Start().ok());
  RankReport end = events_.WaitForEnd();
  ASSERT_EQ(end.kind, v1::RANK_EVENT_FAILED);
  EXPECT_THAT(end.error, HasSubstr("killed by signal 6 (SIGABRT)"));
  EXPECT_THAT(end.error, HasSubstr("Assertion `x` failed."));
}

TEST_F(TrainerSupervisorTest, ExitZeroWithoutDoneFails) {
  TrainerSupervisor& supervisor = Make(absl::StrCat("echo '", StartLine(5), "'\nexit 0\n"));
  ASSERT_TRUE(supervisor.Start().ok());
  RankReport end = events_.WaitForEnd();
  ASSERT_EQ(end.kind, v1::RANK_EVENT_FAILED);
  EXPECT_THAT(end.error, HasSubstr("exited with code 0 without reporting \"done\""));
  EXPECT_THAT(end.error, HasSubstr("no log output"));
}

TEST_F(TrainerSupervisorTest, CancelTerminatesTheTrainer) {
  TrainerSupervisor& supervisor =
      Make(absl::StrCat("echo '", StartLine(5), "'\nwhile :; do sleep 1; done\n"));
  ASSERT_TRUE(supervisor.Start().ok());
  ASSERT_TRUE(events_.WaitFor(v1::RANK_EVENT_PROGRESS));
  supervisor.Cancel("the user cancelled the job");
  supervisor.Cancel("again");  // no effect
  RankReport end = events_.WaitForEnd();
  ASSERT_EQ(end.kind, v1::RANK_EVENT_CANCELLED);
  EXPECT_THAT(end.error, HasSubstr("the user cancelled the job"));
  EXPECT_THAT(end.error, HasSubstr("SIGTERM"));
  supervisor.Cancel("after the end");  // no effect either
  EXPECT_THAT(events_.kinds(), ElementsAre(v1::RANK_EVENT_STARTED, v1::RANK_EVENT_PROGRESS,
                                           v1::RANK_EVENT_CANCELLED));
}

TEST_F(TrainerSupervisorTest, CancelEscalatesToSigkill) {
  // Ignores SIGTERM (and so does its sleep, which inherits that).
  TrainerSupervisor& supervisor =
      Make(absl::StrCat("trap '' TERM\necho '", StartLine(5), "'\nwhile :; do sleep 1; done\n"));
  ASSERT_TRUE(supervisor.Start().ok());
  ASSERT_TRUE(events_.WaitFor(v1::RANK_EVENT_PROGRESS));
  supervisor.Cancel("stop");
  RankReport end = events_.WaitForEnd();
  ASSERT_EQ(end.kind, v1::RANK_EVENT_CANCELLED);
  EXPECT_THAT(end.error, HasSubstr("killed by signal 9 (SIGKILL)"));
}

TEST_F(TrainerSupervisorTest, DestroyingARunningSupervisorReportsCancelled) {
  TrainerSupervisor& supervisor = Make("while :; do sleep 1; done\n");
  ASSERT_TRUE(supervisor.Start().ok());
  supervisor_.reset();
  std::vector<RankReport> events = events_.events();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].kind, v1::RANK_EVENT_CANCELLED);
}

TEST_F(TrainerSupervisorTest, MissingTrainerBinaryIsNotFound) {
  supervisor_ =
      std::make_unique<TrainerSupervisor>(MakeAssignment(), Options(dir_.Path("no-such-trainer")),
                                          &launcher_, &clock_, events_.Callback());
  absl::Status status = supervisor_->Start();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("no-such-trainer"));
  EXPECT_TRUE(supervisor_->finished());
  supervisor_->Wait();  // returns at once
  EXPECT_TRUE(events_.events().empty());
  EXPECT_EQ(supervisor_->Start().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(TrainerSupervisorTest, JobIdMustBeAFileName) {
  TrainerSupervisor& supervisor = Make("exit 0\n", "../escape");
  absl::Status status = supervisor.Start();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("job_id"));
  EXPECT_FALSE(std::filesystem::exists(dir_.Path("work")));
}

// --- with the fake launcher: exact command lines and signal sequences -------------------

class TrainerSupervisorFakeTest : public ::testing::Test {
 protected:
  TrainerSupervisor& Make(absl::Duration grace) {
    TrainerSupervisorOptions options;
    options.trainer_binary = "/opt/lathe/lathe-worker";
    options.work_dir = dir_.Path("work");
    options.coordinator_address = "coord:7070";
    options.cancel_grace = grace;
    options.environment = {{"CUDA_VISIBLE_DEVICES", "1"}};
    supervisor_ = std::make_unique<TrainerSupervisor>(MakeAssignment(), options, &launcher_,
                                                      &clock_, events_.Callback());
    return *supervisor_;
  }

  // Starts a trainer that prints `lines` and ends with `exit`; returns its last report.
  RankReport RunToEnd(const std::vector<std::string>& lines, ExitStatus exit) {
    TrainerSupervisor& supervisor = Make(absl::Seconds(5));
    EXPECT_TRUE(supervisor.Start().ok());
    std::shared_ptr<FakeProcess> child = launcher_.process(0);
    for (const std::string& line : lines) child->EmitStdout(line);
    child->Exit(exit);
    RankReport end = events_.WaitForEnd();
    EXPECT_EQ(end.kind, v1::RANK_EVENT_FAILED);
    return end;
  }

  testing::TempDir dir_;
  FakeProcessLauncher launcher_;
  FakeClock clock_;
  EventRecorder events_;
  std::unique_ptr<TrainerSupervisor> supervisor_;
};

TEST_F(TrainerSupervisorFakeTest, LaunchesTheTrainerCommand) {
  TrainerSupervisor& supervisor = Make(absl::Seconds(5));
  ASSERT_TRUE(supervisor.Start().ok());
  ASSERT_EQ(launcher_.launch_count(), 1);
  std::shared_ptr<FakeProcess> child = launcher_.process(0);
  const std::string task = dir_.Path("work") + "/job-1-g3-r1/task.json";
  EXPECT_THAT(child->options().argv,
              ElementsAre("/opt/lathe/lathe-worker", "train", "--task", task, "--output", "json"));
  EXPECT_THAT(child->options().environment,
              ElementsAre(std::make_pair(std::string("CUDA_VISIBLE_DEVICES"), std::string("1"))));
  EXPECT_THAT(events_.kinds(), ElementsAre(v1::RANK_EVENT_STARTED));
  child->Exit(ExitStatus::Exited(0));
}

// `lathe profile`: the request goes to the running trainer as a file in its rank directory;
// its "profile" answer comes back as a report of its own, with where its files must be.
TEST_F(TrainerSupervisorFakeTest, AProfileRequestIsAFileAndItsAnswerAReport) {
  TrainerSupervisor& supervisor = Make(absl::Seconds(5));
  v1::ProfileRequest request;
  request.set_capture_id("prof-2");
  request.set_steps(4);
  request.set_memory(true);
  EXPECT_EQ(supervisor.RequestProfile(request).code(), absl::StatusCode::kFailedPrecondition)
      << "not started";
  ASSERT_TRUE(supervisor.Start().ok());
  std::shared_ptr<FakeProcess> child = launcher_.process(0);
  ASSERT_TRUE(supervisor.RequestProfile(request).ok());
  const std::string path = supervisor.run_dir() + "/profile/request.json";
  absl::StatusOr<std::string> text = ReadFile(path);
  ASSERT_TRUE(text.ok()) << text.status();
  v1::ProfileRequest written;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(*text, &written).ok()) << *text;
  EXPECT_EQ(written.capture_id(), "prof-2");
  EXPECT_EQ(written.steps(), 4);
  EXPECT_TRUE(written.memory());
  EXPECT_THAT(*text, HasSubstr("\"capture_id\""));  // the proto's field names
  v1::ProfileRequest bad = request;
  bad.set_capture_id("../x");
  EXPECT_EQ(supervisor.RequestProfile(bad).code(), absl::StatusCode::kInvalidArgument);

  v1::TrainerEvent answer;
  answer.mutable_profile()->set_capture_id("prof-2");
  answer.mutable_profile()->set_first_step(7);
  answer.mutable_profile()->set_last_step(10);
  answer.mutable_profile()->add_files(supervisor.run_dir() + "/profile/prof-2/trace.json");
  child->EmitStdout(TrainerEventLine(answer));
  child->EmitStdout(DoneLine(10, "1.0", "/runs/demo/adapter"));
  child->Exit(ExitStatus::Exited(0));
  EXPECT_EQ(events_.WaitForEnd().kind, v1::RANK_EVENT_SUCCEEDED);
  const std::vector<RankReport> events = events_.events();
  ASSERT_EQ(events.size(), 3u);  // STARTED, the answer, SUCCEEDED
  ASSERT_TRUE(events[1].profile.has_value());
  EXPECT_EQ(events[1].kind, v1::RANK_EVENT_UNSPECIFIED);
  EXPECT_EQ(events[1].profile->last_step(), 10);
  EXPECT_EQ(events[1].profile_dir, supervisor.run_dir() + "/profile/prof-2");
  EXPECT_EQ(supervisor.RequestProfile(request).code(), absl::StatusCode::kFailedPrecondition)
      << "exited";
}

TEST_F(TrainerSupervisorFakeTest, DoneThenCrashIsAFailure) {
  TrainerSupervisor& supervisor = Make(absl::Seconds(5));
  ASSERT_TRUE(supervisor.Start().ok());
  std::shared_ptr<FakeProcess> child = launcher_.process(0);
  child->EmitStdout(DoneLine(2, "1.0", "/runs/demo/adapter"));
  child->EmitStderr("segfault while exiting");
  child->Exit(ExitStatus::Signaled(SIGSEGV, /*core_dumped=*/true));
  RankReport end = events_.WaitForEnd();
  ASSERT_EQ(end.kind, v1::RANK_EVENT_FAILED);
  EXPECT_THAT(end.error, HasSubstr("killed by signal 11 (SIGSEGV), core dumped"));
  EXPECT_THAT(end.error, HasSubstr("segfault while exiting"));
  EXPECT_THAT(end.error, Not(HasSubstr("out-of-memory")));
}

TEST_F(TrainerSupervisorFakeTest, IgnoresUnknownEventsAndKeepsOtherStdoutInTheTail) {
  TrainerSupervisor& supervisor = Make(absl::Seconds(5));
  ASSERT_TRUE(supervisor.Start().ok());
  std::shared_ptr<FakeProcess> child = launcher_.process(0);
  child->EmitStdout(R"({"checkpoint": {"step": "100", "path": "/runs/x/step-100"}})");
  child->EmitStdout(R"({"event": "from a trainer of another age"})");
  child->EmitStdout(R"(["an", "array"])");
  child->EmitStdout("{broken json");
  child->Exit(ExitStatus::Exited(1));
  RankReport end = events_.WaitForEnd();
  ASSERT_EQ(end.kind, v1::RANK_EVENT_FAILED);
  EXPECT_THAT(end.error, HasSubstr("last 3 lines"));
  EXPECT_THAT(end.error, HasSubstr("[\"an\", \"array\"]\n{broken json"));
  EXPECT_THAT(events_.kinds(), ElementsAre(v1::RANK_EVENT_STARTED, v1::RANK_EVENT_FAILED));
}

TEST_F(TrainerSupervisorFakeTest, TheTrainersOwnErrorLeadsTheFailure) {
  TrainerSupervisor& supervisor = Make(absl::Seconds(5));
  ASSERT_TRUE(supervisor.Start().ok());
  std::shared_ptr<FakeProcess> child = launcher_.process(0);
  child->EmitStdout(ErrorLine("INVALID_ARGUMENT", "data.train: /d/x.jsonl: line 3: not JSON"));
  child->EmitStderr("lathe-worker train: data.train: /d/x.jsonl: line 3: not JSON");
  child->Exit(ExitStatus::Exited(1));
  RankReport end = events_.WaitForEnd();
  ASSERT_EQ(end.kind, v1::RANK_EVENT_FAILED);
  EXPECT_THAT(end.error, ::testing::StartsWith("data.train: /d/x.jsonl: line 3: not JSON (the "
                                               "trainer exited with code 1)"));
  // Said once (issue #32): the trainer's last line, which restates it, is not repeated.
  EXPECT_EQ(end.error,
            "data.train: /d/x.jsonl: line 3: not JSON (the trainer exited with code 1); its "
            "output: lathe logs job-1 --attempt 3 --rank 1");
  EXPECT_EQ(end.failure, v1::FAILURE_KIND_USER);  // the same data fails on any machine
}

// What the trainer did not blame on the job is infrastructure: a restart may help.
TEST_F(TrainerSupervisorFakeTest, ACollectiveTimeoutIsInfrastructure) {
  RankReport end = RunToEnd({StartLine(5, 40), ErrorLine("DEADLINE_EXCEEDED", "peer 1 timed out")},
                            ExitStatus::Exited(1));
  EXPECT_EQ(end.failure, v1::FAILURE_KIND_INFRASTRUCTURE);
  // The first report of a resumed trainer names its checkpoint's step.
  EXPECT_EQ(events_.events()[1].resumed_from_step, 40);
}

TEST_F(TrainerSupervisorFakeTest, ASignalIsInfrastructure) {
  EXPECT_EQ(RunToEnd({StartLine(5)}, ExitStatus::Signaled(SIGKILL, false)).failure,
            v1::FAILURE_KIND_INFRASTRUCTURE);
}

TEST_F(TrainerSupervisorFakeTest, ACrashWithoutAnErrorIsInfrastructure) {
  EXPECT_EQ(RunToEnd({StartLine(5)}, ExitStatus::Exited(134)).failure,
            v1::FAILURE_KIND_INFRASTRUCTURE);
}

TEST_F(TrainerSupervisorFakeTest, ReportsAreStampedWithTheClock) {
  TrainerSupervisor& supervisor = Make(absl::Seconds(5));
  ASSERT_TRUE(supervisor.Start().ok());
  std::shared_ptr<FakeProcess> child = launcher_.process(0);
  child->EmitStdout(StepLine(1, 2, "2.5"));
  ASSERT_TRUE(events_.WaitFor(v1::RANK_EVENT_PROGRESS));
  EXPECT_EQ(events_.events().back().progress.updated_unix_ms(), absl::ToUnixMillis(clock_.Now()));
  EXPECT_DOUBLE_EQ(events_.events().back().progress.mfu(), 0.25);
  child->Exit(ExitStatus::Exited(1));
  events_.WaitForEnd();
}

TEST_F(TrainerSupervisorFakeTest, CancelSendsSigtermThenSigkillAfterTheGrace) {
  TrainerSupervisor& supervisor = Make(absl::Milliseconds(10));
  ASSERT_TRUE(supervisor.Start().ok());
  std::shared_ptr<FakeProcess> child = launcher_.process(0);
  supervisor.Cancel("job cancelled");
  ASSERT_TRUE(child->WaitForSignal(SIGKILL, kWaitLimit));
  EXPECT_THAT(child->signals(), ElementsAre(SIGTERM, SIGKILL));  // SIGKILL ends the fake
  RankReport end = events_.WaitForEnd();
  EXPECT_EQ(end.kind, v1::RANK_EVENT_CANCELLED);
  EXPECT_THAT(end.error, HasSubstr("job cancelled"));
}

TEST_F(TrainerSupervisorFakeTest, NoSigkillWhenTheTrainerStopsInTime) {
  TrainerSupervisor& supervisor = Make(absl::Hours(1));
  ASSERT_TRUE(supervisor.Start().ok());
  std::shared_ptr<FakeProcess> child = launcher_.process(0);
  supervisor.Cancel("job cancelled");  // returns at once despite the hour of grace
  ASSERT_TRUE(child->WaitForSignal(SIGTERM, kWaitLimit));
  child->Exit(ExitStatus::Signaled(SIGTERM));
  EXPECT_EQ(events_.WaitForEnd().kind, v1::RANK_EVENT_CANCELLED);
  supervisor_.reset();  // the SIGKILL timer ends with the trainer, no hour-long wait
  EXPECT_THAT(child->signals(), ElementsAre(SIGTERM));
}

TEST_F(TrainerSupervisorFakeTest, LaunchErrorsComeBackFromStart) {
  TrainerSupervisor& supervisor = Make(absl::Seconds(5));
  launcher_.FailNextLaunch(absl::ResourceExhaustedError("fork: out of processes"));
  absl::Status status = supervisor.Start();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("starting the trainer: fork: out of processes"));
  EXPECT_TRUE(events_.events().empty());
}

}  // namespace
}  // namespace lathe
