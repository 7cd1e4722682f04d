// The coordinator's metrics (coordinator/metrics): what the exposition says about a job as
// it runs and ends, the grace period after which its series go, and the RPC histogram.
#include <string>

#include "coordinator/metrics/coordinator_metrics.h"
#include "coordinator/store/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(CoordinatorMetricsTest, AJobsSeriesFollowItAndGoAfterTheGracePeriod) {
  FakeClock clock;
  std::unique_ptr<Store> store = NewMemoryStore();
  std::unique_ptr<Scheduler> scheduler = *Scheduler::Create(store.get(), &clock, {});
  auto metrics = std::make_unique<CoordinatorMetrics>(scheduler.get());

  v1::RegisterWorkerRequest worker;
  worker.set_worker_id("w1");
  worker.set_slots(2);
  ASSERT_TRUE(scheduler->RegisterWorker(worker).ok());
  v1::JobStatus job;
  job.set_job_id("job-1");
  job.mutable_spec()->set_name("tune");
  job.mutable_plan()->set_ranks(1);
  job.mutable_plan()->mutable_predicted_memory()->set_optimizer(1000);
  job.mutable_plan()->mutable_predicted_memory()->set_total(5000);
  bool existing = false;
  ASSERT_TRUE(scheduler->AddJob(job, "", &existing).ok());
  scheduler->Settle();

  v1::ReportProgressRequest report;
  report.set_worker_id("w1");
  report.set_job_id("job-1");
  report.set_generation(1);
  report.set_event(v1::RANK_EVENT_PROGRESS);
  v1::Progress* progress = report.mutable_progress();
  progress->set_step(7);
  progress->set_total_steps(10);
  progress->set_loss(2.5);
  progress->set_tokens_per_second(1234.5);
  progress->set_mfu(0.25);
  progress->mutable_memory()->set_activations(4096);
  progress->mutable_memory()->set_total(8192);
  ASSERT_TRUE(scheduler->ReportProgress(report).ok());
  metrics->ObserveRpc("SubmitJob", grpc::StatusCode::OK, absl::Milliseconds(3));

  std::string text = metrics->Text();
  EXPECT_THAT(text, HasSubstr("lathe_jobs{state=\"running\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("lathe_jobs{state=\"queued\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("lathe_workers{state=\"ready\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("lathe_free_slots{device=\"cpu\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("lathe_attempts_started_total 1\n"));
  EXPECT_THAT(text, HasSubstr("lathe_job_step{job_id=\"job-1\"} 7\n"));
  EXPECT_THAT(text, HasSubstr("lathe_job_loss{job_id=\"job-1\"} 2.5\n"));
  EXPECT_THAT(text, HasSubstr("lathe_job_tokens_per_second{job_id=\"job-1\"} 1234.5\n"));
  EXPECT_THAT(text, HasSubstr("lathe_job_mfu_ratio{job_id=\"job-1\"} 0.25\n"));
  EXPECT_THAT(text, HasSubstr("lathe_job_memory_peak_bytes{component=\"activations\","
                              "job_id=\"job-1\"} 4096\n"));
  EXPECT_THAT(text, HasSubstr("lathe_job_memory_predicted_bytes{component=\"optimizer\","
                              "job_id=\"job-1\"} 1000\n"));
  EXPECT_THAT(text, HasSubstr("lathe_job_info{attempt=\"1\",job_id=\"job-1\",name=\"tune\","
                              "state=\"running\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("lathe_rpc_duration_seconds_count{code=\"OK\","
                              "method=\"SubmitJob\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("lathe_scheduling_pass_duration_seconds_count 1\n"));

  report.set_event(v1::RANK_EVENT_SUCCEEDED);
  ASSERT_TRUE(scheduler->ReportProgress(report).ok());
  text = metrics->Text();
  EXPECT_THAT(text, HasSubstr("lathe_jobs{state=\"succeeded\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("lathe_attempts_ended_total{failure=\"none\",result=\"succeeded\"} "
                              "1\n"));
  EXPECT_THAT(text, HasSubstr("lathe_job_step{job_id=\"job-1\"} 7\n")) << "shown after its end";

  clock.Advance(kEndedJobGrace + absl::Seconds(1));
  text = metrics->Text();
  EXPECT_THAT(text, Not(HasSubstr("job_id=\"job-1\""))) << "still shown after the grace period";
  EXPECT_THAT(text, HasSubstr("lathe_jobs{state=\"succeeded\"} 1\n"));
}

}  // namespace
}  // namespace lathe
