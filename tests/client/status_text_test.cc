// Unit tests of the CLI's text renderings that need no coordinator.
#include "client/status_text.h"

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

TEST(WatchPrinterTest, ProgressBar) {
  v1::JobStatus job = Running(1, 500, 1);
  job.mutable_attempts(0)->mutable_progress()->set_loss(2.5);
  EXPECT_EQ(WatchPrinter::ProgressBar(job, absl::Seconds(65)),
            "[##########..........] step 500/1000  loss 2.5000  ETA 1m05s");
  EXPECT_EQ(WatchPrinter::ProgressBar(job, std::nullopt),
            "[##########..........] step 500/1000  loss 2.5000  ETA --");
}

TEST(WatchPrinterTest, RestartPrintsALineAndResetsTheRate) {
  std::ostringstream out;
  WatchPrinter printer(out, WatchFormat::kProgressBar);
  printer.Update(Running(1, 100, 1'000), absl::Now());
  printer.Update(Running(1, 200, 11'000), absl::Now());
  EXPECT_THAT(out.str(), HasSubstr("step 200/1000  ETA 1m20s"));
  printer.Update(Running(2, 150, 20'000), absl::Now());
  printer.Finish();
  EXPECT_THAT(out.str(), HasSubstr("RUNNING step 150/1000 attempt 2\n"));
  EXPECT_THAT(out.str(), HasSubstr("step 150/1000  ETA --\n"));
}

}  // namespace
}  // namespace lathe
