// The engine's one capability list (common/capabilities.h).
#include "common/capabilities.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "common/job_spec.h"
#include "common/model_config.h"
#include "tests/testing/default_plan.h"
#include "tests/testing/minimal_spec.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;

JobSpec Spec() { return testing::MinimalSpec(); }

TEST(CapabilitiesTest, WhatTheEngineRunsPasses) {
  for (Method method : {Method::kLora, Method::kFull}) {
    for (Precision precision : {Precision::kFp32, Precision::kBf16, Precision::kFp16}) {
      JobSpec spec = Spec();
      spec.method = method;
      spec.train.precision = precision;
      EXPECT_TRUE(CheckEngineSupports(spec).ok());
    }
  }
  JobSpec spec = Spec();
  spec.resources.ranks = 4;
  testing::FixStrategy(&spec.strategy);
  spec.strategy.activation_checkpointing = true;
  spec.strategy.chunked_loss = true;
  EXPECT_TRUE(CheckEngineSupports(spec).ok());
  for (int64_t stage : {1, 2, 3}) {  // ZeRO and offload on the CPU, with every optimizer
    spec.strategy.zero_stage = stage;
    spec.strategy.offload_optimizer = true;
    spec.strategy.offload_params = stage == 3;
    for (OptimizerKind optimizer : {OptimizerKind::kAdamW, OptimizerKind::kAdamW8bit,
                                    OptimizerKind::kAdafactor, OptimizerKind::kSgd}) {
      spec.train.optimizer = optimizer;
      spec.train.paged_optimizer = optimizer == OptimizerKind::kAdamW8bit;
      EXPECT_TRUE(CheckEngineSupports(spec).ok()) << stage << " " << OptimizerKindName(optimizer);
    }
  }
  spec.train.optimizer = OptimizerKind::kAdamW;
  spec.train.paged_optimizer = false;
  spec.strategy.zero_stage = 0;
  spec.strategy.offload_optimizer = spec.strategy.offload_params = false;
  spec.resources.device = DeviceKind::kCuda;
  spec.resources.ranks = 1;
  EXPECT_TRUE(CheckEngineSupports(spec).ok());
  // Issue #29: several CUDA ranks (NCCL) and ZeRO with offload on CUDA.
  spec.resources.ranks = 8;
  spec.train.global_batch = 8;
  for (int64_t stage : {0, 1, 2, 3}) {
    spec.strategy.zero_stage = stage;
    spec.strategy.offload_optimizer = stage > 0;
    spec.strategy.offload_params = stage == 3;
    EXPECT_TRUE(CheckEngineSupports(spec).ok()) << stage;
  }
}

struct UnsupportedCase {
  const char* name;
  std::function<void(JobSpec*)> mutate;
  const char* message;
};

class UnsupportedTest : public ::testing::TestWithParam<UnsupportedCase> {};

TEST_P(UnsupportedTest, IsUnimplementedNamingTheField) {
  JobSpec spec = Spec();
  GetParam().mutate(&spec);
  const absl::Status status = CheckEngineSupports(spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(status.message()), HasSubstr(GetParam().message));
  EXPECT_EQ(std::string(status.message()).find('\n'), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, UnsupportedTest,
    ::testing::Values(
        UnsupportedCase{"ShardedMezo",
                        [](JobSpec* s) {
                          s->method = Method::kMezo;
                          testing::FixStrategy(&s->strategy);
                          s->strategy.zero_stage = 3;
                        },
                        "strategy.zero_stage: 3 with method mezo is not supported by this engine "
                        "yet"},
        UnsupportedCase{"ShardedMezoOnCuda",
                        [](JobSpec* s) {
                          s->method = Method::kMezo;
                          s->resources.device = DeviceKind::kCuda;
                          testing::FixStrategy(&s->strategy);
                          s->strategy.zero_stage = 2;
                        },
                        "strategy.zero_stage: 2 with method mezo is not supported"}),
    [](const ::testing::TestParamInfo<UnsupportedCase>& param) { return param.param.name; });

TEST(CapabilitiesTest, ModelTypesComeFromTheList) {
  EXPECT_TRUE(IsSupportedModelType("llama"));
  EXPECT_TRUE(IsSupportedModelType("qwen2"));
  EXPECT_TRUE(IsSupportedModelType("qwen3"));
  EXPECT_TRUE(IsSupportedModelType("gemma2"));
  EXPECT_TRUE(IsSupportedModelType("gemma3_text"));
  EXPECT_FALSE(IsSupportedModelType("gemma3"));  // the multimodal model
  EXPECT_TRUE(IsSupportedModelType("phi3"));
  EXPECT_FALSE(IsSupportedModelType("gemma"));
  absl::StatusOr<ModelConfig> config = ParseModelConfig(
      R"({"model_type": "gemma", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2})",
      "config.json");
  EXPECT_THAT(
      std::string(config.status().message()),
      HasSubstr("model_type: unsupported \"gemma\" (supported: llama, mistral, qwen2, qwen3, "
                "gemma2, gemma3_text, phi3)"));
}

}  // namespace
}  // namespace lathe
