// The strategy's two forms and its one validator (common/strategy.h).
#include "common/strategy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "absl/status/status.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;

TEST(StrategyTest, ADecidedStrategyStartsAtTheEnginesDefaultsAndASpecEmpty) {
  const Strategy decided;
  EXPECT_EQ(decided.zero_stage, 0);
  EXPECT_FALSE(decided.offload_optimizer);
  EXPECT_FALSE(decided.offload_params);
  EXPECT_FALSE(decided.activation_checkpointing);
  EXPECT_TRUE(decided.chunked_loss);
  EXPECT_TRUE(decided.fused_kernels);
  EXPECT_EQ(decided.micro_batch, 1);
  const StrategySpec spec;
  EXPECT_FALSE(spec.zero_stage || spec.offload_optimizer || spec.offload_params ||
               spec.activation_checkpointing || spec.chunked_loss || spec.micro_batch);
  EXPECT_TRUE(spec.fused_kernels);
  EXPECT_TRUE(IsAutomatic(spec));
}

TEST(StrategyTest, AutomaticMeansEveryFieldButTheMicroBatchLeftToThePlanner) {
  StrategySpec spec;
  spec.micro_batch = 4;
  spec.fused_kernels = false;
  EXPECT_TRUE(IsAutomatic(spec));
  spec.activation_checkpointing = false;
  EXPECT_FALSE(IsAutomatic(spec));
}

TEST(StrategyTest, FixedOnlyWhenEveryFieldIsGiven) {
  StrategySpec spec = AsSpec(Strategy());
  ASSERT_TRUE(FixedStrategy(spec).has_value());
  spec.chunked_loss = false;  // with fused kernels the loss is chunked all the same
  EXPECT_TRUE(FixedStrategy(spec)->chunked_loss);
  spec.fused_kernels = false;
  EXPECT_FALSE(FixedStrategy(spec)->chunked_loss);
  spec.micro_batch.reset();
  EXPECT_FALSE(FixedStrategy(spec).has_value());
}

struct RuleCase {
  const char* name;
  std::function<void(StrategySpec*, StrategyContext*)> mutate;
  absl::StatusCode code;
  const char* message;
};

class ValidateStrategyTest : public ::testing::TestWithParam<RuleCase> {};

TEST_P(ValidateStrategyTest, StatesEachRuleOnce) {
  StrategySpec spec;
  StrategyContext context;
  context.ranks = 2;
  context.global_batch = 8;
  GetParam().mutate(&spec, &context);
  const absl::Status status = ValidateStrategy(spec, context);
  EXPECT_EQ(status.code(), GetParam().code) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Rules, ValidateStrategyTest,
    ::testing::Values(
        RuleCase{"EmptyFieldsPass", [](StrategySpec*, StrategyContext*) {}, absl::StatusCode::kOk,
                 ""},
        RuleCase{"ShardedMezoWithinTheDefaultLimits",
                 [](StrategySpec* s, StrategyContext* c) {
                   c->zeroth_order = true;
                   s->zero_stage = 1;
                 },
                 absl::StatusCode::kOk, ""},
        RuleCase{"StageAboveThree", [](StrategySpec* s, StrategyContext*) { s->zero_stage = 4; },
                 absl::StatusCode::kInvalidArgument,
                 "strategy.zero_stage: must be 0, 1, 2 or 3, got 4"},
        RuleCase{"NegativeStage", [](StrategySpec* s, StrategyContext*) { s->zero_stage = -1; },
                 absl::StatusCode::kInvalidArgument, "got -1"},
        RuleCase{"OffloadParamsBelowStageThree",
                 [](StrategySpec* s, StrategyContext*) {
                   s->zero_stage = 2;
                   s->offload_params = true;
                 },
                 absl::StatusCode::kInvalidArgument,
                 "strategy.offload_params: requires zero_stage 3, got zero_stage 2"},
        RuleCase{"OffloadParamsWithTheStageLeftToThePlanner",
                 [](StrategySpec* s, StrategyContext*) { s->offload_params = true; },
                 absl::StatusCode::kOk, ""},
        RuleCase{"MicroBatchNotDividingThePerRankBatch",
                 [](StrategySpec* s, StrategyContext*) { s->micro_batch = 3; },
                 absl::StatusCode::kInvalidArgument,
                 "train.micro_batch: 3 does not divide train.global_batch 8 over 2 ranks"},
        RuleCase{"MicroBatchAboveThePerRankBatch",
                 [](StrategySpec* s, StrategyContext*) { s->micro_batch = 8; },
                 absl::StatusCode::kInvalidArgument, "8 does not divide"},
        RuleCase{"MicroBatchZero", [](StrategySpec* s, StrategyContext*) { s->micro_batch = 0; },
                 absl::StatusCode::kInvalidArgument, "0 does not divide"},
        RuleCase{"PrefixAndMicroBatchField",
                 [](StrategySpec* s, StrategyContext* c) {
                   c->prefix = "plan";
                   c->micro_batch_field = "plan.micro_batch";
                   s->micro_batch = 3;
                 },
                 absl::StatusCode::kInvalidArgument, "plan.micro_batch: 3 does not divide"},
        RuleCase{"StageBeyondTheEngine",
                 [](StrategySpec* s, StrategyContext* c) {
                   c->limits.max_zero_stage = 2;
                   s->zero_stage = 3;
                 },
                 absl::StatusCode::kUnimplemented,
                 "strategy.zero_stage: 3 is not supported by this engine yet (supported: 0 to 2)"},
        RuleCase{"OffloadBeyondTheEngine",
                 [](StrategySpec* s, StrategyContext* c) {
                   c->limits.offload = false;
                   s->offload_optimizer = true;
                 },
                 absl::StatusCode::kUnimplemented,
                 "strategy.offload_optimizer: true is not supported by this engine yet"},
        RuleCase{"ShardedMezo",
                 [](StrategySpec* s, StrategyContext* c) {
                   c->zeroth_order = true;
                   c->limits.sharded_zeroth_order = false;
                   s->zero_stage = 1;
                 },
                 absl::StatusCode::kUnimplemented,
                 "strategy.zero_stage: 1 with method mezo is not supported"},
        RuleCase{"OffloadedMezo",
                 [](StrategySpec* s, StrategyContext* c) {
                   c->zeroth_order = true;
                   c->limits.sharded_zeroth_order = false;
                   s->offload_optimizer = true;
                 },
                 absl::StatusCode::kUnimplemented, "strategy.zero_stage: 0 with offload"}),
    [](const ::testing::TestParamInfo<RuleCase>& param) { return param.param.name; });

TEST(ValidateStrategyTest, ADecidedStrategyObeysTheSameRules) {
  Strategy s;
  s.offload_params = true;
  EXPECT_THAT(std::string(ValidateStrategy(s, StrategyContext()).message()),
              HasSubstr("requires zero_stage 3, got zero_stage 0"));
  s.zero_stage = 3;
  EXPECT_TRUE(ValidateStrategy(s, StrategyContext()).ok());
}

}  // namespace
}  // namespace lathe
