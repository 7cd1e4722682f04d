// The plan of a spec and a strategy (common/plan.h), and the check that a plan can run a
// spec.
#include "common/plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "common/job_spec.h"
#include "tests/testing/default_plan.h"
#include "tests/testing/minimal_spec.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;

// 64 sequences of 1024 tokens a step.
JobSpec Spec() {
  JobSpec spec = testing::MinimalSpec();
  spec.data.seq_len = 1024;
  spec.train.global_batch = 64;
  return spec;
}

TEST(PlanOfTest, TheSpecsResourcesAndTheAccumulationThatMakesUpTheBatch) {
  JobSpec spec = Spec();
  spec.resources.ranks = 2;
  spec.train.precision = Precision::kBf16;
  Strategy strategy;
  strategy.zero_stage = 2;
  strategy.activation_checkpointing = true;
  strategy.micro_batch = 8;
  const Plan plan = PlanOf(spec, strategy);
  EXPECT_EQ(plan.ranks, 2);
  EXPECT_EQ(plan.device, DeviceKind::kCpu);
  EXPECT_EQ(plan.strategy.zero_stage, 2);
  EXPECT_TRUE(plan.strategy.activation_checkpointing);
  EXPECT_TRUE(plan.strategy.fused_kernels);
  EXPECT_TRUE(plan.strategy.chunked_loss);  // the fused linear cross-entropy
  EXPECT_EQ(plan.strategy.micro_batch, 8);
  EXPECT_EQ(plan.gradient_accumulation, 4);  // 32 per rank
  EXPECT_EQ(plan.total_steps, 10);
  EXPECT_EQ(plan.precision, Precision::kBf16);
  EXPECT_TRUE(CheckPlanRunsSpec(spec, plan, "plan").ok());
}

TEST(PlanOfTest, EpochsLeaveTheStepCountToTheTrainer) {
  JobSpec spec = Spec();
  spec.train.steps = 0;
  spec.train.epochs = 3;
  EXPECT_EQ(PlanOf(spec, Strategy()).total_steps, 0);
}

struct BadPlanCase {
  const char* name;
  std::function<void(Plan*)> mutate;
  const char* message;
};

class CheckPlanRunsSpecTest : public ::testing::TestWithParam<BadPlanCase> {};

// Under strategy auto the planner may choose QLoRA for LoRA and 8-bit AdamW for AdamW; the
// spec then runs with them. An explicit strategy gets neither.
TEST(CheckPlanRunsSpecTest, AutoMayChooseQLoraAndEightBitState) {
  JobSpec spec = Spec();
  Plan plan = PlanOf(spec, Strategy());
  plan.method = Method::kQLora;
  plan.optimizer = OptimizerKind::kAdamW8bit;
  EXPECT_TRUE(CheckPlanRunsSpec(spec, plan, "task.json").ok());
  const JobSpec runs = WithPlannedTechniques(spec, plan);
  EXPECT_EQ(runs.method, Method::kQLora);
  EXPECT_EQ(runs.train.optimizer, OptimizerKind::kAdamW8bit);
  EXPECT_EQ(WithPlannedTechniques(spec, PlanOf(spec, Strategy())).method, Method::kLora);
  testing::FixStrategy(&spec.strategy);
  EXPECT_THAT(std::string(CheckPlanRunsSpec(spec, plan, "task.json").message()),
              HasSubstr("plan.method: qlora but the spec's method is lora"));
}

TEST_P(CheckPlanRunsSpecTest, IsInvalidArgumentNamingThePlanField) {
  const JobSpec spec = Spec();
  Plan plan = PlanOf(spec, Strategy());
  GetParam().mutate(&plan);
  const absl::Status status = CheckPlanRunsSpec(spec, plan, "task.json");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CheckPlanRunsSpecTest,
    ::testing::Values(
        BadPlanCase{"Ranks", [](Plan* p) { p->ranks = 2; },
                    "task.json: plan.ranks: 2 but the spec's resources.ranks is 1"},
        BadPlanCase{"Device", [](Plan* p) { p->device = DeviceKind::kCuda; },
                    "plan.device: cuda but the spec's resources.device is cpu"},
        BadPlanCase{"Precision", [](Plan* p) { p->precision = Precision::kFp16; },
                    "plan.precision: fp16"},
        BadPlanCase{"ZeroMicroBatch", [](Plan* p) { p->strategy.micro_batch = 0; },
                    "plan.micro_batch: 0 does not divide train.global_batch 64 over 1 rank"},
        BadPlanCase{"NonDividingMicroBatch", [](Plan* p) { p->strategy.micro_batch = 5; },
                    "plan.micro_batch: 5 does not divide"},
        BadPlanCase{"Accumulation", [](Plan* p) { p->gradient_accumulation = 3; },
                    "plan.gradient_accumulation: 3"},
        BadPlanCase{"TotalSteps", [](Plan* p) { p->total_steps = 11; },
                    "plan.total_steps: 11 but the spec's train.steps is 10"},
        BadPlanCase{"ZeroStage", [](Plan* p) { p->strategy.zero_stage = 4; },
                    "plan.zero_stage: must be"},
        BadPlanCase{"OffloadParams", [](Plan* p) { p->strategy.offload_params = true; },
                    "plan.offload_params: requires zero_stage 3"},
        BadPlanCase{"Method", [](Plan* p) { p->method = Method::kFull; },
                    "plan.method: full but the spec's method is lora"},
        BadPlanCase{"Optimizer", [](Plan* p) { p->optimizer = OptimizerKind::kSgd; },
                    "plan.optimizer: sgd but the spec's train.optimizer is adamw"}),
    [](const ::testing::TestParamInfo<BadPlanCase>& param) { return param.param.name; });

}  // namespace
}  // namespace lathe
