// The planner's model shapes against the parameter counts of real models: their config.json
// shape fields are in tests/planner/data/configs/, the counts are those of the published
// checkpoints (sum of every tensor in their safetensors).
#include "planner/model_shape.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/planner/config_shapes.h"
#include "tests/testing/source_path.h"
#include "tests/testing/status_matchers.h"

namespace lathe {
namespace {

using testing::Shape;
using testing::ShapeOf;
using testing::StatusIs;

struct CountCase {
  const char* config;
  int64_t total;
  const char* model_type;
  bool tied;
};

class ParameterCountTest : public ::testing::TestWithParam<CountCase> {};

TEST_P(ParameterCountTest, EqualsThePublishedModel) {
  absl::StatusOr<ModelShape> shape = ShapeOf(GetParam().config);
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_EQ(shape->total_params(), GetParam().total);
  EXPECT_EQ(shape->config.model_type, GetParam().model_type);
  EXPECT_EQ(shape->config.tie_word_embeddings, GetParam().tied);
  EXPECT_EQ(shape->lm_head, GetParam().tied ? 0 : shape->embeddings);
}

INSTANTIATE_TEST_SUITE_P(
    PublicModels, ParameterCountTest,
    ::testing::Values(CountCase{"llama-3.1-8b", 8'030'261'248, "llama", false},
                      CountCase{"llama-3.1-70b", 70'553'706'496, "llama", false},
                      CountCase{"llama-3.2-1b", 1'235'814'400, "llama", true},
                      CountCase{"mistral-7b-v0.1", 7'241'732'096, "mistral", false},
                      CountCase{"qwen2.5-7b", 7'615'616'512, "qwen2", false},
                      CountCase{"qwen2.5-0.5b", 494'032'768, "qwen2", true},
                      CountCase{"qwen3-0.6b", 596'049'920, "qwen3", true},
                      CountCase{"gemma-2-9b", 9'241'705'984, "gemma2", true},
                      CountCase{"gemma-3-1b", 999'885'952, "gemma3_text", true},
                      CountCase{"phi-3-mini-4k", 3'821'079'552, "phi3", false},
                      // GQA (24 heads on 8), tied: qkv_proj 3072 x 5120 per block.
                      CountCase{"phi-4-mini", 3'836'021'760, "phi3", true}),
    [](const ::testing::TestParamInfo<CountCase>& param) {
      std::string name = param.param.config;
      for (char& c : name) {
        if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
      }
      return name;
    });

TEST(ModelShapeTest, BreaksABlockDownByKind) {
  absl::StatusOr<ModelShape> shape = ShapeOf("qwen2.5-7b");
  ASSERT_TRUE(shape.ok()) << shape.status();
  // hidden 3584, 28 heads and 4 key/value heads of 128, intermediate 18944.
  EXPECT_EQ(shape->config.head_dim, 128);
  EXPECT_EQ(shape->block.attention, 2 * 3584 * 3584 + 2 * 3584 * 512);
  EXPECT_EQ(shape->block.attention_bias, 3584 + 2 * 512);  // q, k, v; not o
  EXPECT_EQ(shape->block.mlp, 3 * 3584 * 18944);
  EXPECT_EQ(shape->block.norms, 2 * 3584);
  // The head unit (final norm and LM head, 545M) outweighs a block (233M).
  EXPECT_EQ(shape->largest_unit_params(), shape->final_norm + shape->lm_head);
  absl::StatusOr<ModelShape> gemma2 = ShapeOf("gemma-2-9b");
  ASSERT_TRUE(gemma2.ok()) << gemma2.status();
  EXPECT_EQ(gemma2->block.norms, 4 * 3584);  // pre/post attention and MLP
  EXPECT_EQ(gemma2->block.attention, 2 * 3584 * 4096 + 2 * 3584 * 2048);  // head_dim 256
  EXPECT_TRUE(IsGemma(gemma2->config));                                   // GeGLU
  EXPECT_EQ(gemma2->config.attn_logit_softcapping, 50.0);
  EXPECT_EQ(gemma2->config.final_logit_softcapping, 30.0);
  absl::StatusOr<ModelShape> gemma3 = ShapeOf("gemma-3-1b");
  ASSERT_TRUE(gemma3.ok()) << gemma3.status();
  // Four norms of hidden 1152, q_norm and k_norm of head_dim 256; no soft-caps (null).
  EXPECT_EQ(gemma3->block.norms, 4 * 1152 + 2 * 256);
  EXPECT_EQ(gemma3->block.head_norms, 2);
  EXPECT_EQ(gemma3->block.hidden_norms(1152, 256), 4);
  EXPECT_TRUE(IsGemma(gemma3->config));
  EXPECT_EQ(gemma3->config.attn_logit_softcapping, 0.0);
  EXPECT_EQ(gemma3->config.final_logit_softcapping, 0.0);
  absl::StatusOr<ModelShape> qwen3 = ShapeOf("qwen3-0.6b");
  ASSERT_TRUE(qwen3.ok()) << qwen3.status();
  // hidden 1024, 16 heads and 8 key/value heads of 128 (q projects to 2048).
  EXPECT_EQ(qwen3->block.attention, 2 * 1024 * 2048 + 2 * 1024 * 1024);
  EXPECT_EQ(qwen3->block.attention_bias, 0);
  EXPECT_EQ(qwen3->block.norms, 2 * 1024 + 2 * 128);  // and q_norm, k_norm over head_dim
  EXPECT_EQ(qwen3->block.head_norms, 2);
}

// Transformers' Gemma 2 and 3 configs: head_dim 256 when absent (not hidden / heads), Gemma
// 2's soft-caps on when absent, off when null.
TEST(ModelShapeTest, GemmaDefaults) {
  for (const char* type : {"gemma2", "gemma3_text"}) {
    SCOPED_TRACE(type);
    absl::StatusOr<ModelConfig> config = ParseModelConfig(
        absl::StrCat(R"({"model_type": ")", type,
                     R"(", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
                     "num_hidden_layers": 1, "num_attention_heads": 4,
                     "max_position_embeddings": 64})"),
        "c.json");
    ASSERT_TRUE(config.ok()) << config.status();
    const ModelShape shape = ModelShapeOf(*config);
    EXPECT_EQ(shape.config.head_dim, 256);
    EXPECT_TRUE(shape.config.tie_word_embeddings);
    EXPECT_EQ(shape.lm_head, 0);
    EXPECT_EQ(shape.block.attention, 4 * 64 * 4 * 256);  // q, k, v, o of 4 heads of 256
    EXPECT_EQ(shape.config.attn_logit_softcapping > 0, std::string(type) == "gemma2");
    EXPECT_EQ(shape.config.final_logit_softcapping > 0, std::string(type) == "gemma2");
  }
  absl::StatusOr<ModelConfig> uncapped = ParseModelConfig(
      R"({"model_type": "gemma2", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64,
          "attn_logit_softcapping": null, "final_logit_softcapping": null})",
      "c.json");
  ASSERT_TRUE(uncapped.ok()) << uncapped.status();
  EXPECT_EQ(uncapped->attn_logit_softcapping, 0.0);
  EXPECT_EQ(uncapped->final_logit_softcapping, 0.0);
}

// The planner sizes what the engine reads, through the one parser: a mixture-of-experts
// model is refused by its expert key, the first Gemma (model_type gemma) by its type.
TEST(ModelShapeTest, RefusesWhatTheEngineCannotRead) {
  EXPECT_THAT(ShapeOf("mixtral-8x7b").status(),
              StatusIs(absl::StatusCode::kUnimplemented,
                       "mixtral-8x7b.json: num_local_experts: 8: mixture-of-experts"));
  EXPECT_THAT(ShapeOf("gemma-2b").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "gemma-2b.json: model_type: unsupported \"gemma\""));
}

}  // namespace
}  // namespace lathe
