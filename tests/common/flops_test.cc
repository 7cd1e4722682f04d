// MFU's two halves (common/flops.h) against FLOPs counted by hand.
#include "common/flops.h"

#include <gtest/gtest.h>

#include "common/job_spec.h"
#include "common/model_config.h"

namespace lathe {
namespace {

// hidden 8, intermediate 16, 2 heads of 4, 1 KV head, 2 layers, vocab 10. One layer's
// projections: q 8x8, k 8x4, v 8x4, o 8x8, gate 8x16, up 8x16, down 16x8 = 576 weights.
ModelConfig SmallConfig() {
  ModelConfig config;
  config.model_type = "llama";
  config.vocab_size = 10;
  config.hidden_size = 8;
  config.intermediate_size = 16;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 2;
  config.num_key_value_heads = 1;
  config.head_dim = 4;
  return config;
}

TEST(FlopsTest, FullFineTuningIsThreeForwards) {
  JobSpec spec;
  spec.method = Method::kFull;
  // Forward per token: layers 2 x (2 x 576 + attention 2 x 8 x 2 x 4 = 128) + head 2 x 80.
  EXPECT_DOUBLE_EQ(TrainingFlopsPerToken(SmallConfig(), spec, 7, false), 3 * (2560 + 160));
  // Recomputation adds the blocks' forward once more.
  EXPECT_DOUBLE_EQ(TrainingFlopsPerToken(SmallConfig(), spec, 7, true), 3 * 2720 + 2560);
}

TEST(FlopsTest, LoraTrainsTheAdaptersAndOnlyPropagatesThroughTheBase) {
  JobSpec spec;
  spec.lora.rank = 2;
  spec.lora.targets = {"q_proj", "v_proj"};
  // Adapters per layer: 2 x (8 + 8) + 2 x (8 + 4) = 56. Frozen: 2 x (layers 2 x 2 x 576 + head
  // 160) = 4928; trained: 3 x layers 2 x (2 x 56 + 128) = 1440.
  EXPECT_DOUBLE_EQ(TrainingFlopsPerToken(SmallConfig(), spec, 7, false), 4928 + 1440);
  // Blocks' forward: 2 x (1152 + 112 + 128) = 2784.
  EXPECT_DOUBLE_EQ(TrainingFlopsPerToken(SmallConfig(), spec, 7, true), 4928 + 1440 + 2784);
}

TEST(FlopsTest, MezoIsTwoForwards) {
  JobSpec spec;
  spec.method = Method::kMezo;
  spec.mezo.trainable = Method::kFull;
  EXPECT_DOUBLE_EQ(TrainingFlopsPerToken(SmallConfig(), spec, 7, false), 2 * (2560 + 160));
  // Over LoRA the adapters' forward too: layers 2 x 2 x 56 more.
  spec.mezo.trainable = Method::kLora;
  spec.lora.rank = 2;
  spec.lora.targets = {"q_proj", "v_proj"};
  EXPECT_DOUBLE_EQ(TrainingFlopsPerToken(SmallConfig(), spec, 7, false),
                   2 * (2560 + 160 + 2 * 2 * 56));
}

TEST(FlopsTest, CudaPeaksByNameAndPrecision) {
  EXPECT_DOUBLE_EQ(*CudaPeakFlops("NVIDIA H100 80GB HBM3", Precision::kBf16), 989.4e12);
  EXPECT_DOUBLE_EQ(*CudaPeakFlops("NVIDIA H100 PCIe", Precision::kFp16), 756.0e12);
  EXPECT_DOUBLE_EQ(*CudaPeakFlops("NVIDIA H200", Precision::kFp32), 66.9e12);
  EXPECT_DOUBLE_EQ(*CudaPeakFlops("NVIDIA L40S", Precision::kBf16), 362.1e12);
  EXPECT_DOUBLE_EQ(*CudaPeakFlops("NVIDIA L4", Precision::kBf16), 121.0e12);
  EXPECT_FALSE(CudaPeakFlops("cpu", Precision::kFp32).has_value());
}

TEST(FlopsTest, MfuIsAchievedOverPeakOfEveryRank) {
  EXPECT_DOUBLE_EQ(Mfu(6e9, 1000, 1e13, 2), 0.3);
  EXPECT_EQ(Mfu(6e9, 1000, 0, 1), 0.0);
}

}  // namespace
}  // namespace lathe
