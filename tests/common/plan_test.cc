// The plan a spec gets before the planner exists (common/plan.h), and the check that a plan
// can run a spec.
#include "common/plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "common/job_spec.h"
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

TEST(AutoMicroBatchTest, LargestDivisorWithinTokenBudget) {
  EXPECT_EQ(AutoMicroBatch(64, 1024), 8);
  EXPECT_EQ(AutoMicroBatch(12, 1024), 6);
  EXPECT_EQ(AutoMicroBatch(7, 4096), 1);
  EXPECT_EQ(AutoMicroBatch(4, 32), 4);
  EXPECT_EQ(AutoMicroBatch(1, 100000), 1);
}

TEST(PlanFromSpecTest, AutoStrategyRunsUnshardedWithAnAutoMicroBatch) {
  JobSpec spec = Spec();
  spec.resources.ranks = 2;
  spec.train.precision = Precision::kBf16;
  const Plan plan = PlanFromSpec(spec);
  EXPECT_EQ(plan.ranks, 2);
  EXPECT_EQ(plan.device, DeviceKind::kCpu);
  EXPECT_EQ(plan.zero_stage, 0);
  EXPECT_FALSE(plan.offload_optimizer);
  EXPECT_FALSE(plan.activation_checkpointing);
  EXPECT_TRUE(plan.fused_kernels);
  EXPECT_TRUE(plan.chunked_loss);  // the fused linear cross-entropy
  EXPECT_EQ(plan.micro_batch, 8);  // 32 per rank, 8 x 1024 tokens
  EXPECT_EQ(plan.gradient_accumulation, 4);
  EXPECT_EQ(plan.total_steps, 10);
  EXPECT_EQ(plan.precision, Precision::kBf16);
  EXPECT_THAT(plan.explanation, HasSubstr("micro-batch auto"));
  EXPECT_TRUE(CheckPlanRunsSpec(spec, plan, "plan").ok());
}

TEST(PlanFromSpecTest, ExplicitStrategyAndMicroBatchAreKept) {
  JobSpec spec = Spec();
  spec.train.micro_batch = 2;
  spec.strategy.automatic = false;
  spec.strategy.activation_checkpointing = true;
  spec.strategy.fused_kernels = false;
  spec.strategy.chunked_loss = true;
  const Plan plan = PlanFromSpec(spec);
  EXPECT_EQ(plan.micro_batch, 2);
  EXPECT_EQ(plan.gradient_accumulation, 32);
  EXPECT_TRUE(plan.activation_checkpointing);
  EXPECT_FALSE(plan.fused_kernels);
  EXPECT_TRUE(plan.chunked_loss);
  EXPECT_EQ(plan.explanation, "the spec's explicit strategy");

  spec.strategy.chunked_loss = false;
  EXPECT_FALSE(PlanFromSpec(spec).chunked_loss);
}

TEST(PlanFromSpecTest, EpochsLeaveTheStepCountToTheTrainer) {
  JobSpec spec = Spec();
  spec.train.steps = 0;
  spec.train.epochs = 3;
  EXPECT_EQ(PlanFromSpec(spec).total_steps, 0);
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
  Plan plan = PlanFromSpec(spec);
  plan.method = Method::kQLora;
  plan.optimizer = OptimizerKind::kAdamW8bit;
  EXPECT_TRUE(CheckPlanRunsSpec(spec, plan, "task.json").ok());
  const JobSpec runs = WithPlannedTechniques(spec, plan);
  EXPECT_EQ(runs.method, Method::kQLora);
  EXPECT_EQ(runs.train.optimizer, OptimizerKind::kAdamW8bit);
  EXPECT_EQ(WithPlannedTechniques(spec, PlanFromSpec(spec)).method, Method::kLora);
  spec.strategy.automatic = false;
  EXPECT_THAT(std::string(CheckPlanRunsSpec(spec, plan, "task.json").message()),
              HasSubstr("plan.method: qlora but the spec's method is lora"));
}

TEST_P(CheckPlanRunsSpecTest, IsInvalidArgumentNamingThePlanField) {
  const JobSpec spec = Spec();
  Plan plan = PlanFromSpec(spec);
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
        BadPlanCase{"ZeroMicroBatch", [](Plan* p) { p->micro_batch = 0; },
                    "plan.micro_batch: 0 does not divide train.global_batch 64 over 1 rank"},
        BadPlanCase{"NonDividingMicroBatch", [](Plan* p) { p->micro_batch = 5; },
                    "plan.micro_batch: 5 does not divide"},
        BadPlanCase{"Accumulation", [](Plan* p) { p->gradient_accumulation = 3; },
                    "plan.gradient_accumulation: 3"},
        BadPlanCase{"TotalSteps", [](Plan* p) { p->total_steps = 11; },
                    "plan.total_steps: 11 but the spec's train.steps is 10"},
        BadPlanCase{"ZeroStage", [](Plan* p) { p->zero_stage = 4; }, "plan.zero_stage: must be"},
        BadPlanCase{"OffloadParams", [](Plan* p) { p->offload_params = true; },
                    "plan.offload_params: requires zero_stage 3"},
        BadPlanCase{"Method", [](Plan* p) { p->method = Method::kFull; },
                    "plan.method: full but the spec's method is lora"},
        BadPlanCase{"Optimizer", [](Plan* p) { p->optimizer = OptimizerKind::kSgd; },
                    "plan.optimizer: sgd but the spec's train.optimizer is adamw"}),
    [](const ::testing::TestParamInfo<BadPlanCase>& param) { return param.param.name; });

}  // namespace
}  // namespace lathe
