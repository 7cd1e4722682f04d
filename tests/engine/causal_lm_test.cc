#include "worker/engine/causal_lm.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/matmul.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tiny_model.h"
#include "worker/tools/synthetic.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

// The shared tiny architecture, with room for longer test sequences.
ModelConfig TinyConfig(const std::string& type = "llama") {
  ModelConfig c = testing::TinyModelConfig(type);
  c.max_position_embeddings = 128;
  return c;
}

// A tiny Phi-3 rotating `partial` of each head, with LongRoPE when `original` > 0.
ModelConfig TinyPhi3(double partial, int64_t original = 0) {
  ModelConfig c = TinyConfig("phi3");
  c.partial_rotary_factor = partial;
  if (original > 0) {
    RopeScaling& rope = c.rope_scaling;
    rope.kind = RopeScaling::Kind::kLongRope;
    rope.original_max_position_embeddings = original;
    for (int64_t i = 0; i < RotaryDim(c) / 2; ++i) {
      rope.short_factor.push_back(1.0 + 0.25 * static_cast<double>(i));
      rope.long_factor.push_back(2.0 + 3.0 * static_cast<double>(i));
    }
    rope.attention_factor = 1.125;
  }
  return c;
}

std::unique_ptr<CausalLm> LoadModel(const TempDir& dir, const ModelConfig& config,
                                    DType dtype = DType::kF32, bool trainable = false,
                                    const ModelOptions& options = {}) {
  if (!std::filesystem::exists(dir.Path("model"))) {
    absl::Status written = WriteSyntheticModel(config, dtype, 1, 1, dir.Path("model"));
    EXPECT_TRUE(written.ok()) << written;
  }
  absl::StatusOr<std::unique_ptr<CausalLm>> model =
      CausalLm::Load(dir.Path("model"), config, trainable, options);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? *std::move(model) : nullptr;
}

at::Tensor Ids(int64_t batch, int64_t seq, int64_t vocab, uint64_t seed = 0) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(vocab, {batch, seq}, generator, at::kLong);
}

TEST(CausalLm, FreshLoraLeavesTheModelUnchanged) {
  TempDir dir;
  ModelConfig config = TinyConfig();
  auto model = LoadModel(dir, config);
  at::Tensor ids = Ids(2, 10, config.vocab_size);
  at::Tensor before = model->Logits(ids);
  LoraSpec lora;
  lora.rank = 4;
  model->InitLora(lora, 0);
  EXPECT_TRUE(at::equal(before, model->Logits(ids)));
  EXPECT_EQ(model->TrainableParameters().size(), 2u * 7 * 2);
  for (const NamedParameter& p : model->TrainableParameters()) {
    if (absl::EndsWith(p.name, "lora_B.weight")) {
      EXPECT_EQ(p.tensor.abs().max().item<float>(), 0.0f) << p.name;
    } else {
      float bound = 1.0f / std::sqrt(static_cast<float>(p.tensor.size(1)));
      EXPECT_LE(p.tensor.abs().max().item<float>(), bound) << p.name;
      EXPECT_GT(p.tensor.abs().max().item<float>(), bound * 0.5f) << p.name;
    }
  }
}

TEST(CausalLm, LoraEqualsTheMergedWeights) {
  TempDir dir;
  ModelConfig config = TinyConfig("qwen2");
  auto model = LoadModel(dir, config);
  LoraSpec lora;
  lora.rank = 3;
  lora.alpha = 6;
  model->InitLora(lora, 5);
  std::map<std::string, at::Tensor> deltas;  // HF weight name -> s * B A
  {
    at::NoGradGuard no_grad;
    std::vector<NamedParameter> params = model->TrainableParameters();
    for (size_t i = 0; i < params.size(); i += 2) {
      at::Tensor a = params[i].tensor, b = params[i + 1].tensor;
      b.uniform_(-0.1, 0.1);
      std::string name = params[i].name;  // base_model.model.<hf>.lora_A.weight
      name = name.substr(std::string("base_model.model.").size());
      name = name.substr(0, name.size() - std::string("lora_A.weight").size()) + "weight";
      deltas[name] = at::matmul(b, a) * (6.0 / 3.0);
    }
  }
  TempDir merged_dir;
  auto merged = LoadModel(merged_dir, config, DType::kF32, /*trainable=*/true);
  {
    at::NoGradGuard no_grad;
    for (NamedParameter& p : merged->TrainableParameters()) {
      if (deltas.count(p.name)) p.tensor.add_(deltas[p.name]);
    }
  }
  at::Tensor ids = Ids(2, 12, config.vocab_size, 3);
  EXPECT_TRUE(at::allclose(model->Logits(ids), merged->Logits(ids), 1e-4, 1e-5));
}

TEST(CausalLm, AttentionIsCausalAndRespectsTheSlidingWindow) {
  TempDir dir;
  ModelConfig config = TinyConfig("mistral");
  config.num_hidden_layers = 1;  // one layer: the receptive field is exactly the window
  config.sliding_window = 4;
  auto model = LoadModel(dir, config);
  at::Tensor ids = Ids(1, 12, config.vocab_size, 1);
  at::Tensor changed = ids.clone();
  changed[0][0] = (ids[0][0].item<int64_t>() + 1) % config.vocab_size;
  changed[0][11] = (ids[0][11].item<int64_t>() + 1) % config.vocab_size;
  at::Tensor a = model->Logits(ids)[0], b = model->Logits(changed)[0];
  // Position 0 sees token 0; positions 1-3 see it within the window; 4-10 do not, and no
  // position before 11 sees token 11.
  EXPECT_FALSE(at::allclose(a[3], b[3]));
  EXPECT_TRUE(at::equal(a.slice(0, 4, 11), b.slice(0, 4, 11)));
}

TEST(CausalLm, LoadsHalfPrecisionFilesAsFloat32) {
  TempDir dir;
  ModelConfig config = TinyConfig();
  config.tie_word_embeddings = true;
  auto bf16 = LoadModel(dir, config, DType::kBF16);
  ASSERT_NE(bf16, nullptr);
  at::Tensor logits = bf16->Logits(Ids(1, 5, config.vocab_size));
  EXPECT_EQ(logits.scalar_type(), at::kFloat);
  EXPECT_TRUE(logits.isfinite().all().item<bool>());
}

// Loss and gradients of the trainable tensors after one backward of SumLoss.
struct LossAndGrads {
  double loss;
  std::vector<at::Tensor> grads;
};

LossAndGrads Backward(CausalLm& model, const at::Tensor& ids, uint64_t dropout_seed) {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_current_seed(dropout_seed);
  }
  at::Tensor loss = model.SumLoss(ids, ids);
  loss.backward();
  LossAndGrads out{loss.item<double>(), {}};
  for (NamedParameter& p : model.TrainableParameters()) {
    out.grads.push_back(p.tensor.grad().clone());
    p.tensor.mutable_grad().reset();
  }
  return out;
}

// Backward of `ids` through `first` and `second` (the same weights, other options): the same
// loss (1e-5 relative) and gradients (allclose 1e-4, 1e-5), each named in a failure. Returns
// `first`'s.
LossAndGrads ExpectSameBackward(CausalLm& first, CausalLm& second, const at::Tensor& ids) {
  LossAndGrads a = Backward(first, ids, 1);
  LossAndGrads b = Backward(second, ids, 1);
  EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::abs(b.loss));
  const std::vector<NamedParameter> params = first.TrainableParameters();
  EXPECT_EQ(a.grads.size(), b.grads.size());
  EXPECT_EQ(a.grads.size(), params.size());
  for (size_t i = 0; i < std::min(a.grads.size(), b.grads.size()); ++i) {
    EXPECT_TRUE(at::allclose(a.grads[i], b.grads[i], 1e-4, 1e-5))
        << (i < params.size() ? params[i].name : std::to_string(i));
  }
  return a;
}

TEST(CausalLm, ActivationCheckpointingGivesTheSameGradients) {
  // qwen2: q/k/v biases; qwen3: RMSNorm on q and k (trainable in full fine-tuning); gemma2
  // and gemma3_text: four norms a block, sliding and global layers (their own masks, and for
  // Gemma 3 their own RoPE tables). phi3: fused qkv_proj and gate_up_proj, half of each head
  // rotated, LongRoPE's long factors (16 positions beyond its original 8).
  for (const auto& [type, full] :
       {std::pair{"qwen2", false}, std::pair{"qwen2", true}, std::pair{"qwen3", false},
        std::pair{"qwen3", true}, std::pair{"gemma2", false}, std::pair{"gemma2", true},
        std::pair{"gemma3_text", false}, std::pair{"gemma3_text", true}, std::pair{"phi3", false},
        std::pair{"phi3", true}}) {
    SCOPED_TRACE(absl::StrCat(type, full ? ": full fine-tuning" : ": LoRA with dropout"));
    TempDir dir;
    ModelConfig config = TinyConfig(type);
    if (config.model_type == "phi3") config = TinyPhi3(0.5, /*original=*/8);
    ModelOptions checkpointed;
    checkpointed.activation_checkpointing = true;
    auto plain = LoadModel(dir, config, DType::kF32, full);
    auto recomputed = LoadModel(dir, config, DType::kF32, full, checkpointed);
    if (!full) {
      LoraSpec lora;
      lora.rank = 4;
      lora.dropout = 0.25;  // the recomputation must replay the same dropout masks
      plain->InitLora(lora, 2);
      recomputed->InitLora(lora, 2);
      for (CausalLm* m : {plain.get(), recomputed.get()}) {
        at::NoGradGuard no_grad;
        for (NamedParameter& p : m->TrainableParameters()) {
          if (absl::EndsWith(p.name, "lora_B.weight")) p.tensor.fill_(0.05);
        }
      }
    }
    plain->set_training(true);
    recomputed->set_training(true);
    at::Tensor ids = Ids(2, 16, config.vocab_size, 4);
    LossAndGrads a = Backward(*plain, ids, 7);
    LossAndGrads b = Backward(*recomputed, ids, 7);
    EXPECT_EQ(a.loss, b.loss);
    ASSERT_EQ(a.grads.size(), b.grads.size());
    ASSERT_FALSE(a.grads.empty());
    for (size_t i = 0; i < a.grads.size(); ++i) {
      EXPECT_TRUE(at::equal(a.grads[i], b.grads[i]))
          << "gradient " << i << " differs by " << (a.grads[i] - b.grads[i]).abs().max();
    }
    // A different dropout seed gives different gradients: the masks do matter above.
    if (!full) {
      LossAndGrads c = Backward(*recomputed, ids, 8);
      EXPECT_NE(a.loss, c.loss);
    }
  }
}

// From common/plan.h's kCpuFusedAttentionMinTokens tokens the CPU's attention is libtorch's
// fused scaled_dot_product_attention (no mask without a sliding window, an additive mask with
// one): its loss and gradients are the explicit softmax's (the unfused model's) within
// float32 rounding, and activation checkpointing recomputes them exactly.
TEST(CausalLm, FusedAttentionMatchesTheExplicitSoftmaxAndRecomputesExactly) {
  const int64_t seq = kCpuFusedAttentionMinTokens + 16;
  // gemma3_text: a sliding and a global layer, scores scaled by query_pre_attn_scalar^-0.5.
  for (const std::string type : {"llama", "mistral", "gemma3_text"}) {
    SCOPED_TRACE(type);
    TempDir dir;
    ModelConfig config = TinyConfig(type);
    config.max_position_embeddings = 2 * seq;
    if (type != "llama") config.sliding_window = seq / 3;
    ModelOptions unfused, checkpointed;
    unfused.fused_kernels = false;
    checkpointed.activation_checkpointing = true;
    auto fused = LoadModel(dir, config, DType::kF32, /*trainable=*/true);
    auto explicit_softmax = LoadModel(dir, config, DType::kF32, /*trainable=*/true, unfused);
    auto recomputed = LoadModel(dir, config, DType::kF32, /*trainable=*/true, checkpointed);
    for (CausalLm* m : {fused.get(), explicit_softmax.get(), recomputed.get()}) {
      m->set_training(true);
    }
    const at::Tensor ids = Ids(1, seq, config.vocab_size, 6);
    const LossAndGrads a = Backward(*fused, ids, 1);
    const LossAndGrads b = Backward(*explicit_softmax, ids, 1);
    const LossAndGrads c = Backward(*recomputed, ids, 1);
    EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::abs(b.loss));
    EXPECT_EQ(a.loss, c.loss);
    ASSERT_EQ(a.grads.size(), b.grads.size());
    for (size_t i = 0; i < a.grads.size(); ++i) {
      const double scale = b.grads[i].abs().max().item<double>();
      EXPECT_LE((a.grads[i] - b.grads[i]).abs().max().item<double>(), 1e-4 * scale)
          << "gradient " << i;
      EXPECT_TRUE(at::equal(a.grads[i], c.grads[i])) << "gradient " << i;
    }
  }
}

TEST(CausalLm, Bf16WeightsComputeLikeFloat32OnTheRoundedWeights) {
  TempDir dir;
  ModelConfig config = TinyConfig();
  // The file holds bf16 values, so float32 loading is exact: both models hold the same
  // numbers, one widened at load time and one stored as bf16 and widened as used.
  ModelOptions bf16;
  bf16.weight_dtype = at::kBFloat16;
  auto wide = LoadModel(dir, config, DType::kBF16);
  auto narrow = LoadModel(dir, config, DType::kBF16, false, bf16);
  LoraSpec lora;
  lora.rank = 4;
  wide->InitLora(lora, 3);
  narrow->InitLora(lora, 3);
  for (CausalLm* m : {wide.get(), narrow.get()}) {
    at::NoGradGuard no_grad;
    for (NamedParameter& p : m->TrainableParameters()) {
      EXPECT_EQ(p.tensor.scalar_type(), at::kFloat) << p.name;  // masters stay float32
      if (absl::EndsWith(p.name, "lora_B.weight")) p.tensor.fill_(0.05);
    }
  }
  at::Tensor ids = Ids(2, 12, config.vocab_size, 5);
  LossAndGrads a = Backward(*wide, ids, 0);
  LossAndGrads b = Backward(*narrow, ids, 0);
  if (!kernels::cpu::NativeBFloat16Products()) {
    EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::abs(a.loss));
    for (size_t i = 0; i < a.grads.size(); ++i) {
      EXPECT_TRUE(at::allclose(a.grads[i], b.grads[i], 1e-5, 1e-7)) << "gradient " << i;
    }
    return;
  }
  // Where the CPU multiplies bfloat16, the products round their operands to bf16: the loss's
  // against the bf16 LM head as it is (kernels/ops/linear_cross_entropy.h), and the others
  // above 64^3 multiply-adds (kernels/ops/lora_linear.h): measured 4.2e-5 relative on the
  // loss, up to 1.3e-3 normwise relative on the gradients.
  EXPECT_NEAR(a.loss, b.loss, 2e-4 * std::abs(a.loss));
  for (size_t i = 0; i < a.grads.size(); ++i) {
    EXPECT_LT((a.grads[i] - b.grads[i]).abs().max().item<double>(),
              5e-3 * a.grads[i].abs().max().item<double>())
        << "gradient " << i;
  }
}

TEST(CausalLm, Llama3RopeScalingKeepsHighAndDividesLowFrequencies) {
  ModelConfig config = TinyConfig();
  config.head_dim = 128;
  config.rope_theta = 500000;
  at::Tensor plain = RopeInverseFrequencies(config);
  config.rope_scaling.kind = RopeScaling::Kind::kLlama3;
  config.rope_scaling.factor = 32.0;
  config.rope_scaling.low_freq_factor = 1.0;
  config.rope_scaling.high_freq_factor = 4.0;
  config.rope_scaling.original_max_position_embeddings = 8192;
  at::Tensor scaled = RopeInverseFrequencies(config);
  EXPECT_FLOAT_EQ(scaled[0].item<float>(), plain[0].item<float>());
  EXPECT_FLOAT_EQ(scaled[63].item<float>(), plain[63].item<float>() / 32.0f);
}

TEST(CausalLm, ReportsMissingTensorsAndShapeMismatchesByName) {
  TempDir dir;
  ModelConfig config = TinyConfig();
  ASSERT_TRUE(WriteSyntheticModel(config, DType::kF32, 1, 0, dir.Path("m")).ok());
  ModelConfig bigger = config;
  bigger.intermediate_size = 64;
  absl::Status shape = CausalLm::Load(dir.Path("m"), bigger, false).status();
  EXPECT_EQ(shape.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(shape.message(),
              HasSubstr("model.safetensors: tensor \"model.layers.0.mlp.gate_proj.weight\": "
                        "shape [48, 32] in the file vs [64, 32] from config.json"));
  ModelConfig biased = config;
  biased.qkv_bias = true;
  absl::Status missing = CausalLm::Load(dir.Path("m"), biased, false).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.message(),
              HasSubstr("tensor \"model.layers.0.self_attn.q_proj.bias\" is missing"));
  ModelConfig qwen3 = config;
  qwen3.model_type = "qwen3";
  qwen3.qk_norm = true;
  EXPECT_THAT(CausalLm::Load(dir.Path("m"), qwen3, false).status().message(),
              HasSubstr("tensor \"model.layers.0.self_attn.q_norm.weight\" is missing "
                        "(config.json implies shape [8])"));
  ModelConfig gemma2 = config;
  gemma2.model_type = "gemma2";
  EXPECT_THAT(CausalLm::Load(dir.Path("m"), gemma2, false).status().message(),
              HasSubstr("tensor \"model.layers.0.pre_feedforward_layernorm.weight\" is missing "
                        "(config.json implies shape [32])"));
  EXPECT_EQ(CausalLm::Load(dir.Path("nothing"), config, false).status().code(),
            absl::StatusCode::kNotFound);
}

// Qwen3's q_norm and k_norm: the fused and the unfused RMSNorm give the same loss and
// gradients (the norms' own included: trainable, without weight decay, in full fine-tuning),
// and each weight acts on the logits.
TEST(CausalLm, Qwen3NormsEachHeadOfQueriesAndKeys) {
  TempDir dir;
  ModelConfig config = TinyConfig("qwen3");
  ModelOptions unfused;
  unfused.fused_kernels = false;
  auto fused = LoadModel(dir, config, DType::kF32, /*trainable=*/true);
  auto plain = LoadModel(dir, config, DType::kF32, /*trainable=*/true, unfused);
  at::Tensor ids = Ids(2, 14, config.vocab_size, 6);
  LossAndGrads a = ExpectSameBackward(*fused, *plain, ids);
  std::vector<NamedParameter> params = fused->TrainableParameters();
  ASSERT_EQ(a.grads.size(), params.size());
  int norms = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (absl::StrContains(params[i].name, "self_attn.q_norm") ||
        absl::StrContains(params[i].name, "self_attn.k_norm")) {
      ++norms;
      EXPECT_FALSE(params[i].weight_decay) << params[i].name;
      EXPECT_THAT(params[i].tensor.sizes(), ::testing::ElementsAre(config.head_dim));
      EXPECT_GT(a.grads[i].abs().max().item<float>(), 0.0f) << params[i].name;
    }
  }
  EXPECT_EQ(norms, 2 * config.num_hidden_layers);
  // Every head shares one weight over head_dim: scaling the last feature of k_norm moves the
  // logits.
  at::Tensor before = fused->Logits(ids);
  {
    at::NoGradGuard no_grad;
    for (NamedParameter& p : fused->TrainableParameters()) {
      if (p.name == "model.layers.0.self_attn.k_norm.weight") p.tensor[config.head_dim - 1].mul_(3);
    }
  }
  EXPECT_FALSE(at::allclose(before, fused->Logits(ids), 1e-3, 1e-4));
}

// Gemma 2 and Gemma 3: the fused kernels (RMSNorm with 1 + weight, RoPE, GeGLU, LoRA linear,
// the soft-capped chunked loss) give the unfused compositions' loss and gradients, the four norms
// of every block included (trainable, without weight decay, in full fine-tuning).
TEST(CausalLm, GemmaFusedMatchesUnfused) {
  for (const std::string type : {"gemma2", "gemma3_text"}) {
    SCOPED_TRACE(type);
    TempDir dir;
    ModelConfig config = TinyConfig(type);
    ModelOptions unfused;
    unfused.fused_kernels = false;
    unfused.chunked_loss = false;
    auto fused = LoadModel(dir, config, DType::kF32, /*trainable=*/true);
    auto plain = LoadModel(dir, config, DType::kF32, /*trainable=*/true, unfused);
    at::Tensor ids = Ids(2, 14, config.vocab_size, 6);
    LossAndGrads a = ExpectSameBackward(*fused, *plain, ids);
    std::vector<NamedParameter> params = fused->TrainableParameters();
    ASSERT_EQ(a.grads.size(), params.size());
    int norms = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      if (absl::StrContains(params[i].name, "feedforward_layernorm")) {
        ++norms;
        EXPECT_FALSE(params[i].weight_decay) << params[i].name;
        EXPECT_GT(a.grads[i].abs().max().item<float>(), 0.0f) << params[i].name;
      }
    }
    EXPECT_EQ(norms, 2 * config.num_hidden_layers);
  }
}

// Gemma 2's soft-caps act: on the logits (every logit within +-cap, the chunked loss equal to
// the cross-entropy of the capped logits) and on the attention scores.
TEST(CausalLm, Gemma2SoftCapsTheLogitsAndTheScores) {
  TempDir dir;
  ModelConfig config = TinyConfig("gemma2");
  auto model = LoadModel(dir, config);
  at::Tensor ids = Ids(1, 12, config.vocab_size, 2);
  at::Tensor logits = model->Logits(ids);
  EXPECT_LE(logits.abs().max().item<double>(), config.final_logit_softcapping);
  at::Tensor targets = ids.slice(1, 1).reshape({-1});
  at::Tensor expected =
      at::cross_entropy_loss(logits[0].slice(0, 0, 11), targets, {}, at::Reduction::Sum);
  EXPECT_NEAR(model->SumLoss(ids, ids).item<double>(), expected.item<double>(),
              1e-5 * expected.item<double>());

  for (const char* cap : {"attn_logit_softcapping", "final_logit_softcapping"}) {
    SCOPED_TRACE(cap);
    ModelConfig uncapped = config;
    (std::string(cap) == "attn_logit_softcapping" ? uncapped.attn_logit_softcapping
                                                  : uncapped.final_logit_softcapping) = 0.0;
    auto other = LoadModel(dir, uncapped);
    EXPECT_FALSE(at::allclose(logits, other->Logits(ids), 1e-3, 1e-4));
  }
}

// The pad_token_id row of the embeddings gets no gradient from the lookup, in every family
// (transformers' nn.Embedding(vocab, hidden, padding_idx=config.pad_token_id)); the other rows
// do; without a pad_token_id it does too.
TEST(CausalLm, PadTokenRowLearnsNothingFromTheLookup) {
  for (const std::string type : {"llama", "qwen2", "phi3", "gemma2"}) {
    for (const bool pad : {true, false}) {
      SCOPED_TRACE(absl::StrCat(type, pad ? " pad_token_id 0" : " no pad_token_id"));
      TempDir dir;
      ModelConfig config = TinyConfig(type);
      config.tie_word_embeddings = false;  // the head's gradient apart
      config.pad_token_id = 0;
      if (!pad) config.pad_token_id.reset();
      auto model = LoadModel(dir, config, DType::kF32, /*trainable=*/true);
      at::Tensor ids = Ids(2, 10, config.vocab_size, 4);
      ids[0][3] = 0;
      ids[1][5] = 0;
      LossAndGrads grads = Backward(*model, ids, 0);
      std::vector<NamedParameter> params = model->TrainableParameters();
      ASSERT_EQ(params[0].name, "model.embed_tokens.weight");
      EXPECT_EQ(grads.grads[0][0].abs().max().item<float>() == 0.0f, pad);
      EXPECT_GT(grads.grads[0][ids[0][0].item<int64_t>()].abs().max().item<float>(), 0.0f);
    }
  }
}

// Gemma's layers slide or not by sliding_layers: a sliding layer sees sliding_window tokens
// back, a global one the whole prefix.
TEST(CausalLm, GemmaSlidesOnlyOnItsSlidingLayers) {
  for (const bool slides : {true, false}) {
    SCOPED_TRACE(slides ? "sliding layer" : "global layer");
    TempDir dir;
    ModelConfig config = TinyConfig("gemma3_text");
    config.num_hidden_layers = 1;  // one layer: the receptive field is exactly the window
    config.sliding_layers = {slides};
    config.sliding_window = 4;
    auto model = LoadModel(dir, config);
    at::Tensor ids = Ids(1, 12, config.vocab_size, 1);
    at::Tensor changed = ids.clone();
    changed[0][0] = (ids[0][0].item<int64_t>() + 1) % config.vocab_size;
    at::Tensor a = model->Logits(ids)[0], b = model->Logits(changed)[0];
    EXPECT_FALSE(at::allclose(a[3], b[3]));
    EXPECT_EQ(at::equal(a.slice(0, 4), b.slice(0, 4)), slides);
  }
}

// Gemma 3's sliding layers rotate by rope_local_base_freq, its global ones by rope_theta.
TEST(CausalLm, Gemma3SlidingLayersHaveTheirOwnRopeBase) {
  TempDir dir;
  ModelConfig config = TinyConfig("gemma3_text");
  config.sliding_window = 64;  // longer than the sequence: only the RoPE base differs
  at::Tensor ids = Ids(1, 12, config.vocab_size, 3);
  auto model = LoadModel(dir, config);
  at::Tensor logits = model->Logits(ids);
  for (const bool sliding_layer : {true, false}) {
    SCOPED_TRACE(sliding_layer ? "layer 0 (sliding)" : "layer 1 (global)");
    ModelConfig other = config;
    (sliding_layer ? other.rope_local_base_freq : other.rope_theta) *= 10;
    EXPECT_FALSE(at::allclose(logits, LoadModel(dir, other)->Logits(ids), 1e-3, 1e-4));
  }
  // With one base for both, the kinds compute alike (no window within 12 tokens).
  ModelConfig same_base = config;
  same_base.rope_local_base_freq = config.rope_theta;
  ModelConfig all_global = same_base;
  all_global.sliding_layers = {false, false};
  EXPECT_TRUE(at::allclose(LoadModel(dir, same_base)->Logits(ids),
                           LoadModel(dir, all_global)->Logits(ids), 1e-5, 1e-6));
}

// Phi-3's qkv_proj holds q, k and v's rows in that order and gate_up_proj gate's then up's:
// a Llama given those slices as its separate projections computes the same logits.
TEST(CausalLm, Phi3FusedProjectionsAreTheSeparateOnesStacked) {
  TempDir phi3_dir, llama_dir;
  ModelConfig phi3 = TinyConfig("phi3");
  ModelConfig llama = TinyConfig("llama");
  auto fused = LoadModel(phi3_dir, phi3, DType::kF32, /*trainable=*/true);
  auto separate = LoadModel(llama_dir, llama, DType::kF32, /*trainable=*/true);
  std::map<std::string, at::Tensor> weights;
  for (NamedParameter& p : fused->TrainableParameters()) weights[p.name] = p.tensor;
  const int64_t q = phi3.num_attention_heads * phi3.head_dim;
  const int64_t kv = phi3.num_key_value_heads * phi3.head_dim;
  const int64_t i = phi3.intermediate_size;
  {
    at::NoGradGuard no_grad;
    for (NamedParameter& p : separate->TrainableParameters()) {
      std::string name = p.name;
      auto take = [&](const std::string& from, const std::string& fused_module, int64_t start,
                      int64_t rows) {
        if (!absl::StrContains(name, from)) return false;
        std::string fused_name = name;
        fused_name.replace(fused_name.find(from), from.size(), fused_module);
        p.tensor.copy_(weights.at(fused_name).narrow(0, start, rows));
        return true;
      };
      if (take(".q_proj.", ".qkv_proj.", 0, q) || take(".k_proj.", ".qkv_proj.", q, kv) ||
          take(".v_proj.", ".qkv_proj.", q + kv, kv) ||
          take(".gate_proj.", ".gate_up_proj.", 0, i) ||
          take(".up_proj.", ".gate_up_proj.", i, i)) {
        continue;
      }
      p.tensor.copy_(weights.at(name));
    }
  }
  at::Tensor ids = Ids(2, 11, phi3.vocab_size, 9);
  EXPECT_TRUE(at::allclose(fused->Logits(ids), separate->Logits(ids), 1e-5, 1e-6));
  // LoRA: one A/B pair per fused projection, B of qkv_proj (heads + 2 kv_heads) x head_dim.
  auto adapted = LoadModel(phi3_dir, phi3);
  LoraSpec lora;
  lora.rank = 4;
  adapted->InitLora(lora, 1);
  std::vector<NamedParameter> params = adapted->TrainableParameters();
  ASSERT_EQ(params.size(), 2u * 4 * 2);
  EXPECT_EQ(params[0].name, "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight");
  EXPECT_THAT(params[1].tensor.sizes(), ::testing::ElementsAre(q + 2 * kv, 4));
  EXPECT_EQ(params[4].name, "base_model.model.model.layers.0.mlp.gate_up_proj.lora_A.weight");
  EXPECT_THAT(params[5].tensor.sizes(), ::testing::ElementsAre(2 * i, 4));
}

// Partial rotary and LongRoPE: the frequencies of the rotated features, the long factors
// beyond the original length, the attention factor on cos and sin; the fused and unfused
// kernels agree, and only the rotated features see positions.
TEST(CausalLm, Phi3PartialRotaryAndLongRope) {
  ModelConfig config = TinyPhi3(0.5, /*original=*/8);
  config.rope_theta = 100.0;
  ASSERT_EQ(RotaryDim(config), 4);
  at::Tensor short_freq = RopeInverseFrequencies(config, 8);
  at::Tensor long_freq = RopeInverseFrequencies(config, 9);
  ASSERT_EQ(short_freq.size(0), 2);
  // 1 / (factor * theta^(2j / rotary)): j = 1 divides by 1.25 (short) or 5 (long) and 10.
  EXPECT_FLOAT_EQ(short_freq[1].item<float>(), 1.0f / (1.25f * 10.0f));
  EXPECT_FLOAT_EQ(long_freq[1].item<float>(), 1.0f / (5.0f * 10.0f));
  EXPECT_FLOAT_EQ(long_freq[0].item<float>(), 0.5f);

  TempDir dir;
  ModelOptions unfused;
  unfused.fused_kernels = false;
  auto fused = LoadModel(dir, config, DType::kF32, /*trainable=*/true);
  auto plain = LoadModel(dir, config, DType::kF32, /*trainable=*/true, unfused);
  for (int64_t seq : {6, 14}) {  // short factors, long factors
    SCOPED_TRACE(seq);
    at::Tensor ids = Ids(2, seq, config.vocab_size, 6);
    ExpectSameBackward(*fused, *plain, ids);
  }
  // The factors matter: other long factors change the logits of a long sequence only.
  ModelConfig other = config;
  for (double& f : other.rope_scaling.long_factor) f *= 2;
  auto changed = LoadModel(dir, other);
  auto base = LoadModel(dir, config);
  EXPECT_TRUE(at::equal(base->Logits(Ids(1, 8, config.vocab_size, 2)),
                        changed->Logits(Ids(1, 8, config.vocab_size, 2))));
  EXPECT_FALSE(at::allclose(base->Logits(Ids(1, 9, config.vocab_size, 2)),
                            changed->Logits(Ids(1, 9, config.vocab_size, 2)), 1e-4, 1e-5));
}

// QLoRA and ZeRO on Phi-3: the fused projections are the NF4 weights and the units' tensors.
TEST(CausalLm, Phi3UnitsAndNf4WeightsAreTheFusedProjections) {
  TempDir dir;
  ModelConfig config = TinyPhi3(0.75);
  auto model = LoadModel(dir, config);
  LoraSpec lora;
  lora.rank = 2;
  lora.targets = {"qkv_proj", "down_proj"};
  model->InitLora(lora, 3);
  std::vector<std::string> names;
  for (const UnitTensor& t : model->UnitTensors(2)) names.push_back(t.name);
  EXPECT_THAT(
      names,
      ::testing::ElementsAre(
          "model.layers.1.input_layernorm.weight", "model.layers.1.self_attn.qkv_proj.weight",
          "model.layers.1.self_attn.o_proj.weight",
          "model.layers.1.post_attention_layernorm.weight",
          "model.layers.1.mlp.gate_up_proj.weight", "model.layers.1.mlp.down_proj.weight",
          "base_model.model.model.layers.1.self_attn.qkv_proj.lora_A.weight",
          "base_model.model.model.layers.1.self_attn.qkv_proj.lora_B.weight",
          "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight",
          "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"));
  at::Tensor ids = Ids(2, 10, config.vocab_size, 4);
  at::Tensor dense = model->Logits(ids);
  EXPECT_GT(model->QuantizeProjections(), 0);
  std::vector<std::string> nf4;
  for (const auto& [name, weight] : model->UnitNf4Weights(1)) nf4.push_back(name);
  EXPECT_THAT(nf4,
              ::testing::ElementsAre("model.layers.0.qkv_proj", "model.layers.0.o_proj",
                                     "model.layers.0.gate_up_proj", "model.layers.0.down_proj"));
  // The NF4 model computes what a dense one holding the dequantized weights computes (the
  // fresh adapters add nothing), and the adapters learn.
  auto reference = LoadModel(dir, config, DType::kF32, /*trainable=*/true);
  {
    at::NoGradGuard no_grad;
    std::map<std::string, at::Tensor> dequantized;
    for (int64_t unit = 1; unit <= config.num_hidden_layers; ++unit) {
      for (const auto& [name, weight] : model->UnitNf4Weights(unit)) {
        const std::string module = name.substr(name.rfind('.') + 1);
        dequantized[ProjectionName(unit - 1, module) + ".weight"] =
            kernels::DequantizeNf4(*weight, 0, weight->rows * weight->cols)
                .view({weight->rows, weight->cols});
      }
    }
    int replaced = 0;
    for (NamedParameter& p : reference->TrainableParameters()) {
      if (dequantized.count(p.name)) {
        p.tensor.copy_(dequantized[p.name]);
        ++replaced;
      }
    }
    EXPECT_EQ(replaced, 4 * config.num_hidden_layers);
  }
  at::Tensor quantized = model->Logits(ids);
  EXPECT_FALSE(at::allclose(quantized, dense, 1e-3, 1e-4));
  EXPECT_TRUE(at::allclose(quantized, reference->Logits(ids), 1e-4, 1e-5));
  LossAndGrads grads = Backward(*model, ids, 0);
  ASSERT_EQ(grads.grads.size(), 2u * 2 * 2);
  EXPECT_GT(grads.grads[0].abs().max().item<float>() + grads.grads[1].abs().max().item<float>(),
            0.0f);
  // A target the model lacks is refused where the model is opened.
  lora.targets = {"q_proj"};
  EXPECT_THAT(model->LoadLora(lora, dir.Path("none")).message(), HasSubstr("lora.targets"));
}

TEST(CausalLm, LoadLoraRejectsAnotherRank) {
  TempDir dir;
  ModelConfig config = TinyConfig();
  auto model = LoadModel(dir, config);
  LoraSpec lora;
  lora.rank = 4;
  model->InitLora(lora, 0);
  PeftAdapterConfig adapter;
  adapter.base_model_name_or_path = "m";
  adapter.r = 4;
  adapter.lora_alpha = 8.0;
  adapter.target_modules = ProjectionModules(config);
  ASSERT_TRUE(model->ExportAdapter(dir.Path("adapter"), adapter).ok());
  auto other = LoadModel(dir, config);
  lora.rank = 8;
  absl::Status status = other->LoadLora(lora, dir.Path("adapter"));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("r is 4 but lora.rank is 8"));
  lora.rank = 4;
  EXPECT_TRUE(other->LoadLora(lora, dir.Path("adapter")).ok());
}

// PEFT's target forms, rank_pattern and alpha_pattern: adapters on the matched projections
// only, each of its own rank, scaled by its own alpha (and rsLoRA's sqrt), and an adapter
// exported with a rank_pattern loads back (init_from).
TEST(CausalLm, PerModuleRankAndAlpha) {
  TempDir dir;
  ModelConfig config = TinyConfig();
  auto model = LoadModel(dir, config);
  LoraSpec lora;
  lora.targets.clear();
  lora.targets_pattern = R"(.*\.layers\.(0|1)\.(self_attn\.q|mlp\.down)_proj)";
  lora.rank = 4;
  lora.alpha = 8;
  lora.use_rslora = true;
  lora.rank_pattern = {{"down_proj", 2}};
  lora.alpha_pattern = {{R"(layers\.1\..*)", 3}};
  model->InitLora(lora, 0);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const NamedParameter& p : model->TrainableParameters()) {
    shapes[p.name] = p.tensor.sizes().vec();
  }
  const int64_t hidden = config.hidden_size, inter = config.intermediate_size;
  const int64_t q = config.num_attention_heads * config.head_dim;
  EXPECT_EQ(shapes, (std::map<std::string, std::vector<int64_t>>{
                        {PeftLoraTensorName(0, "q_proj", "A"), {4, hidden}},
                        {PeftLoraTensorName(0, "q_proj", "B"), {q, 4}},
                        {PeftLoraTensorName(0, "down_proj", "A"), {2, inter}},
                        {PeftLoraTensorName(0, "down_proj", "B"), {hidden, 2}},
                        {PeftLoraTensorName(1, "q_proj", "A"), {4, hidden}},
                        {PeftLoraTensorName(1, "q_proj", "B"), {q, 4}},
                        {PeftLoraTensorName(1, "down_proj", "A"), {2, inter}},
                        {PeftLoraTensorName(1, "down_proj", "B"), {hidden, 2}},
                    }));
  ASSERT_EQ(model->lora_targets().size(), 4u);
  EXPECT_EQ(model->lora_targets()[1], (LoraTarget{0, "down_proj", 2, 8}));
  EXPECT_EQ(model->lora_targets()[2], (LoraTarget{1, "q_proj", 4, 3}));

  // The scaling: the output moves by s * B A x, s = alpha / sqrt(rank) per module.
  TempDir merged_dir;
  auto merged = LoadModel(merged_dir, config, DType::kF32, /*trainable=*/true);
  {
    at::NoGradGuard no_grad;
    std::map<std::string, at::Tensor> deltas;
    std::vector<NamedParameter> params = model->TrainableParameters();
    for (size_t i = 0; i < params.size(); i += 2) {
      params[i + 1].tensor.uniform_(-0.1, 0.1);
      const LoraTarget& target = model->lora_targets()[i / 2];
      deltas[ProjectionName(target.layer, target.module) + ".weight"] =
          at::matmul(params[i + 1].tensor, params[i].tensor) * target.Scale(true);
    }
    for (NamedParameter& p : merged->TrainableParameters()) {
      if (deltas.count(p.name)) p.tensor.add_(deltas[p.name]);
    }
  }
  at::Tensor ids = Ids(2, 12, config.vocab_size, 3);
  EXPECT_TRUE(at::allclose(model->Logits(ids), merged->Logits(ids), 1e-4, 1e-5));

  PeftAdapterConfig adapter;
  adapter.r = lora.rank;
  adapter.lora_alpha = lora.alpha;
  adapter.target_modules_pattern = lora.targets_pattern;
  adapter.rank_pattern = lora.rank_pattern;
  adapter.alpha_pattern = lora.alpha_pattern;
  ASSERT_TRUE(model->ExportAdapter(dir.Path("adapter"), adapter).ok());
  auto again = LoadModel(dir, config);
  ASSERT_TRUE(again->LoadLora(lora, dir.Path("adapter")).ok());
  EXPECT_TRUE(at::allclose(model->Logits(ids), again->Logits(ids), 1e-6, 1e-7));
  // Without the rank_pattern the adapter's down_proj tensors have the wrong rank.
  lora.rank_pattern.clear();
  auto wrong = LoadModel(dir, config);
  absl::Status status = wrong->LoadLora(lora, dir.Path("adapter"));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("layers.0.mlp.down_proj.lora_A.weight\": shape [2, "));
}

// lora.modules_to_save (PEFT's ModulesToSaveWrapper): a float32 copy of embed_tokens and of
// lm_head trains beside the adapters; it starts as the base (the logits unchanged), its
// gradient is the one full fine-tuning gives that weight (a fresh adapter adds nothing), and
// the frozen base weights stay as loaded. Exported under PEFT's keys, read back by LoadLora.
TEST(CausalLm, ModulesToSaveTrainCopiesOfEmbeddingsAndHead) {
  TempDir dir;
  ModelConfig config = TinyConfig();
  config.pad_token_id = 0;
  auto model = LoadModel(dir, config);
  auto full = LoadModel(dir, config, DType::kF32, /*trainable=*/true);
  at::Tensor ids = Ids(2, 10, config.vocab_size, 6);
  ids[1][4] = 0;  // the pad row: no gradient, in the copy as in the base
  const at::Tensor before = model->Logits(ids);
  const std::vector<std::pair<std::string, at::Tensor>> base = model->NamedBaseWeights();
  LoraSpec lora;
  lora.rank = 2;
  lora.targets = {"q_proj"};
  lora.modules_to_save = {"lm_head", "model.embed_tokens"};
  model->InitLora(lora, 3);
  EXPECT_TRUE(at::equal(before, model->Logits(ids)));
  std::vector<NamedParameter> params = model->TrainableParameters();
  ASSERT_EQ(params.size(), 2u * 2 + 2);
  EXPECT_EQ(params[4].name, "base_model.model.model.embed_tokens.weight");
  EXPECT_EQ(params[5].name, "base_model.model.lm_head.weight");
  EXPECT_TRUE(params[4].weight_decay && params[5].weight_decay);

  LossAndGrads copies = Backward(*model, ids, 0);
  LossAndGrads reference = Backward(*full, ids, 0);
  std::vector<NamedParameter> full_params = full->TrainableParameters();
  for (const auto& [copy, name] :
       {std::pair{4, "model.embed_tokens.weight"}, std::pair{5, "lm_head.weight"}}) {
    SCOPED_TRACE(name);
    size_t i = 0;
    while (i < full_params.size() && full_params[i].name != name) ++i;
    ASSERT_LT(i, full_params.size());
    EXPECT_TRUE(at::allclose(copies.grads[copy], reference.grads[i], 1e-5, 1e-7));
    EXPECT_GT(copies.grads[copy].abs().max().item<float>(), 0.0f);
  }
  EXPECT_EQ(copies.grads[4][0].abs().max().item<float>(), 0.0f);
  {
    at::NoGradGuard no_grad;  // a step: the copies move, the base does not
    params[4].tensor.add_(copies.grads[4], -10.0);
    params[5].tensor.add_(copies.grads[5], -10.0);
  }
  const at::Tensor trained = model->Logits(ids);
  EXPECT_FALSE(at::allclose(before, trained));
  const std::vector<std::pair<std::string, at::Tensor>> after = model->NamedBaseWeights();
  ASSERT_EQ(after.size(), base.size());
  for (size_t i = 0; i < base.size(); ++i) {
    EXPECT_TRUE(at::equal(after[i].second, base[i].second)) << base[i].first;
    EXPECT_FALSE(after[i].second.requires_grad()) << base[i].first;
  }

  PeftAdapterConfig adapter;
  adapter.r = 2;
  adapter.lora_alpha = lora.alpha;
  adapter.target_modules = {"q_proj"};
  adapter.modules_to_save = lora.modules_to_save;
  ASSERT_TRUE(model->ExportAdapter(dir.Path("adapter"), adapter).ok());
  absl::StatusOr<std::shared_ptr<const SafetensorsFile>> file =
      SafetensorsFile::Open(dir.Path("adapter/adapter_model.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  for (const char* key :
       {"base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"}) {
    const TensorView* view = (*file)->Find(key);
    ASSERT_NE(view, nullptr) << key;
    EXPECT_EQ(view->shape, (std::vector<int64_t>{config.vocab_size, config.hidden_size})) << key;
  }
  auto loaded = LoadModel(dir, config);
  ASSERT_TRUE(loaded->LoadLora(lora, dir.Path("adapter")).ok());
  EXPECT_TRUE(at::equal(trained, loaded->Logits(ids)));
  // The spec must name the adapter's saved modules: dropping them would lose trained weights.
  auto other = LoadModel(dir, config);
  LoraSpec without = lora;
  without.modules_to_save = {"lm_head"};
  absl::Status refused = other->LoadLora(without, dir.Path("adapter"));
  EXPECT_THAT(refused.message(),
              HasSubstr("adapter_config.json: modules_to_save is [lm_head, model.embed_tokens] "
                        "but lora.modules_to_save is [lm_head]"));

  // Merged, the copies replace the base weights: the same logits without adapters.
  ASSERT_TRUE(loaded->MergeLora().ok());
  EXPECT_TRUE(at::allclose(trained, loaded->Logits(ids), 1e-4, 1e-5));
  EXPECT_TRUE(loaded->TrainableParameters().empty());
}

// Tied embeddings, as PEFT 0.21 wraps them without ensure_weight_tying: a saved lm_head is a
// copy the head's product uses while the lookup keeps the frozen tied weight; a saved
// embed_tokens the other way round. Merging either would untie the model: refused.
TEST(CausalLm, ModulesToSaveOnTiedEmbeddingsReplaceOneUse) {
  TempDir dir;
  ModelConfig config = TinyConfig("qwen2");
  config.tie_word_embeddings = true;
  at::Tensor ids = Ids(2, 9, config.vocab_size, 7);
  at::Tensor embed;
  for (const std::string module : {"lm_head", "embed_tokens"}) {
    SCOPED_TRACE(module);
    auto model = LoadModel(dir, config);
    for (const auto& [name, t] : model->NamedBaseWeights()) {
      if (name == "model.embed_tokens.weight") embed = t;
    }
    ASSERT_TRUE(embed.defined());
    const at::Tensor hidden = model->Hidden(ids);
    LoraSpec lora;
    lora.rank = 2;
    lora.modules_to_save = {module};
    model->InitLora(lora, 1);
    std::vector<NamedParameter> params = model->TrainableParameters();
    ASSERT_FALSE(params.empty());
    EXPECT_TRUE(at::equal(params.back().tensor, embed));  // both copies start as the tied one
    {
      at::NoGradGuard no_grad;
      params.back().tensor.zero_();
    }
    at::NoGradGuard no_grad;
    if (module == "lm_head") {
      EXPECT_TRUE(at::equal(model->Hidden(ids), hidden));             // the lookup: the base
      EXPECT_EQ(model->Logits(ids).abs().max().item<float>(), 0.0f);  // the head: the copy
    } else {
      const at::Tensor moved = model->Hidden(ids);
      EXPECT_FALSE(at::allclose(moved, hidden));
      EXPECT_TRUE(at::allclose(model->Logits(ids), at::matmul(moved, embed.t()), 1e-5, 1e-6));
    }
    EXPECT_EQ(model->MergeLora().code(), absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace lathe
