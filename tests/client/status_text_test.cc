// Unit tests of the CLI's text renderings that need no coordinator.
#include "client/status_text.h"

#include <limits>
#include <optional>
#include <sstream>

#include "client/watch_printer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;

TEST(StatusTextTest, ShortDuration) {
  EXPECT_EQ(ShortDuration(absl::Seconds(-5)), "0s");
  EXPECT_EQ(ShortDuration(absl::Seconds(0)), "0s");
  EXPECT_EQ(ShortDuration(absl::Milliseconds(59'999)), "59s");
  EXPECT_EQ(ShortDuration(absl::Seconds(65)), "1m05s");
  EXPECT_EQ(ShortDuration(absl::Minutes(123)), "2h03m");
  EXPECT_EQ(ShortDuration(absl::Hours(76)), "3d04h");
}

TEST(StatusTextTest, FormatBytes) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(64ull << 20), "64.0 MiB");
  EXPECT_EQ(FormatBytes(80ull << 30), "80.0 GiB");
  EXPECT_EQ(FormatBytes(300ull << 30), "300 GiB");
}

TEST(StatusTextTest, FormatTimestamp) {
  EXPECT_EQ(FormatTimestamp(0), "-");
  EXPECT_EQ(FormatTimestamp(1'700'000'000'123), "2023-11-14T22:13:20Z");
}

TEST(StatusTextTest, ParseJobState) {
  EXPECT_EQ(*ParseJobState("running"), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(*ParseJobState("CANCELLED"), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(*ParseJobState("JOB_STATE_QUEUED"), v1::JOB_STATE_QUEUED);
  EXPECT_EQ(ParseJobState("unspecified").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ParseJobState("done").status().message(), HasSubstr("queued, running"));
}

TEST(StatusTextTest, Truncate) {
  EXPECT_EQ(Truncate("short", 10), "short");
  EXPECT_EQ(Truncate("a\nb", 10), "a b");
  EXPECT_EQ(Truncate("0123456789abc", 10), "0123456...");
}

TEST(StatusTextTest, StepTextFallsBackToThePlan) {
  v1::JobStatus job;
  EXPECT_EQ(StepText(job), "-");
  job.mutable_plan()->set_total_steps(50);
  job.add_attempts()->mutable_progress()->set_step(5);
  EXPECT_EQ(StepText(job), "5/50");
  job.mutable_plan()->set_total_steps(0);
  EXPECT_EQ(StepText(job), "5/?");
}

TEST(StatusTextTest, JobTableOfNothingIsAHeader) {
  EXPECT_EQ(JobTable({}, absl::Now()), "ID  NAME  STATE  STEP  LOSS  AGE  REASON\n");
}

v1::JobStatus Running(int64_t generation, int64_t step, int64_t unix_ms) {
  v1::JobStatus job;
  job.set_state(v1::JOB_STATE_RUNNING);
  v1::Attempt* attempt = job.add_attempts();
  attempt->set_generation(generation);
  attempt->mutable_progress()->set_step(step);
  attempt->mutable_progress()->set_total_steps(1000);
  attempt->mutable_progress()->set_updated_unix_ms(unix_ms);
  return job;
}

v1::JobStatus RunningWithStepTime(int64_t step, double step_seconds) {
  v1::JobStatus job = Running(1, step, 1);
  job.mutable_attempts(0)->mutable_progress()->set_step_seconds(step_seconds);
  return job;
}

TEST(EtaSecondsTest, StepsLeftTimesTheMeanStepTime) {
  EXPECT_EQ(EtaSeconds(RunningWithStepTime(500, 0.13)), 500 * 0.13);
  // The last step reached: nothing left.
  EXPECT_EQ(EtaSeconds(RunningWithStepTime(1000, 0.5)), 0.0);
  EXPECT_EQ(EtaSeconds(RunningWithStepTime(1200, 0.5)), 0.0);
}

TEST(EtaSecondsTest, TheTotalFallsBackToThePlan) {
  v1::JobStatus job = RunningWithStepTime(10, 1.5);
  job.mutable_attempts(0)->mutable_progress()->set_total_steps(0);
  EXPECT_FALSE(EtaSeconds(job).has_value()) << "total unknown";
  job.mutable_plan()->set_total_steps(30);
  EXPECT_EQ(EtaSeconds(job), 30.0);
}

TEST(EtaSecondsTest, UnknownWithoutAStepTime) {
  EXPECT_FALSE(EtaSeconds(v1::JobStatus()).has_value());
  EXPECT_FALSE(EtaSeconds(Running(1, 500, 1)).has_value());
  EXPECT_FALSE(EtaSeconds(RunningWithStepTime(500, -1)).has_value());
  EXPECT_FALSE(
      EtaSeconds(RunningWithStepTime(500, std::numeric_limits<double>::infinity())).has_value());
  EXPECT_FALSE(
      EtaSeconds(RunningWithStepTime(500, std::numeric_limits<double>::quiet_NaN())).has_value());
}

TEST(EtaSecondsTest, OnlyARunningJobHasOne) {
  for (v1::JobState state : {v1::JOB_STATE_SUCCEEDED, v1::JOB_STATE_FAILED, v1::JOB_STATE_CANCELLED,
                             v1::JOB_STATE_QUEUED}) {
    v1::JobStatus job = RunningWithStepTime(500, 0.5);
    job.set_state(state);
    EXPECT_FALSE(EtaSeconds(job).has_value()) << v1::JobState_Name(state);
  }
}

TEST(WatchPrinterTest, ProgressBarShowsEtaSeconds) {
  v1::JobStatus job = Running(1, 500, 1);
  job.mutable_attempts(0)->mutable_progress()->set_loss(2.5);
  EXPECT_EQ(WatchPrinter::ProgressBar(job),
            "[##########..........] step 500/1000  loss 2.5000  ETA --");
  job.mutable_attempts(0)->mutable_progress()->set_step_seconds(0.13);  // 500 x 0.13 = 65 s
  EXPECT_EQ(WatchPrinter::ProgressBar(job),
            "[##########..........] step 500/1000  loss 2.5000  ETA 1m05s");
}

TEST(WatchPrinterTest, RestartPrintsALineAndTheNewAttemptsEta) {
  std::ostringstream out;
  WatchPrinter printer(out, WatchFormat::kProgressBar);
  v1::JobStatus first = Running(1, 200, 11'000);
  first.mutable_attempts(0)->mutable_progress()->set_step_seconds(0.1);
  printer.Update(first, absl::Now());
  EXPECT_THAT(out.str(), HasSubstr("step 200/1000  ETA 1m20s"));
  // The new attempt has not measured a step time yet.
  printer.Update(Running(2, 150, 20'000), absl::Now());
  printer.Finish();
  EXPECT_THAT(out.str(), HasSubstr("RUNNING step 150/1000 attempt 2\n"));
  EXPECT_THAT(out.str(), HasSubstr("step 150/1000  ETA --\n"));
}

}  // namespace
}  // namespace lathe
