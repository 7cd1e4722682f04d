// The coordinator's metrics (coordinator/metrics): what the exposition says about a job as
// it runs and ends, the grace period after which its series go, the RPC histogram, the job's
// step and token counters across a restart that resumes from a checkpoint and across a
// coordinator restart, and lathe_build_info.
#include <string>

#include "coordinator/metrics/coordinator_metrics.h"
#include "coordinator/store/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lathe {
namespace {

using ::testing::ContainsRegex;
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
  progress->mutable_phases()->set_forward(0.5);  // 617.25 tokens in the step
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
  EXPECT_THAT(text, HasSubstr("lathe_job_steps_total{job_id=\"job-1\"} 7\n"));
  EXPECT_THAT(text, HasSubstr("lathe_job_tokens_total{job_id=\"job-1\"} 4320.75\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE lathe_job_tokens_total counter\n"));
  EXPECT_THAT(text, Not(HasSubstr("lathe_job_tokens_per_second")));
  EXPECT_THAT(text, Not(HasSubstr("lathe_job_step_seconds")));
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

// The value of the sample `series` (name and labels) in `text`; -1 when absent.
double Sample(const std::string& text, const std::string& series) {
  const std::string head = series + " ";
  size_t at = text.find("\n" + head);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + 1 + head.size()));
}

class JobCountersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = NewMemoryStore();
    Start();
    v1::JobStatus job;
    job.set_job_id("job");
    job.mutable_spec()->set_max_restarts(3);
    job.mutable_plan()->set_ranks(1);
    bool existing = false;
    ASSERT_TRUE(scheduler_->AddJob(job, "", &existing).ok());
    scheduler_->Settle();
  }
  // A new scheduler on the store (a coordinator restart), its worker and its metrics.
  void Start() {
    metrics_.reset();
    scheduler_.reset();
    scheduler_ = *Scheduler::Create(store_.get(), &clock_, {});
    v1::RegisterWorkerRequest worker;
    worker.set_worker_id("w1");
    worker.set_slots(1);
    ASSERT_TRUE(scheduler_->RegisterWorker(worker).ok());
    metrics_ = std::make_unique<CoordinatorMetrics>(scheduler_.get());
  }
  // Rank 0 of `generation` reports `step`: 100 tokens/s over a 2 s step, 200 tokens.
  void Train(int64_t generation, int64_t step, int64_t resumed = 0) {
    v1::ReportProgressRequest report;
    report.set_worker_id("w1");
    report.set_job_id("job");
    report.set_generation(generation);
    report.set_event(v1::RANK_EVENT_PROGRESS);
    report.set_resumed_from_step(resumed);
    report.mutable_progress()->set_step(step);
    report.mutable_progress()->set_tokens_per_second(100);
    report.mutable_progress()->mutable_phases()->set_forward(1.5);
    report.mutable_progress()->mutable_phases()->set_backward(0.5);
    ASSERT_TRUE(scheduler_->ReportProgress(report).ok());
    scheduler_->Settle();
  }
  double Steps() { return Sample(metrics_->Text(), "lathe_job_steps_total{job_id=\"job\"}"); }
  v1::JobStatus Job() { return *scheduler_->GetJob("job"); }
  double Tokens() { return Sample(metrics_->Text(), "lathe_job_tokens_total{job_id=\"job\"}"); }

  FakeClock clock_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<CoordinatorMetrics> metrics_;
};

TEST_F(JobCountersTest, CountStepsOfProgressOnceAcrossARestartThatResumes) {
  EXPECT_EQ(Steps(), 0);
  EXPECT_EQ(Tokens(), 0);
  Train(1, 3);
  EXPECT_EQ(Steps(), 3);
  EXPECT_EQ(Tokens(), 600);
  // Reports between scrapes (or coalesced by the agent): every step counted all the same.
  Train(1, 5);
  Train(1, 10);
  EXPECT_EQ(Steps(), 10);
  EXPECT_EQ(Tokens(), 2000);
  // The attempt dies; the restart resumes from the checkpoint of step 6 and redoes 7 to 10:
  // the counters stand still, then count the steps past 10 only.
  v1::ReportProgressRequest failed;
  failed.set_worker_id("w1");
  failed.set_job_id("job");
  failed.set_generation(1);
  failed.set_event(v1::RANK_EVENT_FAILED);
  failed.set_failure(v1::FAILURE_KIND_INFRASTRUCTURE);
  ASSERT_TRUE(scheduler_->ReportProgress(failed).ok());
  scheduler_->Settle();
  ASSERT_EQ(Job().attempts_size(), 2) << Job().reason();
  EXPECT_EQ(Steps(), 10);
  Train(2, 7, 6);
  EXPECT_EQ(Steps(), 10);
  EXPECT_EQ(Tokens(), 2000);
  Train(2, 12, 6);
  EXPECT_EQ(Steps(), 12);
  EXPECT_EQ(Tokens(), 2400);

  // A coordinator restart: the new process's counters start at 0 (a reset, which rate()
  // takes as one) and count on from the job's step, not from 0 again.
  Start();
  EXPECT_EQ(Steps(), 0);
  Train(2, 13, 6);
  EXPECT_EQ(Steps(), 1);
  EXPECT_EQ(Tokens(), 200);
}

TEST_F(JobCountersTest, ACounterNeverGoesBackwards) {
  double steps = 0;
  double tokens = 0;
  for (int64_t step : {1, 4, 2, 9, 9, 3, 11}) {  // out of order, repeated
    Train(1, step);
    EXPECT_GE(Steps(), steps) << "at step " << step;
    EXPECT_GE(Tokens(), tokens) << "at step " << step;
    steps = Steps();
    tokens = Tokens();
  }
  EXPECT_EQ(steps, 11);
}

TEST(CoordinatorMetricsTest, BuildInfo) {
  FakeClock clock;
  std::unique_ptr<Store> store = NewMemoryStore();
  std::unique_ptr<Scheduler> scheduler = *Scheduler::Create(store.get(), &clock, {});
  const std::string text = CoordinatorMetrics(scheduler.get()).Text();
  EXPECT_THAT(text, HasSubstr("# TYPE lathe_build_info gauge\n"));
  EXPECT_THAT(text, ContainsRegex("lathe_build_info\\{build_type=\"[^\"]+\",daemon=\"coordinator\","
                                  "git_commit=\"([0-9a-f]+|unknown)\",version=\"[^\"]+\"\\} 1\n"));
}

}  // namespace
}  // namespace lathe
