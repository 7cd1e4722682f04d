// The planner's model-state formulas (planner/model_states.h) against what the
// engine's ZeRO layer actually allocates (ShardedModel::bytes()), rank by rank, for every
// stage, rank count and method, on sizes no rank count divides.
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/model_config.h"
#include "gtest/gtest.h"
#include "planner/model_shape.h"
#include "planner/model_states.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tiny_model.h"
#include "worker/comm/fake_communicator.h"
#include "worker/engine/causal_lm.h"
#include "worker/shard/sharded_model.h"
#include "worker/tools/synthetic.h"

namespace lathe {
namespace {

TEST(PlannerAgreementTest, ModelStatesMatchTheEnginesShardsByteForByte) {
  testing::TempDir dir;
  // qwen2: biases, tied; qwen3: q/k norms of head_dim in every block; gemma2: four norms of
  // hidden in every block, tied; gemma3_text: those and q/k norms; phi3: fused qkv_proj and
  // gate_up_proj (one tensor each), tied.
  for (const std::string type : {"llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"}) {
    ModelConfig config = testing::TinyModelConfig(type);
    config.tie_word_embeddings = type == "qwen2" || type == "gemma2" || type == "phi3";
    const std::string model_dir = dir.Path(type);
    ASSERT_TRUE(WriteSyntheticModel(config, DType::kF32, 1, 0, model_dir).ok());
    // As the planner reads it: the config.json written, through the one parser.
    absl::StatusOr<ModelConfig> written = LoadModelConfig(model_dir);
    ASSERT_TRUE(written.ok()) << written.status();
    const ModelShape shape = ModelShapeOf(*written);
    EXPECT_EQ(shape.total_params(), ParameterCount(config));
    LoraSpec lora;
    lora.rank = 5;
    lora.targets = type == "phi3" ? std::vector<std::string>{"qkv_proj", "down_proj"}
                                  : std::vector<std::string>{"q_proj", "v_proj", "down_proj"};
    // LoRA alone, LoRA with both modules_to_save copies (trainable tensors of unit 0 and of the
    // head unit, tied or not), and full fine-tuning.
    for (const auto& [method, saving] :
         {std::pair{Method::kLora, false}, std::pair{Method::kLora, true},
          std::pair{Method::kFull, false}}) {
      SavedModules saved;
      saved.embed_tokens = saved.lm_head = saving;
      lora.modules_to_save =
          saving ? std::vector<std::string>{"embed_tokens", "lm_head"} : std::vector<std::string>{};
      absl::StatusOr<std::vector<UnitElements>> units =
          UnitsOf(shape, method, lora.rank, lora.targets, saved);
      ASSERT_TRUE(units.ok()) << units.status();
      for (int64_t stage : {1, 2, 3}) {
        for (int world : {1, 2, 3, 4}) {
          const std::string what =
              absl::StrCat(config.model_type, " ", MethodName(method), saving ? " saving" : "",
                           " stage ", stage, " ranks ", world);
          std::vector<std::unique_ptr<Communicator>> group = MakeFakeGroup(world);
          for (int rank = 0; rank < world; ++rank) {
            ModelOptions options;
            options.keep_mapped = stage == 3;
            absl::StatusOr<std::unique_ptr<CausalLm>> model =
                CausalLm::Load(model_dir, config, method == Method::kFull, options);
            ASSERT_TRUE(model.ok()) << model.status();
            if (method == Method::kLora) (*model)->InitLora(lora, 1);
            ShardOptions shard;
            shard.strategy.zero_stage = stage;
            absl::StatusOr<std::unique_ptr<ShardedModel>> sharded =
                ShardedModel::Create(model->get(), group[rank].get(), shard);
            ASSERT_TRUE(sharded.ok()) << sharded.status();
            const ShardBytes engine = (*sharded)->bytes();
            const ModelStateBytes planned = ModelStates(*units, 4, world, shard.strategy);
            EXPECT_EQ(planned.weights, engine.frozen) << what;
            EXPECT_EQ(planned.trainable, engine.trainable) << what;
            EXPECT_EQ(planned.gradients, engine.gradients) << what;
            // Rank 0 owns a whole slice; the last may own less (the padding has no state).
            if (rank == 0) {
              EXPECT_EQ(planned.optimizer, engine.optimizer) << what;
            } else {
              EXPECT_LE(engine.optimizer, planned.optimizer) << what;
            }
            EXPECT_EQ(planned.gathered_unit, engine.largest_unit) << what;
          }
        }
      }
    }
  }
}

TEST(PlannerAgreementTest, OffloadMovesStatesToTheHost) {
  std::vector<UnitElements> units = {{1000, 0}, {3000, 50}, {3000, 50}, {1001, 0}};
  Strategy stage3;
  stage3.zero_stage = 3;
  Strategy offload = stage3;
  offload.offload_optimizer = offload.offload_params = true;
  const ModelStateBytes on_device = ModelStates(units, 2, 4, stage3);
  const ModelStateBytes offloaded = ModelStates(units, 2, 4, offload);
  EXPECT_EQ(offloaded.optimizer, 0);
  EXPECT_EQ(offloaded.weights, 0);
  EXPECT_EQ(offloaded.trainable, 0);
  EXPECT_EQ(offloaded.gradients, on_device.gradients);
  // Master slice and two moments (3 x 4 bytes x 13 per block), and the parameter slices.
  EXPECT_EQ(offloaded.host, 2 * 12 * 13 + on_device.weights + on_device.trainable);
}

}  // namespace
}  // namespace lathe
