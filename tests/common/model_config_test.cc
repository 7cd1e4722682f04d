#include "common/model_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace lathe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kSource[] = "/m/config.json";

// config.json of meta-llama/Llama-3.2-1B.
constexpr char kLlama32_1B[] = R"json({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})json";

// config.json of mistralai/Mistral-7B-v0.1.
constexpr char kMistral7B[] = R"json({
  "architectures": ["MistralForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "sliding_window": 4096,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.34.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
})json";

// config.json of Qwen/Qwen2.5-0.5B.
constexpr char kQwen25_05B[] = R"json({
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 896,
  "initializer_range": 0.02,
  "intermediate_size": 4864,
  "max_position_embeddings": 32768,
  "max_window_layers": 24,
  "model_type": "qwen2",
  "num_attention_heads": 14,
  "num_hidden_layers": 24,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 32768,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})json";

// config.json of Qwen/Qwen3-0.6B.
constexpr char kQwen3_06B[] = R"json({
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})json";

// config.json of google/gemma-2-2b.
constexpr char kGemma2_2B[] = R"json({
  "architectures": ["Gemma2ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "attn_logit_softcapping": 50.0,
  "bos_token_id": 2,
  "cache_implementation": "hybrid",
  "eos_token_id": 1,
  "final_logit_softcapping": 30.0,
  "head_dim": 256,
  "hidden_act": "gelu_pytorch_tanh",
  "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 2304,
  "initializer_range": 0.02,
  "intermediate_size": 9216,
  "max_position_embeddings": 8192,
  "model_type": "gemma2",
  "num_attention_heads": 8,
  "num_hidden_layers": 26,
  "num_key_value_heads": 4,
  "pad_token_id": 0,
  "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06,
  "rope_theta": 10000.0,
  "sliding_window": 4096,
  "torch_dtype": "float32",
  "transformers_version": "4.42.4",
  "use_cache": true,
  "vocab_size": 256000
})json";

// config.json of google/gemma-3-1b-pt.
constexpr char kGemma3_1B[] = R"json({
  "architectures": ["Gemma3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "attn_logit_softcapping": null,
  "bos_token_id": 2,
  "cache_implementation": "hybrid",
  "eos_token_id": 1,
  "final_logit_softcapping": null,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 1152,
  "initializer_range": 0.02,
  "intermediate_size": 6912,
  "max_position_embeddings": 32768,
  "model_type": "gemma3_text",
  "num_attention_heads": 4,
  "num_hidden_layers": 26,
  "num_key_value_heads": 1,
  "pad_token_id": 0,
  "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06,
  "rope_local_base_freq": 10000,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": 512,
  "sliding_window_pattern": 6,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.50.0.dev0",
  "use_cache": true,
  "vocab_size": 262144
})json";

// config.json of microsoft/Phi-3-mini-4k-instruct (auto_map left out).
constexpr char kPhi3Mini4k[] = R"json({
  "architectures": ["Phi3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "embd_pdrop": 0.0,
  "eos_token_id": 32000,
  "hidden_act": "silu",
  "hidden_size": 3072,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 4096,
  "model_type": "phi3",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 32,
  "original_max_position_embeddings": 4096,
  "pad_token_id": 32000,
  "resid_pdrop": 0.0,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 10000.0,
  "sliding_window": 2047,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.2",
  "use_cache": true,
  "vocab_size": 32064
})json";

// config.json of microsoft/Phi-4-mini-instruct (auto_map left out), its 48 short and long
// LongRoPE factors replaced by Phi4MiniFactors' (the same count).
nlohmann::json Phi4Mini() {
  nlohmann::json json = nlohmann::json::parse(R"json({
    "architectures": ["Phi3ForCausalLM"],
    "attention_bias": false,
    "attention_dropout": 0.0,
    "bos_token_id": 199999,
    "embd_pdrop": 0.0,
    "eos_token_id": 199999,
    "full_attn_mod": 1,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "interpolate_factor": 1,
    "lm_head_bias": false,
    "max_position_embeddings": 131072,
    "mlp_bias": false,
    "model_type": "phi3",
    "num_attention_heads": 24,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "original_max_position_embeddings": 4096,
    "pad_token_id": 199999,
    "partial_rotary_factor": 0.75,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 262144,
    "tie_word_embeddings": true,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0",
    "use_cache": true,
    "vocab_size": 200064
  })json");
  std::vector<double> short_factor, long_factor;
  for (int i = 0; i < 48; ++i) {
    short_factor.push_back(1.0 + 0.01 * i);
    long_factor.push_back(1.0 + 0.5 * i);
  }
  json["rope_scaling"] = {
      {"long_factor", long_factor}, {"short_factor", short_factor}, {"type", "longrope"}};
  return json;
}

// A tiny Llama with grouped-query attention (4 heads over 2 KV heads) and every bias on.
nlohmann::json TinyLlama() {
  return {{"model_type", "llama"},    {"vocab_size", 10},
          {"hidden_size", 8},         {"intermediate_size", 12},
          {"num_hidden_layers", 2},   {"num_attention_heads", 4},
          {"num_key_value_heads", 2}, {"max_position_embeddings", 64},
          {"rms_norm_eps", 1e-6},     {"hidden_act", "silu"},
          {"attention_bias", true},   {"mlp_bias", true}};
}

ModelConfig MustParse(const std::string& text) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(text, kSource);
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *config : ModelConfig();
}

void ExpectSameConfig(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.architecture, b.architecture);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_key_value_heads, b.num_key_value_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rope_scaling.kind, b.rope_scaling.kind);
  EXPECT_EQ(a.rope_scaling.factor, b.rope_scaling.factor);
  EXPECT_EQ(a.rope_scaling.low_freq_factor, b.rope_scaling.low_freq_factor);
  EXPECT_EQ(a.rope_scaling.high_freq_factor, b.rope_scaling.high_freq_factor);
  EXPECT_EQ(a.rope_scaling.original_max_position_embeddings,
            b.rope_scaling.original_max_position_embeddings);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.qkv_bias, b.qkv_bias);
  EXPECT_EQ(a.o_bias, b.o_bias);
  EXPECT_EQ(a.mlp_bias, b.mlp_bias);
  EXPECT_EQ(a.qk_norm, b.qk_norm);
  EXPECT_EQ(a.partial_rotary_factor, b.partial_rotary_factor);
  EXPECT_EQ(a.rope_scaling.short_factor, b.rope_scaling.short_factor);
  EXPECT_EQ(a.rope_scaling.long_factor, b.rope_scaling.long_factor);
  EXPECT_EQ(a.rope_scaling.attention_factor, b.rope_scaling.attention_factor);
  EXPECT_EQ(a.sliding_window, b.sliding_window);
  EXPECT_EQ(a.sliding_layers, b.sliding_layers);
  EXPECT_EQ(a.query_pre_attn_scalar, b.query_pre_attn_scalar);
  EXPECT_EQ(a.attn_logit_softcapping, b.attn_logit_softcapping);
  EXPECT_EQ(a.final_logit_softcapping, b.final_logit_softcapping);
  EXPECT_EQ(a.rope_local_base_freq, b.rope_local_base_freq);
  EXPECT_EQ(a.pad_token_id, b.pad_token_id);
  EXPECT_EQ(a.torch_dtype, b.torch_dtype);
  EXPECT_EQ(a.bos_token_id, b.bos_token_id);
  EXPECT_EQ(a.eos_token_ids, b.eos_token_ids);
}

TEST(ModelConfigTest, ParsesLlama32_1B) {
  ModelConfig config = MustParse(kLlama32_1B);
  EXPECT_EQ(config.model_type, "llama");
  EXPECT_EQ(config.architecture, "LlamaForCausalLM");
  EXPECT_EQ(config.vocab_size, 128256);
  EXPECT_EQ(config.hidden_size, 2048);
  EXPECT_EQ(config.intermediate_size, 8192);
  EXPECT_EQ(config.num_hidden_layers, 16);
  EXPECT_EQ(config.num_attention_heads, 32);
  EXPECT_EQ(config.num_key_value_heads, 8);
  EXPECT_EQ(config.head_dim, 64);
  EXPECT_EQ(config.max_position_embeddings, 131072);
  EXPECT_EQ(config.rms_norm_eps, 1e-5);
  EXPECT_EQ(config.rope_theta, 500000.0);
  EXPECT_EQ(config.rope_scaling.kind, RopeScaling::Kind::kLlama3);
  EXPECT_EQ(config.rope_scaling.factor, 32.0);
  EXPECT_EQ(config.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(config.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(config.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_TRUE(config.tie_word_embeddings);
  EXPECT_FALSE(config.qkv_bias);
  EXPECT_FALSE(config.o_bias);
  EXPECT_FALSE(config.mlp_bias);
  EXPECT_EQ(config.sliding_window, std::nullopt);
  EXPECT_EQ(config.torch_dtype, "bfloat16");

  // Published size: 1.24B. Tied, so no lm_head.weight.
  EXPECT_EQ(ParameterCount(config), 1235814400);
  std::vector<WeightSpec> weights = ExpectedWeights(config);
  ASSERT_EQ(weights.size(), 1u + 16 * 9 + 1);
  EXPECT_EQ(weights.back().name, "model.norm.weight");
  EXPECT_EQ(weights[3].name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_THAT(weights[3].shape, ElementsAre(8 * 64, 2048));
}

TEST(ModelConfigTest, ParsesMistral7B) {
  ModelConfig config = MustParse(kMistral7B);
  EXPECT_EQ(config.model_type, "mistral");
  EXPECT_EQ(config.architecture, "MistralForCausalLM");
  EXPECT_EQ(config.num_key_value_heads, 8);
  EXPECT_EQ(config.head_dim, 128);  // 4096 / 32
  EXPECT_EQ(config.sliding_window, 4096);
  EXPECT_EQ(config.rope_scaling.kind, RopeScaling::Kind::kNone);
  EXPECT_EQ(config.rope_theta, 10000.0);
  EXPECT_FALSE(config.tie_word_embeddings);
  EXPECT_FALSE(config.qkv_bias);
  EXPECT_FALSE(config.o_bias);
  EXPECT_FALSE(config.mlp_bias);

  EXPECT_EQ(ParameterCount(config), 7241732096);  // published: 7.24B
  std::vector<WeightSpec> weights = ExpectedWeights(config);
  ASSERT_EQ(weights.size(), 1u + 32 * 9 + 2);
  EXPECT_EQ(weights.back().name, "lm_head.weight");
  EXPECT_THAT(weights.back().shape, ElementsAre(32000, 4096));
}

TEST(ModelConfigTest, ParsesQwen25_05B) {
  ModelConfig config = MustParse(kQwen25_05B);
  EXPECT_EQ(config.model_type, "qwen2");
  EXPECT_EQ(config.architecture, "Qwen2ForCausalLM");
  EXPECT_EQ(config.head_dim, 64);  // 896 / 14
  EXPECT_EQ(config.num_key_value_heads, 2);
  EXPECT_TRUE(config.tie_word_embeddings);
  EXPECT_TRUE(config.qkv_bias);
  EXPECT_FALSE(config.o_bias);
  EXPECT_FALSE(config.mlp_bias);
  EXPECT_EQ(config.sliding_window, std::nullopt);  // use_sliding_window: false
  EXPECT_EQ(config.rms_norm_eps, 1e-6);
  EXPECT_EQ(config.rope_theta, 1e6);

  EXPECT_EQ(ParameterCount(config), 494032768);  // published: 0.49B
  std::vector<WeightSpec> weights = ExpectedWeights(config);
  // q, k, v carry biases: 12 tensors per layer.
  ASSERT_EQ(weights.size(), 1u + 24 * 12 + 1);
  EXPECT_EQ(weights[3].name, "model.layers.0.self_attn.q_proj.bias");
  EXPECT_THAT(weights[3].shape, ElementsAre(896));
}

TEST(ModelConfigTest, ParsesQwen3_06B) {
  ModelConfig config = MustParse(kQwen3_06B);
  EXPECT_EQ(config.model_type, "qwen3");
  EXPECT_EQ(config.architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(config.head_dim, 128);  // given: not 1024 / 16
  EXPECT_EQ(config.num_key_value_heads, 8);
  EXPECT_TRUE(config.tie_word_embeddings);
  EXPECT_TRUE(config.qk_norm);
  EXPECT_FALSE(config.qkv_bias);
  EXPECT_FALSE(config.o_bias);
  EXPECT_FALSE(config.mlp_bias);
  EXPECT_EQ(config.sliding_window, std::nullopt);
  EXPECT_EQ(config.rope_theta, 1e6);
  EXPECT_EQ(config.eos_token_ids, std::vector<int64_t>{151645});

  // Embeddings 151936 x 1024 (tied) + 28 blocks of 15,730,944 (q 1024x2048, k and v
  // 1024x1024, o 2048x1024, MLP 3 x 1024x3072, norms 2 x 1024 + 2 x 128) + the final norm.
  EXPECT_EQ(ParameterCount(config), 596049920);  // published: 0.6B, 0.44B without embeddings
  std::vector<WeightSpec> weights = ExpectedWeights(config);
  // q_norm and k_norm: 11 tensors per layer.
  ASSERT_EQ(weights.size(), 1u + 28 * 11 + 1);
  EXPECT_EQ(weights[6].name, "model.layers.0.self_attn.q_norm.weight");
  EXPECT_THAT(weights[6].shape, ElementsAre(128));
  EXPECT_EQ(weights[7].name, "model.layers.0.self_attn.k_norm.weight");
  EXPECT_THAT(weights[7].shape, ElementsAre(128));

  // attention_bias: q, k, v and o, as Llama's.
  nlohmann::json biased = nlohmann::json::parse(kQwen3_06B);
  biased["attention_bias"] = true;
  ModelConfig with_bias = MustParse(biased.dump());
  EXPECT_TRUE(with_bias.qkv_bias);
  EXPECT_TRUE(with_bias.o_bias);
  EXPECT_EQ(ExpectedWeights(with_bias).size(), 1u + 28 * 15 + 1);
}

TEST(ModelConfigTest, ParsesGemma2_2B) {
  ModelConfig config = MustParse(kGemma2_2B);
  EXPECT_TRUE(IsGemma(config));
  EXPECT_EQ(config.architecture, "Gemma2ForCausalLM");
  EXPECT_EQ(config.head_dim, 256);  // given: not 2304 / 8
  EXPECT_EQ(config.query_pre_attn_scalar, 256);
  EXPECT_EQ(config.attn_logit_softcapping, 50.0);
  EXPECT_EQ(config.final_logit_softcapping, 30.0);
  EXPECT_TRUE(config.tie_word_embeddings);  // Gemma's default
  EXPECT_FALSE(config.qk_norm);
  EXPECT_FALSE(config.qkv_bias);
  EXPECT_EQ(config.rope_theta, 10000.0);
  EXPECT_EQ(config.rope_local_base_freq, 0.0);
  EXPECT_EQ(config.sliding_window, 4096);
  // Transformers' default layer_types: sliding, global, sliding, ...
  ASSERT_EQ(config.sliding_layers.size(), 26u);
  for (int64_t l = 0; l < 26; ++l) EXPECT_EQ(LayerSlides(config, l), l % 2 == 0) << l;

  // Embeddings 256000 x 2304 (tied) + 26 blocks of 77,865,984 (q 2304x2048, k and v 2304x1024,
  // o 2048x2304, MLP 3 x 2304x9216, 4 norms of 2304) + the final norm.
  EXPECT_EQ(ParameterCount(config), 2614341888);  // published: 2,614,341,888
  std::vector<WeightSpec> weights = ExpectedWeights(config);
  ASSERT_EQ(weights.size(), 1u + 26 * 11 + 1);
  std::vector<std::string> layer0;
  for (size_t i = 1; i < 12; ++i) layer0.push_back(weights[i].name);
  EXPECT_THAT(
      layer0,
      ElementsAre(
          "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
          "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
          "model.layers.0.self_attn.o_proj.weight",
          "model.layers.0.post_attention_layernorm.weight",
          "model.layers.0.pre_feedforward_layernorm.weight", "model.layers.0.mlp.gate_proj.weight",
          "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
          "model.layers.0.post_feedforward_layernorm.weight"));
  EXPECT_THAT(weights[11].shape, ElementsAre(2304));

  // attention_bias: q, k, v and o.
  nlohmann::json biased = nlohmann::json::parse(kGemma2_2B);
  biased["attention_bias"] = true;
  ModelConfig with_bias = MustParse(biased.dump());
  EXPECT_TRUE(with_bias.qkv_bias);
  EXPECT_TRUE(with_bias.o_bias);
  EXPECT_EQ(ExpectedWeights(with_bias).size(), 1u + 26 * 15 + 1);
}

TEST(ModelConfigTest, ParsesGemma3_1B) {
  ModelConfig config = MustParse(kGemma3_1B);
  EXPECT_TRUE(IsGemma(config));
  EXPECT_EQ(config.architecture, "Gemma3ForCausalLM");
  EXPECT_TRUE(config.qk_norm);
  EXPECT_EQ(config.attn_logit_softcapping, 0.0);  // null: none
  EXPECT_EQ(config.final_logit_softcapping, 0.0);
  EXPECT_EQ(config.rope_theta, 1e6);
  EXPECT_EQ(config.rope_local_base_freq, 10000.0);
  EXPECT_EQ(config.rope_scaling.kind, RopeScaling::Kind::kNone);
  EXPECT_EQ(config.sliding_window, 512);
  // sliding_window_pattern 6: every sixth layer is global.
  ASSERT_EQ(config.sliding_layers.size(), 26u);
  for (int64_t l = 0; l < 26; ++l) EXPECT_EQ(LayerSlides(config, l), (l + 1) % 6 != 0) << l;

  // Embeddings 262144 x 1152 (tied) + 26 blocks of 26,842,112 (q 1152x1024, k and v 1152x256,
  // o 1024x1152, MLP 3 x 1152x6912, 4 norms of 1152, q/k norms of 256) + the final norm.
  EXPECT_EQ(ParameterCount(config), 999885952);  // published: 999,885,952
  std::vector<WeightSpec> weights = ExpectedWeights(config);
  ASSERT_EQ(weights.size(), 1u + 26 * 13 + 1);
  EXPECT_EQ(weights[6].name, "model.layers.0.self_attn.q_norm.weight");
  EXPECT_EQ(weights[7].name, "model.layers.0.self_attn.k_norm.weight");
  EXPECT_THAT(weights[7].shape, ElementsAre(256));
  EXPECT_EQ(weights[13].name, "model.layers.0.post_feedforward_layernorm.weight");
}

// Transformers' defaults where a Gemma config.json leaves a key out, and what null means.
TEST(ModelConfigTest, GemmaDefaults) {
  nlohmann::json gemma2 = nlohmann::json::parse(kGemma2_2B);
  for (const char* key :
       {"head_dim", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
        "sliding_window", "tie_word_embeddings", "hidden_activation", "hidden_act"}) {
    gemma2.erase(key);
  }
  gemma2["num_attention_heads"] = 12;  // head_dim stays 256, not 2304 / 12
  ModelConfig config = MustParse(gemma2.dump());
  EXPECT_EQ(config.head_dim, 256);
  EXPECT_EQ(config.query_pre_attn_scalar, 256);
  EXPECT_EQ(config.attn_logit_softcapping, 50.0);
  EXPECT_EQ(config.final_logit_softcapping, 30.0);
  EXPECT_EQ(config.sliding_window, 4096);
  EXPECT_TRUE(config.tie_word_embeddings);
  EXPECT_EQ(config.pad_token_id, 0);  // given as 0 too
  gemma2.erase("pad_token_id");
  EXPECT_EQ(MustParse(gemma2.dump()).pad_token_id, 0);
  gemma2["pad_token_id"] = nullptr;
  EXPECT_EQ(MustParse(gemma2.dump()).pad_token_id, std::nullopt);
  gemma2["attn_logit_softcapping"] = nullptr;
  gemma2["final_logit_softcapping"] = nullptr;
  gemma2["sliding_window"] = nullptr;
  config = MustParse(gemma2.dump());
  EXPECT_EQ(config.attn_logit_softcapping, 0.0);
  EXPECT_EQ(config.final_logit_softcapping, 0.0);
  EXPECT_EQ(config.sliding_window, std::nullopt);
  EXPECT_FALSE(LayerSlides(config, 0));

  // layer_types, when given, says which layers slide.
  nlohmann::json gemma3 = nlohmann::json::parse(kGemma3_1B);
  gemma3["num_hidden_layers"] = 3;
  gemma3["layer_types"] = {"full_attention", "sliding_attention", "full_attention"};
  config = MustParse(gemma3.dump());
  EXPECT_EQ(config.sliding_layers, (std::vector<bool>{false, true, false}));
  gemma3.erase("layer_types");
  gemma3["sliding_window_pattern"] = 2;
  EXPECT_EQ(MustParse(gemma3.dump()).sliding_layers, (std::vector<bool>{true, false, true}));
  gemma3.erase("sliding_window_pattern");
  gemma3.erase("rope_theta");
  gemma3.erase("rope_local_base_freq");
  config = MustParse(gemma3.dump());
  EXPECT_EQ(config.sliding_layers, (std::vector<bool>{true, true, true}));  // pattern 6
  EXPECT_EQ(config.rope_theta, 1e6);
  EXPECT_EQ(config.rope_local_base_freq, 10000.0);
}

// Gemma 3's RoPE: rope_scaling on the global layers only (Gemma 3 4B and larger: linear,
// factor 8); transformers 5 writes one rope_parameters object per layer type.
TEST(ModelConfigTest, Gemma3RopeParameters) {
  nlohmann::json legacy = nlohmann::json::parse(kGemma3_1B);
  legacy["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  ModelConfig config = MustParse(legacy.dump());
  EXPECT_EQ(config.rope_scaling.kind, RopeScaling::Kind::kLinear);
  EXPECT_EQ(config.rope_scaling.factor, 8.0);
  EXPECT_EQ(config.rope_theta, 1e6);
  EXPECT_EQ(config.rope_local_base_freq, 10000.0);

  nlohmann::json nested = nlohmann::json::parse(kGemma3_1B);
  for (const char* key : {"rope_scaling", "rope_theta", "rope_local_base_freq"}) nested.erase(key);
  nested["rope_parameters"] = {
      {"full_attention", {{"rope_type", "linear"}, {"factor", 8.0}, {"rope_theta", 2e6}}},
      {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 20000.0}}}};
  config = MustParse(nested.dump());
  EXPECT_EQ(config.rope_scaling.kind, RopeScaling::Kind::kLinear);
  EXPECT_EQ(config.rope_scaling.factor, 8.0);
  EXPECT_EQ(config.rope_theta, 2e6);
  EXPECT_EQ(config.rope_local_base_freq, 20000.0);

  nested["rope_parameters"]["sliding_attention"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  EXPECT_THAT(ParseModelConfig(nested.dump(), "/m/config.json").status().message(),
              HasSubstr("/m/config.json: rope_parameters.sliding_attention: RoPE scaling on the "
                        "sliding layers is not supported"));
  nested["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}};
  EXPECT_THAT(ParseModelConfig(nested.dump(), "/m/config.json").status().message(),
              HasSubstr("/m/config.json: rope_parameters: expected one object per layer type"));
}

TEST(ModelConfigTest, GemmaJsonRoundTrip) {
  nlohmann::json gemma2_bias = nlohmann::json::parse(kGemma2_2B);
  gemma2_bias["attention_bias"] = true;
  gemma2_bias["final_logit_softcapping"] = nullptr;
  gemma2_bias["tie_word_embeddings"] = false;
  gemma2_bias["pad_token_id"] = nullptr;
  nlohmann::json gemma3_scaled = nlohmann::json::parse(kGemma3_1B);
  gemma3_scaled["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  gemma3_scaled["rope_local_base_freq"] = 20000.0;
  gemma3_scaled["attn_logit_softcapping"] = 40.0;
  gemma3_scaled["sliding_window"] = nullptr;
  for (const std::string& text : {std::string(kGemma2_2B), gemma2_bias.dump(),
                                  std::string(kGemma3_1B), gemma3_scaled.dump()}) {
    ModelConfig original = MustParse(text);
    SCOPED_TRACE(text);
    std::string written = ModelConfigToJson(original);
    absl::StatusOr<ModelConfig> reread = ParseModelConfig(written, "written");
    ASSERT_TRUE(reread.ok()) << reread.status() << "\n" << written;
    ExpectSameConfig(original, *reread);
    nlohmann::json json = nlohmann::json::parse(written);
    EXPECT_EQ(json["hidden_activation"], "gelu_pytorch_tanh");
    EXPECT_FALSE(json.contains("hidden_act"));
    EXPECT_EQ(json["layer_types"].size(), 26u);
  }
}

TEST(ModelConfigTest, ParsesPhi3Mini4k) {
  ModelConfig config = MustParse(kPhi3Mini4k);
  EXPECT_EQ(config.model_type, "phi3");
  EXPECT_EQ(config.architecture, "Phi3ForCausalLM");
  EXPECT_EQ(config.head_dim, 96);
  EXPECT_EQ(config.partial_rotary_factor, 1.0);
  EXPECT_EQ(RotaryDim(config), 96);
  EXPECT_EQ(config.rope_scaling.kind, RopeScaling::Kind::kNone);
  EXPECT_EQ(config.sliding_window, 2047);  // as Mistral's: every layer
  EXPECT_FALSE(config.qkv_bias || config.o_bias || config.mlp_bias || config.qk_norm);
  EXPECT_EQ(config.rms_norm_eps, 1e-5);
  EXPECT_EQ(config.pad_token_id, 32000);
  EXPECT_THAT(ProjectionModules(config),
              ElementsAre("qkv_proj", "o_proj", "gate_up_proj", "down_proj"));

  // Embeddings and head 32064 x 3072 + 32 blocks of 113,252,352 (qkv 3072x9216, o 3072x3072,
  // gate_up 3072x16384, down 8192x3072, 2 norms) + the final norm.
  EXPECT_EQ(ParameterCount(config), 3821079552);  // published: 3.8B
  std::vector<WeightSpec> weights = ExpectedWeights(config);
  ASSERT_EQ(weights.size(), 1u + 32 * 6 + 2);
  std::vector<std::string> layer0;
  for (int i = 1; i <= 6; ++i) layer0.push_back(weights[i].name);
  EXPECT_THAT(layer0, ElementsAre("model.layers.0.input_layernorm.weight",
                                  "model.layers.0.self_attn.qkv_proj.weight",
                                  "model.layers.0.self_attn.o_proj.weight",
                                  "model.layers.0.post_attention_layernorm.weight",
                                  "model.layers.0.mlp.gate_up_proj.weight",
                                  "model.layers.0.mlp.down_proj.weight"));
  EXPECT_THAT(weights[2].shape, ElementsAre(9216, 3072));
  EXPECT_THAT(weights[5].shape, ElementsAre(16384, 3072));
  EXPECT_THAT(weights[6].shape, ElementsAre(3072, 8192));

  // rms_norm_eps defaults to Phi3Config's 1e-5.
  nlohmann::json no_eps = nlohmann::json::parse(kPhi3Mini4k);
  no_eps.erase("rms_norm_eps");
  EXPECT_EQ(MustParse(no_eps.dump()).rms_norm_eps, 1e-5);
}

TEST(ModelConfigTest, ParsesPhi4MiniLongRope) {
  ModelConfig config = MustParse(Phi4Mini().dump());
  EXPECT_EQ(config.head_dim, 128);
  EXPECT_EQ(config.partial_rotary_factor, 0.75);
  EXPECT_EQ(RotaryDim(config), 96);
  EXPECT_TRUE(config.tie_word_embeddings);
  const RopeScaling& rope = config.rope_scaling;
  EXPECT_EQ(rope.kind, RopeScaling::Kind::kLongRope);  // "type": "longrope"
  ASSERT_EQ(rope.short_factor.size(), 48u);
  EXPECT_EQ(rope.short_factor[47], 1.47);
  EXPECT_EQ(rope.long_factor[1], 1.5);
  EXPECT_EQ(rope.original_max_position_embeddings, 4096);
  // factor 131072 / 4096 = 32: sqrt(1 + ln 32 / ln 4096) = sqrt(17 / 12).
  EXPECT_EQ(rope.factor, 32.0);
  EXPECT_DOUBLE_EQ(rope.attention_factor, std::sqrt(17.0 / 12.0));
  EXPECT_EQ(config.sliding_window, 262144);
  // qkv: (24 + 2 x 8) x 128 = 5120 rows.
  EXPECT_EQ(ProjectionShapeOf(config, "qkv_proj").out_features, 5120);
  EXPECT_EQ(ProjectionShapeOf(config, "gate_up_proj").out_features, 16384);
  EXPECT_EQ(ParameterCount(config), 3836021760);  // published: 3.8B
  // A pad_token_id that is no token id is dropped, not refused (LLaMA 1 configs write -1).
  nlohmann::json minus_one = Phi4Mini();
  minus_one["pad_token_id"] = -1;
  EXPECT_EQ(MustParse(minus_one.dump()).pad_token_id, std::nullopt);
  // No pad_token_id: written as null, not left to Phi3Config's default 32000.
  nlohmann::json unpadded = Phi4Mini();
  unpadded.erase("pad_token_id");
  EXPECT_TRUE(nlohmann::json::parse(ModelConfigToJson(MustParse(unpadded.dump())))["pad_token_id"]
                  .is_null());

  // A given factor or attention_factor is used as transformers uses it; the top-level
  // original_max_position_embeddings wins over the scaling object's.
  nlohmann::json json = Phi4Mini();
  json["rope_scaling"]["factor"] = 8.0;
  json["rope_scaling"]["original_max_position_embeddings"] = 2048;
  ModelConfig given = MustParse(json.dump());
  EXPECT_EQ(given.rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(given.rope_scaling.attention_factor,
                   std::sqrt(1 + std::log(8.0) / std::log(4096.0)));
  json["rope_scaling"]["attention_factor"] = 1.25;
  EXPECT_EQ(MustParse(json.dump()).rope_scaling.attention_factor, 1.25);
  // No longer than the original length: no attention scaling.
  json = Phi4Mini();
  json["max_position_embeddings"] = 4096;
  EXPECT_EQ(MustParse(json.dump()).rope_scaling.attention_factor, 1.0);
  // Without the top-level key, Phi3Config's default 4096.
  json = Phi4Mini();
  json.erase("original_max_position_embeddings");
  EXPECT_EQ(MustParse(json.dump()).rope_scaling.original_max_position_embeddings, 4096);
  // "su" (the first Phi-3 128k configs) is LongRoPE.
  json["rope_scaling"]["type"] = "su";
  EXPECT_EQ(MustParse(json.dump()).rope_scaling.kind, RopeScaling::Kind::kLongRope);
  // Transformers 5: everything in rope_parameters.
  json = Phi4Mini();
  json["rope_parameters"] = json["rope_scaling"];
  json["rope_parameters"]["rope_theta"] = 250000.0;
  json["rope_parameters"]["partial_rotary_factor"] = 0.5;
  json["rope_parameters"]["short_factor"] = std::vector<double>(32, 1.0);
  json["rope_parameters"]["long_factor"] = std::vector<double>(32, 2.0);
  json.erase("rope_scaling");
  json.erase("rope_theta");
  ModelConfig five = MustParse(json.dump());
  EXPECT_EQ(five.rope_theta, 250000.0);
  EXPECT_EQ(RotaryDim(five), 64);
  EXPECT_EQ(five.rope_scaling.long_factor.size(), 32u);
}

TEST(ModelConfigTest, Phi3RefusesWhatLatheDoesNotImplement) {
  const std::vector<std::tuple<std::string, std::function<void(nlohmann::json&)>, std::string>>
      cases = {
          {"linear scaling",
           [](auto& j) {
             j["rope_scaling"] = {{"type", "linear"}, {"factor", 2}};
           },
           "rope_scaling.rope_type: unsupported \"linear\" for phi3 (supported: default, "
           "longrope)"},
          {"short factors",
           [](auto& j) {
             j["rope_scaling"]["short_factor"] = {1.0, 2.0};
           },
           "rope_scaling.short_factor: 2 entries for 48 rotary frequencies"},
          {"long factors missing", [](auto& j) { j["rope_scaling"].erase("long_factor"); },
           "rope_scaling.long_factor: required field is missing"},
          {"factor not > 0", [](auto& j) { j["rope_scaling"]["long_factor"][3] = 0; },
           "rope_scaling.long_factor: entry 3: expected a number > 0, got 0"},
          {"odd rotary", [](auto& j) { j["partial_rotary_factor"] = 0.7; },
           "partial_rotary_factor: 0.7 of head_dim 128 rotates 89 features"},
          {"rotary above 1", [](auto& j) { j["partial_rotary_factor"] = 1.5; },
           "partial_rotary_factor: 1.5 of head_dim 128"},
          {"attention_bias", [](auto& j) { j["attention_bias"] = true; },
           "attention_bias: true is not supported for phi3"},
          {"mlp_bias", [](auto& j) { j["mlp_bias"] = true; },
           "mlp_bias: true is not supported for phi3"},
          {"lm_head_bias", [](auto& j) { j["lm_head_bias"] = true; },
           "lm_head_bias: true is not supported for phi3"},
          {"resid_pdrop", [](auto& j) { j["resid_pdrop"] = 0.1; },
           "resid_pdrop: 0.1 is not supported (only 0)"},
          {"attention_dropout", [](auto& j) { j["attention_dropout"] = 0.1; },
           "attention_dropout: 0.1 is not supported (only 0)"},
      };
  for (const auto& [what, edit, message] : cases) {
    SCOPED_TRACE(what);
    nlohmann::json json = Phi4Mini();
    edit(json);
    absl::StatusOr<ModelConfig> config = ParseModelConfig(json.dump(), "/m/config.json");
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(config.status().message()), HasSubstr("/m/config.json: " + message));
  }
  // LongRoPE is Phi-3's only.
  nlohmann::json llama = TinyLlama();
  llama["rope_scaling"] = Phi4Mini()["rope_scaling"];
  EXPECT_THAT(ParseModelConfig(llama.dump(), "c").status().message(),
              HasSubstr("rope_scaling.rope_type: unsupported \"longrope\""));
}

TEST(ModelConfigTest, LoraTargetsAreTheModelsProjections) {
  ModelConfig phi3 = MustParse(kPhi3Mini4k);
  ModelConfig llama = MustParse(TinyLlama().dump());
  EXPECT_THAT(*LoraTargetsOf(phi3, {}),
              ElementsAre("qkv_proj", "o_proj", "gate_up_proj", "down_proj"));
  EXPECT_EQ(*LoraTargetsOf(llama, {}), ProjectionModules(llama));
  // In model order, whatever the spec's order.
  EXPECT_THAT(*LoraTargetsOf(phi3, {"down_proj", "qkv_proj"}),
              ElementsAre("qkv_proj", "down_proj"));
  absl::StatusOr<std::vector<std::string>> wrong = LoraTargetsOf(phi3, {"qkv_proj", "q_proj"});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(wrong.status().message(),
            "lora.targets: \"q_proj\" is not a projection of this phi3 model (its modules: "
            "qkv_proj, o_proj, gate_up_proj, down_proj)");
  EXPECT_THAT(LoraTargetsOf(llama, {"gate_up_proj"}).status().message(),
              HasSubstr("(its modules: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                        "down_proj)"));
}

TEST(ModelConfigTest, Defaults) {
  nlohmann::json json = {{"model_type", "llama"},  {"vocab_size", 10},
                         {"hidden_size", 8},       {"intermediate_size", 12},
                         {"num_hidden_layers", 1}, {"num_attention_heads", 4},
                         {"head_dim", nullptr},    {"max_position_embeddings", 64}};
  ModelConfig config = MustParse(json.dump());
  EXPECT_EQ(config.architecture, "LlamaForCausalLM");
  EXPECT_EQ(config.num_key_value_heads, 4);
  EXPECT_EQ(config.head_dim, 2);
  EXPECT_EQ(config.rms_norm_eps, 1e-6);
  EXPECT_EQ(config.rope_theta, 10000.0);
  EXPECT_EQ(config.rope_scaling.kind, RopeScaling::Kind::kNone);
  EXPECT_FALSE(config.tie_word_embeddings);
  EXPECT_FALSE(config.qkv_bias);
  EXPECT_FALSE(config.o_bias);
  EXPECT_FALSE(config.mlp_bias);
  EXPECT_EQ(config.sliding_window, std::nullopt);
  EXPECT_EQ(config.torch_dtype, "");
}

TEST(ModelConfigTest, RopeScalingVariants) {
  nlohmann::json json = TinyLlama();
  json["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  ModelConfig config = MustParse(json.dump());
  EXPECT_EQ(config.rope_scaling.kind, RopeScaling::Kind::kLinear);
  EXPECT_EQ(config.rope_scaling.factor, 2.0);

  json["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_EQ(MustParse(json.dump()).rope_scaling.kind, RopeScaling::Kind::kNone);

  json["rope_scaling"] = nullptr;
  EXPECT_EQ(MustParse(json.dump()).rope_scaling.kind, RopeScaling::Kind::kNone);
}

// Transformers 5 writes rope_theta and the scaling as one "rope_parameters" object and
// neither at the top (issue #28: such a model was read with theta 10000 and no scaling).
TEST(ModelConfigTest, RopeParametersOfTransformers5) {
  nlohmann::json json = TinyLlama();
  json.erase("rope_theta");
  json.erase("rope_scaling");
  json["rope_parameters"] = {{"rope_type", "llama3"},   {"rope_theta", 500000.0},
                             {"factor", 8.0},           {"low_freq_factor", 1.0},
                             {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  ModelConfig config = MustParse(json.dump());
  EXPECT_EQ(config.rope_theta, 500000.0);
  EXPECT_EQ(config.rope_scaling.kind, RopeScaling::Kind::kLlama3);
  EXPECT_EQ(config.rope_scaling.factor, 8.0);
  EXPECT_EQ(config.rope_scaling.original_max_position_embeddings, 8192);
  json["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}};
  config = MustParse(json.dump());
  EXPECT_EQ(config.rope_theta, 1e6);
  EXPECT_EQ(config.rope_scaling.kind, RopeScaling::Kind::kNone);
  json["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  absl::StatusOr<ModelConfig> yarn = ParseModelConfig(json.dump(), "/m/config.json");
  EXPECT_THAT(yarn.status().message(),
              HasSubstr("rope_parameters.rope_type: unsupported \"yarn\""));
}

TEST(ModelConfigTest, SlidingWindowRules) {
  nlohmann::json mistral = nlohmann::json::parse(kMistral7B);
  mistral["sliding_window"] = nullptr;
  EXPECT_EQ(MustParse(mistral.dump()).sliding_window, std::nullopt);

  // Llama has no sliding window whatever the file says.
  nlohmann::json llama = TinyLlama();
  llama["sliding_window"] = 16;
  EXPECT_EQ(MustParse(llama.dump()).sliding_window, std::nullopt);

  nlohmann::json qwen = nlohmann::json::parse(kQwen25_05B);
  qwen["use_sliding_window"] = true;
  qwen["max_window_layers"] = 0;
  qwen["sliding_window"] = 4096;
  EXPECT_EQ(MustParse(qwen.dump()).sliding_window, 4096);
  // Sliding starts at layer max_window_layers: at or past the last layer, no layer slides.
  qwen["max_window_layers"] = 24;
  EXPECT_EQ(MustParse(qwen.dump()).sliding_window, std::nullopt);
  // Transformers 5's layer_types wins over max_window_layers: all sliding, none, or refused.
  const int layers = qwen["num_hidden_layers"].get<int>();
  qwen["layer_types"] = std::vector<std::string>(layers, "sliding_attention");
  EXPECT_EQ(MustParse(qwen.dump()).sliding_window, 4096);
  qwen["layer_types"] = std::vector<std::string>(layers, "full_attention");
  qwen["max_window_layers"] = 0;
  EXPECT_EQ(MustParse(qwen.dump()).sliding_window, std::nullopt);
  qwen["layer_types"][1] = "sliding_attention";
  absl::StatusOr<ModelConfig> mixed = ParseModelConfig(qwen.dump(), "/m/config.json");
  EXPECT_THAT(mixed.status().message(),
              HasSubstr("layer_types: a sliding window on layers 1 only is not supported"));

  // Qwen3 follows Qwen2's rules.
  nlohmann::json qwen3 = nlohmann::json::parse(kQwen3_06B);
  qwen3["use_sliding_window"] = true;
  qwen3["sliding_window"] = 4096;
  EXPECT_EQ(MustParse(qwen3.dump()).sliding_window, std::nullopt);  // max_window_layers 28
  qwen3["max_window_layers"] = 0;
  EXPECT_EQ(MustParse(qwen3.dump()).sliding_window, 4096);
  qwen3["layer_types"] = std::vector<std::string>(28, "full_attention");
  qwen3["layer_types"][27] = "sliding_attention";
  EXPECT_THAT(ParseModelConfig(qwen3.dump(), "/m/config.json").status().message(),
              HasSubstr("layer_types: a sliding window on layers 27 only is not supported"));
}

TEST(ModelConfigTest, MistralStyleHeadDim) {
  // head_dim * heads need not equal hidden_size.
  nlohmann::json json = TinyLlama();
  json["num_attention_heads"] = 2;
  json["num_key_value_heads"] = 1;
  json["head_dim"] = 6;
  json["attention_bias"] = false;
  json["mlp_bias"] = false;
  ModelConfig config = MustParse(json.dump());
  EXPECT_EQ(config.head_dim, 6);
  EXPECT_EQ(ProjectionShapeOf(config, "q_proj").out_features, 12);
  EXPECT_EQ(ProjectionShapeOf(config, "o_proj").in_features, 12);
  EXPECT_EQ(ProjectionShapeOf(config, "o_proj").out_features, 8);
  EXPECT_EQ(ProjectionShapeOf(config, "k_proj").out_features, 6);
}

TEST(ModelConfigTest, ExpectedWeightsOfTinyModel) {
  ModelConfig config = MustParse(TinyLlama().dump());
  EXPECT_TRUE(config.qkv_bias);
  EXPECT_TRUE(config.o_bias);
  EXPECT_TRUE(config.mlp_bias);

  std::vector<WeightSpec> weights = ExpectedWeights(config);
  std::vector<std::string> names;
  for (const WeightSpec& weight : weights) names.push_back(weight.name);
  const std::vector<std::string> layer0 = {
      "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
      "model.layers.0.self_attn.q_proj.bias",  "model.layers.0.self_attn.k_proj.weight",
      "model.layers.0.self_attn.k_proj.bias",  "model.layers.0.self_attn.v_proj.weight",
      "model.layers.0.self_attn.v_proj.bias",  "model.layers.0.self_attn.o_proj.weight",
      "model.layers.0.self_attn.o_proj.bias",  "model.layers.0.post_attention_layernorm.weight",
      "model.layers.0.mlp.gate_proj.weight",   "model.layers.0.mlp.gate_proj.bias",
      "model.layers.0.mlp.up_proj.weight",     "model.layers.0.mlp.up_proj.bias",
      "model.layers.0.mlp.down_proj.weight",   "model.layers.0.mlp.down_proj.bias",
  };
  ASSERT_EQ(weights.size(), 1 + 2 * layer0.size() + 2);
  EXPECT_EQ(names.front(), "model.embed_tokens.weight");
  EXPECT_EQ(std::vector<std::string>(names.begin() + 1, names.begin() + 17), layer0);
  EXPECT_EQ(names[17], "model.layers.1.input_layernorm.weight");
  EXPECT_EQ(names[names.size() - 2], "model.norm.weight");
  EXPECT_EQ(names.back(), "lm_head.weight");

  // Shapes: V=10, H=8, I=12, 4 heads x 2 dims, 2 KV heads x 2 dims.
  const std::vector<std::vector<int64_t>> layer0_shapes = {
      {8}, {8, 8}, {8},     {4, 8}, {4},     {4, 8}, {4},     {8, 8},
      {8}, {8},    {12, 8}, {12},   {12, 8}, {12},   {8, 12}, {8},
  };
  EXPECT_THAT(weights[0].shape, ElementsAre(10, 8));
  for (size_t i = 0; i < layer0_shapes.size(); ++i) {
    EXPECT_EQ(weights[1 + i].shape, layer0_shapes[i]) << weights[1 + i].name;
  }
  EXPECT_THAT(weights[weights.size() - 2].shape, ElementsAre(8));
  EXPECT_THAT(weights.back().shape, ElementsAre(10, 8));

  // By hand: per layer 2 norms (16) + q 64+8 + k 32+4 + v 32+4 + o 64+8
  // + gate 96+12 + up 96+12 + down 96+8 = 552; embeddings 80, final norm 8, lm_head 80.
  EXPECT_EQ(ParameterCount(config), 80 + 2 * 552 + 8 + 80);

  // Tied embeddings: lm_head disappears and is not counted.
  config.tie_word_embeddings = true;
  EXPECT_EQ(ExpectedWeights(config).back().name, "model.norm.weight");
  EXPECT_EQ(ParameterCount(config), 80 + 2 * 552 + 8);
}

TEST(ModelConfigTest, ProjectionNamesAndShapes) {
  EXPECT_EQ(ProjectionName(3, "q_proj"), "model.layers.3.self_attn.q_proj");
  EXPECT_EQ(ProjectionName(0, "o_proj"), "model.layers.0.self_attn.o_proj");
  EXPECT_EQ(ProjectionName(12, "up_proj"), "model.layers.12.mlp.up_proj");
  EXPECT_EQ(ProjectionName(1, "down_proj"), "model.layers.1.mlp.down_proj");

  EXPECT_EQ(ProjectionName(2, "qkv_proj"), "model.layers.2.self_attn.qkv_proj");
  EXPECT_EQ(ProjectionName(2, "gate_up_proj"), "model.layers.2.mlp.gate_up_proj");

  ModelConfig config = MustParse(TinyLlama().dump());
  EXPECT_THAT(ProjectionModules(config), ElementsAre("q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj"));
  EXPECT_TRUE(IsProjectionModule("gate_proj"));
  EXPECT_TRUE(IsProjectionModule("qkv_proj"));
  EXPECT_TRUE(IsProjectionModule("gate_up_proj"));
  EXPECT_FALSE(IsProjectionModule("qproj"));
  EXPECT_FALSE(IsProjectionModule("lm_head"));
  EXPECT_FALSE(IsProjectionModule(""));

  auto shape = [&](const char* module) {
    ProjectionShape s = ProjectionShapeOf(config, module);
    return std::vector<int64_t>{s.in_features, s.out_features};
  };
  EXPECT_THAT(shape("q_proj"), ElementsAre(8, 8));
  EXPECT_THAT(shape("k_proj"), ElementsAre(8, 4));
  EXPECT_THAT(shape("v_proj"), ElementsAre(8, 4));
  EXPECT_THAT(shape("o_proj"), ElementsAre(8, 8));
  EXPECT_THAT(shape("gate_proj"), ElementsAre(8, 12));
  EXPECT_THAT(shape("up_proj"), ElementsAre(8, 12));
  EXPECT_THAT(shape("down_proj"), ElementsAre(12, 8));
  // Phi-3's fused projections: q, k and v rows; gate and up rows.
  EXPECT_THAT(shape("qkv_proj"), ElementsAre(8, 16));
  EXPECT_THAT(shape("gate_up_proj"), ElementsAre(8, 24));
}

TEST(ModelConfigTest, JsonRoundTrip) {
  nlohmann::json linear = TinyLlama();
  linear["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 4.0}};
  linear["torch_dtype"] = "float32";
  nlohmann::json qwen_sliding = nlohmann::json::parse(kQwen25_05B);
  qwen_sliding["use_sliding_window"] = true;
  qwen_sliding["max_window_layers"] = 0;
  qwen_sliding["sliding_window"] = 1024;
  nlohmann::json qwen3_bias_window = nlohmann::json::parse(kQwen3_06B);
  qwen3_bias_window["attention_bias"] = true;
  qwen3_bias_window["use_sliding_window"] = true;
  qwen3_bias_window["max_window_layers"] = 0;
  qwen3_bias_window["sliding_window"] = 512;
  nlohmann::json mistral_no_window = nlohmann::json::parse(kMistral7B);
  mistral_no_window["sliding_window"] = nullptr;
  mistral_no_window["head_dim"] = 96;

  for (const std::string& text :
       {std::string(kLlama32_1B), std::string(kMistral7B), std::string(kQwen25_05B), linear.dump(),
        qwen_sliding.dump(), mistral_no_window.dump(), std::string(kQwen3_06B),
        qwen3_bias_window.dump(), std::string(kPhi3Mini4k), Phi4Mini().dump()}) {
    ModelConfig original = MustParse(text);
    SCOPED_TRACE(original.model_type);
    std::string written = ModelConfigToJson(original);
    absl::StatusOr<ModelConfig> reread = ParseModelConfig(written, "written");
    ASSERT_TRUE(reread.ok()) << reread.status() << "\n" << written;
    ExpectSameConfig(original, *reread);

    // Hugging Face keys that transformers reads.
    nlohmann::json json = nlohmann::json::parse(written);
    EXPECT_EQ(json["architectures"], nlohmann::json::array({original.architecture}));
    EXPECT_EQ(json["hidden_act"], "silu");
    EXPECT_EQ(json["num_key_value_heads"], original.num_key_value_heads);
  }
  // use_sliding_window is written for qwen2.
  nlohmann::json qwen = nlohmann::json::parse(ModelConfigToJson(MustParse(qwen_sliding.dump())));
  EXPECT_EQ(qwen["use_sliding_window"], true);
  EXPECT_EQ(qwen["sliding_window"], 1024);
}

TEST(ModelConfigTest, SpecialTokenIds) {
  ModelConfig llama = MustParse(kLlama32_1B);
  EXPECT_EQ(llama.bos_token_id, 128000);
  EXPECT_THAT(llama.eos_token_ids, ElementsAre(128001));

  // Llama 3.1 Instruct lists three end tokens; a list of bos ids keeps the first.
  nlohmann::json instruct = nlohmann::json::parse(kLlama32_1B);
  instruct["eos_token_id"] = {128001, 128008, 128009};
  instruct["bos_token_id"] = {128000, 5};
  ModelConfig config = MustParse(instruct.dump());
  EXPECT_EQ(config.bos_token_id, 128000);
  EXPECT_THAT(config.eos_token_ids, ElementsAre(128001, 128008, 128009));
  nlohmann::json written = nlohmann::json::parse(ModelConfigToJson(config));
  EXPECT_EQ(written["bos_token_id"], 128000);
  EXPECT_EQ(written["eos_token_id"], nlohmann::json::array({128001, 128008, 128009}));

  // Null and absent mean unknown, and are not written back.
  nlohmann::json none = TinyLlama();
  none["bos_token_id"] = nullptr;
  config = MustParse(none.dump());
  EXPECT_EQ(config.bos_token_id, std::nullopt);
  EXPECT_TRUE(config.eos_token_ids.empty());
  written = nlohmann::json::parse(ModelConfigToJson(config));
  EXPECT_FALSE(written.contains("bos_token_id"));
  EXPECT_FALSE(written.contains("eos_token_id"));
}

TEST(ModelConfigTest, ToJsonFillsArchitectureFromModelType) {
  ModelConfig config = MustParse(kMistral7B);
  config.architecture.clear();
  nlohmann::json json = nlohmann::json::parse(ModelConfigToJson(config));
  EXPECT_EQ(json["architectures"], nlohmann::json::array({"MistralForCausalLM"}));
}

struct ErrorCase {
  std::string description;
  std::function<void(nlohmann::json&)> mutate;
  std::string fragment;
};

TEST(ModelConfigTest, RejectsBadConfigs) {
  using Json = nlohmann::json;
  const std::vector<ErrorCase> cases = {
      {"missing model_type", [](Json& j) { j.erase("model_type"); },
       "/m/config.json: model_type: required field is missing"},
      {"unsupported model_type", [](Json& j) { j["model_type"] = "gpt2"; },
       "/m/config.json: model_type: unsupported \"gpt2\" (supported: llama, mistral, qwen2, "
       "qwen3, gemma2, gemma3_text, phi3)"},
      {"heads do not divide hidden without head_dim",
       [](Json& j) {
         j["num_attention_heads"] = 6;
         j["num_key_value_heads"] = 6;
         j.erase("head_dim");
       },
       "/m/config.json: hidden_size: 8 is not divisible by num_attention_heads 6 and head_dim is "
       "not given"},
      {"vocab_size not an integer", [](Json& j) { j["vocab_size"] = "many"; },
       "/m/config.json: vocab_size: expected an integer, got \"many\""},
      {"model_type not a string", [](Json& j) { j["model_type"] = 7; },
       "/m/config.json: model_type: expected a string, got 7"},
      {"hidden_act", [](Json& j) { j["hidden_act"] = "gelu"; },
       "/m/config.json: hidden_act: unsupported \"gelu\""},
      {"missing vocab_size", [](Json& j) { j.erase("vocab_size"); },
       "/m/config.json: vocab_size: required field is missing"},
      {"zero hidden_size", [](Json& j) { j["hidden_size"] = 0; },
       "/m/config.json: hidden_size: must be > 0, got 0"},
      {"negative intermediate_size", [](Json& j) { j["intermediate_size"] = -12; },
       "/m/config.json: intermediate_size: must be > 0, got -12"},
      {"a billion layers", [](Json& j) { j["num_hidden_layers"] = 1000000000; },
       "/m/config.json: num_hidden_layers: must be <= 4096, got 1000000000"},
      {"a huge vocabulary", [](Json& j) { j["vocab_size"] = int64_t{1} << 40; },
       "/m/config.json: vocab_size: must be <= 16777216, got 1099511627776"},
      {"string num_hidden_layers", [](Json& j) { j["num_hidden_layers"] = "two"; },
       "/m/config.json: num_hidden_layers: expected an integer, got \"two\""},
      {"fractional num_attention_heads", [](Json& j) { j["num_attention_heads"] = 1.5; },
       "/m/config.json: num_attention_heads: expected an integer, got 1.5"},
      {"huge vocab_size", [](Json& j) { j["vocab_size"] = 18446744073709551615ull; },
       "/m/config.json: vocab_size: 18446744073709551615 is out of range"},
      {"kv heads do not divide",
       [](Json& j) {
         j["num_attention_heads"] = 8;
         j["num_key_value_heads"] = 3;
       },
       "/m/config.json: num_key_value_heads: 3 does not divide num_attention_heads 8"},
      {"zero kv heads", [](Json& j) { j["num_key_value_heads"] = 0; },
       "/m/config.json: num_key_value_heads: must be > 0, got 0"},
      {"zero head_dim", [](Json& j) { j["head_dim"] = 0; },
       "/m/config.json: head_dim: must be > 0, got 0"},
      {"odd head_dim", [](Json& j) { j["head_dim"] = 3; },
       "/m/config.json: head_dim: 3 must be even"},
      {"hidden not divisible by heads", [](Json& j) { j["hidden_size"] = 10; },
       "/m/config.json: hidden_size: 10 is not divisible by num_attention_heads 4"},
      {"missing max_position_embeddings", [](Json& j) { j.erase("max_position_embeddings"); },
       "/m/config.json: max_position_embeddings: required field is missing"},
      {"zero rms_norm_eps", [](Json& j) { j["rms_norm_eps"] = 0.0; },
       "/m/config.json: rms_norm_eps: must be > 0"},
      {"string rope_theta", [](Json& j) { j["rope_theta"] = "1e4"; },
       "/m/config.json: rope_theta: expected a number, got \"1e4\""},
      {"negative rope_theta", [](Json& j) { j["rope_theta"] = -1; },
       "/m/config.json: rope_theta: must be > 0, got -1"},
      {"rope_scaling not an object", [](Json& j) { j["rope_scaling"] = 2; },
       "/m/config.json: rope_scaling: expected an object or null, got 2"},
      {"unknown rope type",
       [](Json& j) {
         j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
       },
       "/m/config.json: rope_scaling.rope_type: unsupported \"yarn\" (supported: default, "
       "linear, llama3)"},
      {"unknown legacy rope type",
       [](Json& j) {
         j["rope_scaling"] = {{"type", "dynamic"}, {"factor", 4.0}};
       },
       "/m/config.json: rope_scaling.rope_type: unsupported \"dynamic\""},
      {"rope type missing",
       [](Json& j) {
         j["rope_scaling"] = {{"factor", 4.0}};
       },
       "/m/config.json: rope_scaling.rope_type: required field is missing"},
      {"linear without factor",
       [](Json& j) {
         j["rope_scaling"] = {{"rope_type", "linear"}};
       },
       "/m/config.json: rope_scaling.factor: required field is missing"},
      {"linear factor below 1",
       [](Json& j) {
         j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 0.5}};
       },
       "/m/config.json: rope_scaling.factor: must be >= 1, got 0.5"},
      {"llama3 without low_freq_factor",
       [](Json& j) {
         j["rope_scaling"] = {{"rope_type", "llama3"},
                              {"factor", 8.0},
                              {"high_freq_factor", 4.0},
                              {"original_max_position_embeddings", 8192}};
       },
       "/m/config.json: rope_scaling.low_freq_factor: required field is missing"},
      {"llama3 high <= low",
       [](Json& j) {
         j["rope_scaling"] = {{"rope_type", "llama3"},
                              {"factor", 8.0},
                              {"low_freq_factor", 4.0},
                              {"high_freq_factor", 1.0},
                              {"original_max_position_embeddings", 8192}};
       },
       "/m/config.json: rope_scaling.high_freq_factor: must be > low_freq_factor 4, got 1"},
      {"llama3 without original length",
       [](Json& j) {
         j["rope_scaling"] = {{"rope_type", "llama3"},
                              {"factor", 8.0},
                              {"low_freq_factor", 1.0},
                              {"high_freq_factor", 4.0}};
       },
       "/m/config.json: rope_scaling.original_max_position_embeddings: required field is missing"},
      {"llama3 zero original length",
       [](Json& j) {
         j["rope_scaling"] = {{"rope_type", "llama3"},
                              {"factor", 8.0},
                              {"low_freq_factor", 1.0},
                              {"high_freq_factor", 4.0},
                              {"original_max_position_embeddings", 0}};
       },
       "/m/config.json: rope_scaling.original_max_position_embeddings: must be > 0, got 0"},
      {"tie_word_embeddings not bool", [](Json& j) { j["tie_word_embeddings"] = "yes"; },
       "/m/config.json: tie_word_embeddings: expected true or false, got \"yes\""},
      {"attention_bias not bool", [](Json& j) { j["attention_bias"] = 1; },
       "/m/config.json: attention_bias: expected true or false, got 1"},
      {"architectures not a list", [](Json& j) { j["architectures"] = "LlamaForCausalLM"; },
       "/m/config.json: architectures: expected a list of strings, got \"LlamaForCausalLM\""},
      {"torch_dtype not a string", [](Json& j) { j["torch_dtype"] = 16; },
       "/m/config.json: torch_dtype: expected a string, got 16"},
      {"mistral zero sliding_window",
       [](Json& j) {
         j["model_type"] = "mistral";
         j["sliding_window"] = 0;
       },
       "/m/config.json: sliding_window: must be > 0, got 0"},
      {"qwen2 use_sliding_window not bool",
       [](Json& j) {
         j["model_type"] = "qwen2";
         j["use_sliding_window"] = "true";
       },
       "/m/config.json: use_sliding_window: expected true or false, got \"true\""},
      {"qwen2 window on some layers only",
       [](Json& j) {
         j["model_type"] = "qwen2";
         j["use_sliding_window"] = true;
         j["sliding_window"] = 16;
         j["max_window_layers"] = 1;
       },
       "/m/config.json: max_window_layers: sliding window on layers 1..1 only is not supported"},
  };
  const std::vector<ErrorCase> token_cases = {
      {"eos not an integer", [](Json& j) { j["eos_token_id"] = "2"; },
       "/m/config.json: eos_token_id: expected an integer or a list of integers, got \"2\""},
      {"eos list with a string",
       [](Json& j) {
         j["eos_token_id"] = {1, "x"};
       },
       "/m/config.json: eos_token_id: expected an integer or a list of integers, got [1,\"x\"]"},
      {"bos outside the vocabulary", [](Json& j) { j["bos_token_id"] = 10; },
       "/m/config.json: bos_token_id: 10 is not a token id (vocab_size 10)"},
      {"negative eos",
       [](Json& j) {
         j["eos_token_id"] = {2, -1};
       },
       "/m/config.json: eos_token_id: -1 is not a token id (vocab_size 10)"},
  };
  std::vector<ErrorCase> all_cases = cases;
  all_cases.insert(all_cases.end(), token_cases.begin(), token_cases.end());
  for (const ErrorCase& c : all_cases) {
    SCOPED_TRACE(c.description);
    nlohmann::json json = TinyLlama();
    c.mutate(json);
    absl::StatusOr<ModelConfig> config = ParseModelConfig(json.dump(), kSource);
    ASSERT_FALSE(config.ok());
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(config.status().message()), HasSubstr(c.fragment));
  }
}

// Mixture-of-experts configs are refused by their expert count, whatever their model_type
// (Mixtral, Qwen2-MoE and Qwen3-MoE as published): one line naming the key, at submit too.
TEST(ModelConfigTest, RefusesMixtureOfExpertsByTheirKey) {
  using Json = nlohmann::json;
  const std::vector<ErrorCase> cases = {
      {"mixtral",
       [](Json& j) {
         j["model_type"] = "mixtral";
         j["num_local_experts"] = 8;
       },
       "/m/config.json: num_local_experts: 8: mixture-of-experts models are not supported"},
      {"qwen2_moe",
       [](Json& j) {
         j["model_type"] = "qwen2_moe";
         j["num_experts"] = 60;
         j["num_experts_per_tok"] = 4;
         j["moe_intermediate_size"] = 1408;
         j["shared_expert_intermediate_size"] = 5632;
       },
       "/m/config.json: num_experts: 60: mixture-of-experts models are not supported"},
      {"qwen3_moe",
       [](Json& j) {
         j["model_type"] = "qwen3_moe";
         j["num_experts"] = 128;
         j["num_experts_per_tok"] = 8;
         j["moe_intermediate_size"] = 768;
       },
       "/m/config.json: num_experts: 128: mixture-of-experts models are not supported"},
  };
  for (const ErrorCase& c : cases) {
    SCOPED_TRACE(c.description);
    nlohmann::json json = TinyLlama();
    c.mutate(json);
    absl::StatusOr<ModelConfig> config = ParseModelConfig(json.dump(), kSource);
    ASSERT_FALSE(config.ok());
    EXPECT_EQ(config.status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_THAT(std::string(config.status().message()), HasSubstr(c.fragment));
    EXPECT_EQ(std::string(config.status().message()).find('\n'), std::string::npos);
  }
}

// What the engine does not implement is refused, naming the key.
TEST(ModelConfigTest, RejectsGemmaSettingsItDoesNotImplement) {
  using Json = nlohmann::json;
  const std::vector<ErrorCase> cases = {
      {"multimodal gemma3", [](Json& j) { j["model_type"] = "gemma3"; },
       "/m/config.json: model_type: \"gemma3\" is the multimodal Gemma 3: only its text model "
       "(model_type gemma3_text, Gemma3ForCausalLM) is supported"},
      {"another activation", [](Json& j) { j["hidden_activation"] = "gelu"; },
       "/m/config.json: hidden_activation: unsupported \"gelu\" (only gelu_pytorch_tanh)"},
      {"bidirectional", [](Json& j) { j["use_bidirectional_attention"] = true; },
       "/m/config.json: use_bidirectional_attention: bidirectional attention is not supported"},
      {"attention dropout", [](Json& j) { j["attention_dropout"] = 0.1; },
       "/m/config.json: attention_dropout: attention dropout is not supported (0 only), got 0.1"},
      {"negative softcap", [](Json& j) { j["attn_logit_softcapping"] = -1.0; },
       "/m/config.json: attn_logit_softcapping: must be > 0 or null, got -1"},
      {"zero query_pre_attn_scalar", [](Json& j) { j["query_pre_attn_scalar"] = 0; },
       "/m/config.json: query_pre_attn_scalar: must be > 0, got 0"},
      {"pad outside the vocabulary", [](Json& j) { j["pad_token_id"] = 256000; },
       "/m/config.json: pad_token_id: 256000 is not a token id (vocab_size 256000)"},
      {"zero window", [](Json& j) { j["sliding_window"] = 0; },
       "/m/config.json: sliding_window: must be > 0, got 0"},
      {"layer_types too short", [](Json& j) { j["layer_types"] = {"full_attention"}; },
       "/m/config.json: layer_types: 1 entries for 26 layers"},
      {"unknown layer type", [](Json& j) { j["layer_types"] = {"chunked_attention"}; },
       "/m/config.json: layer_types: entry 0: expected \"full_attention\" or "
       "\"sliding_attention\", got \"chunked_attention\""},
  };
  for (const ErrorCase& c : cases) {
    SCOPED_TRACE(c.description);
    nlohmann::json json = nlohmann::json::parse(kGemma2_2B);
    c.mutate(json);
    absl::StatusOr<ModelConfig> config = ParseModelConfig(json.dump(), kSource);
    ASSERT_FALSE(config.ok());
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(config.status().message()), HasSubstr(c.fragment));
  }
}

TEST(ModelConfigTest, RejectsMalformedJson) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig("{\"model_type\": ", kSource);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("/m/config.json: malformed JSON"));

  config = ParseModelConfig("[1, 2]", kSource);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(config.status().message()),
              HasSubstr("/m/config.json: expected a JSON object at the top level, got [1,2]"));

  config = ParseModelConfig("", kSource);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("/m/config.json: malformed JSON"));
}

TEST(ModelConfigTest, LoadsFromDirectory) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / "model_config_test_load";
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir / "config.json");
    out << kMistral7B;
  }
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir.string());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->sliding_window, 4096);

  // Errors name the file.
  {
    std::ofstream out(dir / "config.json");
    out << R"({"model_type": "bert"})";
  }
  config = LoadModelConfig(dir.string() + "/");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(config.status().message()),
              HasSubstr((dir / "config.json").string() + ": model_type: unsupported"));
  std::filesystem::remove_all(dir);
}

TEST(ModelConfigTest, LoadReportsMissingFile) {
  const std::string dir = ::testing::TempDir() + "/model_config_test_no_such_dir";
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("config.json"));
}

}  // namespace
}  // namespace lathe
