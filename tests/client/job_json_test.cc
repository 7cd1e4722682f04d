// Unit tests of the JSON objects of `lathe --output json` (client/job_json.h): values, enum
// words, nulls. The exact key sets and types of what the CLI prints are pinned in
// cli_test.cc (JsonSchema tests).
#include "client/job_json.h"

#include <limits>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "client/status_text.h"
#include "common/job_spec.h"
#include "common/proto/job_spec_proto.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lathe {
namespace {

using Json = nlohmann::ordered_json;
using ::testing::StartsWith;

constexpr char kSpec[] = R"(name: demo-lora
model: {path: /models/tiny}
data: {train: /data/train.jsonl}
train: {steps: 100, global_batch: 4, precision: bf16}
resources: {ranks: 2, device: cuda}
output: /runs/demo
)";

v1::JobStatus RunningJob() {
  absl::StatusOr<JobSpec> spec = ParseJobSpec(kSpec, "test");
  EXPECT_TRUE(spec.ok()) << spec.status();
  v1::JobStatus job;
  job.set_job_id("job-7");
  if (spec.ok()) *job.mutable_spec() = JobSpecToProto(*spec);
  job.set_state(v1::JOB_STATE_RUNNING);
  job.set_submitted_unix_ms(1'700'000'000'000);
  job.set_updated_unix_ms(1'700'000'060'000);
  v1::Plan* plan = job.mutable_plan();
  plan->set_ranks(2);
  plan->set_device(v1::DEVICE_CUDA);
  plan->mutable_strategy()->set_zero_stage(3);
  plan->set_total_steps(100);
  plan->set_precision(v1::PRECISION_BF16);
  plan->mutable_predicted_memory()->set_total(80ull << 30);
  v1::Attempt* attempt = job.add_attempts();
  attempt->set_generation(1);
  attempt->set_state(v1::ATTEMPT_STATE_RUNNING);
  v1::Progress* p = attempt->mutable_progress();
  p->set_step(40);
  p->set_total_steps(100);
  p->set_loss(2.5);
  p->set_step_seconds(0.5);
  p->set_updated_unix_ms(1'700'000'060'000);
  return job;
}

TEST(JobJsonTest, Values) {
  const v1::JobStatus job = RunningJob();
  const Json json = JobJson(job);
  EXPECT_EQ(json["job_id"], "job-7");
  EXPECT_EQ(json["name"], "demo-lora");
  EXPECT_EQ(json["state"], "running");
  EXPECT_EQ(json["submitted_unix_ms"], 1'700'000'000'000);
  EXPECT_EQ(json["plan"]["device"], "cuda");
  EXPECT_EQ(json["plan"]["precision"], "bf16");
  EXPECT_EQ(json["plan"]["zero_stage"], 3);
  EXPECT_EQ(json["plan"]["predicted_memory"]["total"], 80ull << 30);
  EXPECT_EQ(json["attempts"][0]["state"], "running");
  EXPECT_EQ(json["progress"], json["attempts"][0]["progress"]);
  EXPECT_EQ(json["progress"]["step"], 40);
  EXPECT_EQ(json["progress"]["loss"], 2.5);
  EXPECT_TRUE(json["progress"]["eval_loss"].is_null());
  EXPECT_TRUE(json["final_loss"].is_null());
  // The spec in its own schema, defaults filled in.
  EXPECT_EQ(json["spec"], Json::parse(JobSpecToJson(*JobSpecFromProto(job.spec(), "spec"))));
  EXPECT_EQ(json["spec"]["train"]["precision"], "bf16");
  EXPECT_EQ(json["spec"]["lora"]["rank"], 16);
}

TEST(JobJsonTest, EtaSecondsIsTheCliEta) {
  v1::JobStatus job = RunningJob();
  EXPECT_EQ(JobJson(job)["eta_seconds"], 30.0);  // 60 steps left, 0.5 s each
  EXPECT_EQ(JobJson(job)["eta_seconds"], *EtaSeconds(job));

  job.mutable_attempts(0)->mutable_progress()->set_step_seconds(0);
  EXPECT_TRUE(JobJson(job)["eta_seconds"].is_null()) << "no step time yet";

  job = RunningJob();
  job.set_state(v1::JOB_STATE_SUCCEEDED);
  job.set_final_loss(1.25);
  EXPECT_TRUE(JobJson(job)["eta_seconds"].is_null()) << "finished";
  EXPECT_EQ(JobJson(job)["final_loss"], 1.25);
}

TEST(JobJsonTest, NoProgressBeforeTheFirstReport) {
  v1::JobStatus job = RunningJob();
  job.mutable_attempts(0)->clear_progress();
  const Json json = JobJson(job);
  EXPECT_TRUE(json["progress"].is_null());
  // The attempt still has its progress object, all zero.
  EXPECT_EQ(json["attempts"][0]["progress"]["step"], 0);
  EXPECT_TRUE(json["attempts"][0]["progress"]["loss"].is_null());
}

TEST(JobJsonTest, ASpecThatDoesNotConvertIsNull) {
  v1::JobStatus job = RunningJob();
  job.mutable_spec()->mutable_train()->set_lr(-1);
  const Json json = JobJson(job);
  EXPECT_TRUE(json["spec"].is_null());
  EXPECT_EQ(json["name"], "demo-lora");  // still from the proto
}

TEST(JobJsonTest, EnumWords) {
  v1::JobStatus job;
  const std::pair<v1::JobState, const char*> states[] = {
      {v1::JOB_STATE_QUEUED, "queued"},       {v1::JOB_STATE_RUNNING, "running"},
      {v1::JOB_STATE_SUCCEEDED, "succeeded"}, {v1::JOB_STATE_FAILED, "failed"},
      {v1::JOB_STATE_CANCELLED, "cancelled"}, {v1::JOB_STATE_UNSPECIFIED, "unknown"}};
  for (const auto& [state, word] : states) {
    job.set_state(state);
    EXPECT_EQ(JobJson(job)["state"], word);
  }
  const std::pair<v1::AttemptState, const char*> attempt_states[] = {
      {v1::ATTEMPT_STATE_STARTING, "starting"},   {v1::ATTEMPT_STATE_RUNNING, "running"},
      {v1::ATTEMPT_STATE_SUCCEEDED, "succeeded"}, {v1::ATTEMPT_STATE_FAILED, "failed"},
      {v1::ATTEMPT_STATE_CANCELLED, "cancelled"}, {v1::ATTEMPT_STATE_UNSPECIFIED, "unknown"}};
  for (const auto& [state, word] : attempt_states) {
    job.clear_attempts();
    job.add_attempts()->set_state(state);
    EXPECT_EQ(JobJson(job)["attempts"][0]["state"], word);
  }
  // UNSPECIFIED device and precision are their documented defaults.
  EXPECT_EQ(JobJson(job)["plan"]["device"], "cpu");
  EXPECT_EQ(JobJson(job)["plan"]["precision"], "fp32");
  job.mutable_plan()->set_precision(v1::PRECISION_FP16);
  EXPECT_EQ(JobJson(job)["plan"]["precision"], "fp16");

  v1::WorkerStatus worker;
  EXPECT_EQ(WorkerJson(worker)["state"], "unknown");
  worker.set_state(v1::WORKER_STATE_READY);
  EXPECT_EQ(WorkerJson(worker)["state"], "ready");
  worker.set_state(v1::WORKER_STATE_LOST);
  EXPECT_EQ(WorkerJson(worker)["state"], "lost");
  worker.set_device(v1::DEVICE_CPU);
  EXPECT_EQ(WorkerJson(worker)["device"], "cpu");
}

TEST(JobJsonTest, EnumValuesFromANewerCoordinatorAreUnknown) {
  v1::JobStatus job;
  job.set_state(static_cast<v1::JobState>(42));
  job.add_attempts()->set_state(static_cast<v1::AttemptState>(17));
  job.mutable_plan()->set_device(static_cast<v1::Device>(9));
  job.mutable_plan()->set_precision(static_cast<v1::Precision>(8));
  const Json json = JobJson(job);
  EXPECT_EQ(json["state"], "unknown");
  EXPECT_EQ(json["attempts"][0]["state"], "unknown");
  EXPECT_EQ(json["plan"]["device"], "unknown");
  EXPECT_EQ(json["plan"]["precision"], "unknown");

  v1::WorkerStatus worker;
  worker.set_state(static_cast<v1::WorkerState>(9));
  worker.set_device(static_cast<v1::Device>(3));
  EXPECT_EQ(WorkerJson(worker)["state"], "unknown");
  EXPECT_EQ(WorkerJson(worker)["device"], "unknown");
}

TEST(JobJsonTest, NonFiniteNumbersAreNull) {
  v1::Progress p;
  p.set_loss(std::numeric_limits<double>::quiet_NaN());
  p.set_grad_norm(std::numeric_limits<double>::infinity());
  p.set_lr(1e-4);
  const Json json = ProgressJson(p);
  EXPECT_TRUE(json["loss"].is_null());
  EXPECT_TRUE(json["grad_norm"].is_null());
  EXPECT_EQ(json["lr"], 1e-4);
  EXPECT_EQ(JsonLine(json).find("NaN"), std::string::npos);
}

TEST(JobJsonTest, JsonLineIsOneLineInSchemaOrder) {
  v1::JobStatus job;
  job.set_job_id("job-1");
  job.set_reason("line one\nline two");
  const std::string line = JsonLine(JobJson(job));
  EXPECT_THAT(line, StartsWith(R"({"job_id":"job-1","name":"","state":"unknown","reason":)"));
  EXPECT_EQ(line.find('\n'), std::string::npos);
}

TEST(JobJsonTest, JsonLineReplacesInvalidUtf8) {
  v1::JobStatus job;
  job.add_attempts()->set_error("log: \xff\xfe end");
  const std::string line = JsonLine(JobJson(job));
  EXPECT_EQ(Json::parse(line)["attempts"][0]["error"], "log: \xEF\xBF\xBD\xEF\xBF\xBD end");
}

}  // namespace
}  // namespace lathe
