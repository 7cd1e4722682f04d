// The agent's metrics (worker/agent/agent_metrics.h): a rank's figures from its trainer's
// events, the step time histogram, memory by component, the grace period, the worker's own,
// lathe_build_info.
#include "worker/agent/agent_metrics.h"

#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace lathe {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(AgentMetricsTest, ARanksFiguresFollowItsEventsAndGoAfterTheGracePeriod) {
  FakeClock clock;
  v1::DeviceInfo gpu;
  gpu.set_index(0);
  gpu.set_memory_bytes(80);
  AgentMetrics metrics("w1", 2, {gpu}, &clock, [] {
    return std::vector<std::optional<uint64_t>>{std::nullopt, 30};
  });
  v1::Assignment assignment;
  assignment.set_job_id("job-1");
  assignment.set_generation(2);
  assignment.set_rank(1);
  assignment.set_slot(0);
  auto text = [&] { return prometheus::TextSerializer().Serialize(metrics.Collect()); };

  RankReport step;
  step.kind = v1::RANK_EVENT_PROGRESS;
  for (int i = 1; i <= 3; ++i) {
    step.progress.set_step(i);
    step.progress.set_loss(3.0 - i);
    step.progress.set_tokens_per_second(100 * i);
    step.progress.mutable_phases()->set_forward(0.02 * i);  // steps of 0.02, 0.04, 0.06 s
    step.progress.mutable_memory()->set_optimizer(1000 * i);
    step.progress.mutable_memory()->set_total(2000 * i);
    metrics.Record(assignment, step);
  }
  std::string t = text();
  EXPECT_THAT(t, HasSubstr("lathe_rank_step{job_id=\"job-1\",rank=\"1\",worker_id=\"w1\"} 3\n"));
  EXPECT_THAT(t, HasSubstr("lathe_rank_loss{job_id=\"job-1\",rank=\"1\",worker_id=\"w1\"} 0\n"));
  EXPECT_THAT(t, HasSubstr("lathe_rank_tokens_per_second{job_id=\"job-1\",rank=\"1\","
                           "worker_id=\"w1\"} 300\n"));
  EXPECT_THAT(t, HasSubstr("lathe_rank_step_duration_seconds_count{job_id=\"job-1\",rank=\"1\","
                           "worker_id=\"w1\"} 3\n"));
  EXPECT_THAT(t, HasSubstr("lathe_rank_step_duration_seconds_bucket{job_id=\"job-1\",rank=\"1\","
                           "worker_id=\"w1\",le=\"0.025\"} 1\n"));
  EXPECT_THAT(t, HasSubstr("lathe_rank_step_duration_seconds_bucket{job_id=\"job-1\",rank=\"1\","
                           "worker_id=\"w1\",le=\"0.05\"} 2\n"));
  EXPECT_THAT(t, HasSubstr("lathe_rank_memory_peak_bytes{job_id=\"job-1\",rank=\"1\","
                           "worker_id=\"w1\",component=\"optimizer\"} 3000\n"));
  EXPECT_THAT(t, HasSubstr("lathe_worker_busy_slots{worker_id=\"w1\"} 1\n"));
  EXPECT_THAT(t, HasSubstr("lathe_worker_slots{worker_id=\"w1\"} 2\n"));
  EXPECT_THAT(t, HasSubstr("lathe_worker_device_memory_bytes{kind=\"total\",slot=\"0\","
                           "worker_id=\"w1\"} 80\n"));
  EXPECT_THAT(t, HasSubstr("lathe_worker_device_memory_bytes{kind=\"used\",slot=\"1\","
                           "worker_id=\"w1\"} 30\n"));
  EXPECT_THAT(t, Not(HasSubstr("kind=\"used\",slot=\"0\"")));
  EXPECT_THAT(t, HasSubstr("lathe_worker_host_memory_bytes{kind=\"total\",worker_id=\"w1\"}"));
  EXPECT_THAT(t, ContainsRegex("lathe_build_info\\{build_type=\"[^\"]+\",daemon=\"agent\","
                               "git_commit=\"([0-9a-f]+|unknown)\",version=\"[^\"]+\"\\} 1\n"));
  // A repeated step (the agent may see one twice) is not a second sample.
  metrics.Record(assignment, step);
  EXPECT_THAT(text(), HasSubstr("lathe_rank_step_duration_seconds_count{job_id=\"job-1\","
                                "rank=\"1\",worker_id=\"w1\"} 3\n"));

  RankReport done;
  done.kind = v1::RANK_EVENT_SUCCEEDED;
  done.progress = step.progress;
  metrics.Record(assignment, done);
  t = text();
  EXPECT_THAT(t, HasSubstr("lathe_worker_busy_slots{worker_id=\"w1\"} 0\n"));
  EXPECT_THAT(t, HasSubstr("ended=\"true\",job_id=\"job-1\""));
  clock.Advance(AgentMetrics::kEndedRankGrace + absl::Seconds(1));
  EXPECT_THAT(text(), Not(HasSubstr("job_id=\"job-1\"")));
}

}  // namespace
}  // namespace lathe
