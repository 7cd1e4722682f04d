#include "worker/engine/causal_lm.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "kernels/ops/linear_cross_entropy.h"
#include "kernels/ops/lora_linear.h"
#include "kernels/ops/matmul.h"
#include "kernels/ops/rms_norm.h"
#include "kernels/ops/rope.h"
#include "kernels/ops/swiglu.h"
#include "kernels/ops/unfused.h"
#include "worker/engine/memory_tracker.h"
#include "worker/engine/profile_scope.h"
#include "worker/engine/weights.h"

namespace lathe {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The states of the generators dropout on `device` may draw from (the CPU one, which also
// seeds the fused LoRA's masks, and the device's own), and back. (Not held locked across the
// recomputation: dropout takes a generator's lock itself.)
std::vector<at::Device> DropoutGeneratorDevices(at::Device device) {
  if (device.is_cpu()) return {device};
  return {at::Device(at::kCPU), device};
}

std::vector<at::Tensor> GeneratorStates(at::Device device) {
  std::vector<at::Tensor> states;
  for (at::Device d : DropoutGeneratorDevices(device)) {
    at::Generator generator = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(generator.mutex());
    states.push_back(generator.get_state());
  }
  return states;
}

void SetGeneratorStates(at::Device device, const std::vector<at::Tensor>& states) {
  const std::vector<at::Device> devices = DropoutGeneratorDevices(device);
  for (size_t i = 0; i < states.size(); ++i) {
    at::Generator generator = at::globalContext().defaultGenerator(devices[i]);
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(states[i]);
  }
}

// Activation checkpointing of one decoder block. Forward runs the block without recording
// a graph and keeps its inputs; backward runs the block again with the dropout generator
// state of the first run, and differentiates it. inputs = {x, cos, sin, trainable...}. The
// additive mask needs no gradient and may be undefined (libtorch's fused attention without a
// sliding window), which libtorch 2.x refuses as a custom function's input: it travels by
// pointer and is kept in saved_data.
class CheckpointedBlock : public torch::autograd::Function<CheckpointedBlock> {
 public:
  static at::Tensor forward(AutogradContext* ctx, at::TensorList inputs, const CausalLm* model,
                            int64_t layer, const at::Tensor* mask) {
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["model"] = reinterpret_cast<int64_t>(model);
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["mask"] = *mask;
    ctx->saved_data["rng"] = GeneratorStates(inputs[0].device());
    return model->Block(layer, inputs[0], inputs[1], inputs[2], *mask);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* model = reinterpret_cast<const CausalLm*>(ctx->saved_data["model"].toInt());
    const int64_t layer = ctx->saved_data["layer"].toInt();
    const at::Tensor mask = ctx->saved_data["mask"].toTensor();
    variable_list saved = ctx->get_saved_variables();
    // The first block's input (the frozen embeddings' output) needs no gradient: skipping
    // it saves the backward of its frozen projections, as plain autograd would.
    const bool need_x = ctx->needs_input_grad(0);
    const at::Tensor x = saved[0].detach().requires_grad_(need_x);
    variable_list wrt;
    if (need_x) wrt.push_back(x);
    wrt.insert(wrt.end(), saved.begin() + 3, saved.end());
    at::Tensor y;
    {
      const std::vector<at::Tensor> now = GeneratorStates(x.device());
      SetGeneratorStates(x.device(), ctx->saved_data["rng"].toTensorVector());
      at::AutoGradMode enable_grad(true);
      MemoryScope scope(MemoryComponent::kActivations);
      y = model->Block(layer, x, saved[1], saved[2], mask);
      SetGeneratorStates(x.device(), now);
    }
    variable_list input_grads = torch::autograd::grad({y}, wrt, {grads[0]},
                                                      /*retain_graph=*/false,
                                                      /*create_graph=*/false,
                                                      /*allow_unused=*/true);
    // One gradient per forward input: x, cos, sin, the trainable tensors, then the three
    // non-tensor arguments.
    auto trainable = input_grads.begin() + (need_x ? 1 : 0);
    variable_list result = {need_x ? input_grads[0] : at::Tensor(), at::Tensor(), at::Tensor()};
    result.insert(result.end(), trainable, input_grads.end());
    result.resize(result.size() + 3);
    return result;
  }
};

std::string ShapeText(at::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Whether AdamW decays a base weight when it is trained: not biases and norms.
bool DecaysWeight(const std::string& name) {
  return !absl::EndsWith(name, ".bias") && !absl::EndsWith(name, "norm.weight");
}

}  // namespace

at::Tensor Projection::Forward(const at::Tensor& x, double lora_dropout, bool training,
                               bool fused) const {
  if (nf4.defined()) {
    // The base product tile by tile; the adapter as the ATen composition.
    at::Tensor y = kernels::Nf4Linear(x.to(at::kFloat), nf4).to(x.scalar_type());
    if (bias.defined()) y = y + bias.to(x.scalar_type());
    if (!lora_a.defined()) return y;
    const at::Tensor in = training && lora_dropout > 0 ? at::dropout(x, lora_dropout, true) : x;
    return y + at::matmul(at::matmul(in, lora_a.to(x.scalar_type()).t()),
                          lora_b.to(x.scalar_type()).t()) *
                   lora_scale;
  }
  return fused ? kernels::LoraLinear(x, weight, bias, lora_a, lora_b, lora_scale, lora_dropout,
                                     training)
               : kernels::unfused::LoraLinear(x, weight, bias, lora_a, lora_b, lora_scale,
                                              lora_dropout, training);
}

Projection& DecoderLayer::projection(absl::string_view module) {
  return const_cast<Projection&>(std::as_const(*this).projection(module));
}

const Projection& DecoderLayer::projection(absl::string_view module) const {
  if (module == "q_proj") return q_proj;
  if (module == "k_proj") return k_proj;
  if (module == "v_proj") return v_proj;
  if (module == "qkv_proj") return qkv_proj;
  if (module == "o_proj") return o_proj;
  if (module == "gate_proj") return gate_proj;
  if (module == "up_proj") return up_proj;
  if (module == "gate_up_proj") return gate_up_proj;
  TORCH_CHECK(module == "down_proj", "unknown projection ", std::string(module));
  return down_proj;
}

std::vector<at::Tensor> DecoderLayer::TrainableTensors() const {
  std::vector<at::Tensor> tensors;
  auto add = [&tensors](const at::Tensor& t) {
    if (t.defined() && t.requires_grad()) tensors.push_back(t);
  };
  add(input_norm);
  add(post_attention_norm);
  add(q_norm);
  add(k_norm);
  add(pre_feedforward_norm);
  add(post_feedforward_norm);
  for (const std::string& module : AllProjectionModules()) {
    const Projection& p = projection(module);
    for (const at::Tensor* t : {&p.weight, &p.bias, &p.lora_a, &p.lora_b}) add(*t);
  }
  return tensors;
}

at::Tensor RopeInverseFrequencies(const ModelConfig& config, int64_t seq_len) {
  const int64_t dim = RotaryDim(config);
  at::Tensor exponents = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  const RopeScaling& scaling = config.rope_scaling;
  if (scaling.kind == RopeScaling::Kind::kLongRope) {
    // Transformers: 1 / (factors * base ** exponents), in float32.
    const bool long_seq = seq_len > scaling.original_max_position_embeddings;
    const std::vector<double>& factors = long_seq ? scaling.long_factor : scaling.short_factor;
    at::Tensor ext = at::tensor(factors, at::kDouble).to(at::kFloat);
    return 1.0 / (ext * at::pow(config.rope_theta, exponents));
  }
  at::Tensor inv_freq = 1.0 / at::pow(config.rope_theta, exponents);
  if (scaling.kind == RopeScaling::Kind::kLinear) return inv_freq / scaling.factor;
  if (scaling.kind != RopeScaling::Kind::kLlama3) return inv_freq;
  // Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between.
  const double old_len = static_cast<double>(scaling.original_max_position_embeddings);
  const double low_freq_wavelen = old_len / scaling.low_freq_factor;
  const double high_freq_wavelen = old_len / scaling.high_freq_factor;
  at::Tensor wavelen = 2 * M_PI / inv_freq;
  at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq);
  at::Tensor smooth = (old_len / wavelen - scaling.low_freq_factor) /
                      (scaling.high_freq_factor - scaling.low_freq_factor);
  at::Tensor smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled;
  at::Tensor medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
  return at::where(medium, smoothed, scaled);
}

CausalLm::CausalLm(const ModelConfig& config, const ModelOptions& options)
    : config_(config),
      options_(options),
      layers_(config.num_hidden_layers),
      inv_freq_(RopeInverseFrequencies(config).to(options.device)) {
  if (config.rope_local_base_freq > 0) {
    // Gemma 3's sliding layers: their own base, without the global layers' scaling.
    ModelConfig local = config;
    local.rope_theta = config.rope_local_base_freq;
    local.rope_scaling = RopeScaling();
    local_inv_freq_ = RopeInverseFrequencies(local).to(options.device);
  }
  if (config.rope_scaling.kind == RopeScaling::Kind::kLongRope) {
    long_inv_freq_ =
        RopeInverseFrequencies(config, config.rope_scaling.original_max_position_embeddings + 1)
            .to(options.device);
  }
}

std::vector<std::pair<std::string, at::Tensor*>> CausalLm::BaseWeights() {
  std::map<std::string, at::Tensor*> slots;
  slots["model.embed_tokens.weight"] = &embed_tokens_;
  slots["model.norm.weight"] = &norm_;
  slots["lm_head.weight"] = &lm_head_;
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    DecoderLayer& layer = layers_[l];
    std::string prefix = absl::StrCat("model.layers.", l, ".");
    slots[prefix + "input_layernorm.weight"] = &layer.input_norm;
    slots[prefix + "post_attention_layernorm.weight"] = &layer.post_attention_norm;
    slots[prefix + "self_attn.q_norm.weight"] = &layer.q_norm;
    slots[prefix + "self_attn.k_norm.weight"] = &layer.k_norm;
    slots[prefix + "pre_feedforward_layernorm.weight"] = &layer.pre_feedforward_norm;
    slots[prefix + "post_feedforward_layernorm.weight"] = &layer.post_feedforward_norm;
    for (const std::string& module : ProjectionModules(config_)) {
      Projection& p = layer.projection(module);
      slots[ProjectionName(l, module) + ".weight"] = &p.weight;
      slots[ProjectionName(l, module) + ".bias"] = &p.bias;
    }
  }
  std::vector<std::pair<std::string, at::Tensor*>> ordered;
  for (const WeightSpec& w : ExpectedWeights(config_)) {
    auto it = slots.find(w.name);
    TORCH_CHECK(it != slots.end(), "no slot for weight ", w.name);
    ordered.emplace_back(w.name, it->second);
  }
  return ordered;
}

absl::StatusOr<std::unique_ptr<CausalLm>> CausalLm::Load(const std::string& dir,
                                                         const ModelConfig& config,
                                                         bool trainable_base,
                                                         const ModelOptions& options) {
  std::unique_ptr<CausalLm> model(new CausalLm(config, options));
  model->trainable_base_ = trainable_base;
  const at::ScalarType dtype = trainable_base ? at::kFloat : options.weight_dtype;
  LATHE_ASSIGN_OR_RETURN(SafetensorsDirectory files, SafetensorsDirectory::Open(dir));
  std::map<std::string, std::vector<int64_t>> expected;
  for (WeightSpec& w : ExpectedWeights(config)) expected[w.name] = std::move(w.shape);
  try {
    for (auto& [name, slot] : model->BaseWeights()) {
      SafetensorsDirectory::Entry entry = files.Find(name);
      const std::vector<int64_t>& shape = expected[name];
      if (entry.tensor == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(dir, ": tensor \"", name,
                                                       "\" is missing (config.json implies shape ",
                                                       ShapeText(shape), ")"));
      }
      if (entry.tensor->shape != shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            entry.file->path(), ": tensor \"", name, "\": shape ", ShapeText(entry.tensor->shape),
            " in the file vs ", ShapeText(shape), " from config.json"));
      }
      if (options.keep_mapped) {
        LATHE_ASSIGN_OR_RETURN(*slot, TensorFromFile(entry, at::ScalarType::Undefined, false));
        continue;
      }
      LATHE_ASSIGN_OR_RETURN(*slot, TensorFromFile(entry, dtype, trainable_base));
      *slot = slot->to(options.device);
      if (trainable_base) slot->set_requires_grad(true);
    }
  } catch (const c10::Error& e) {
    return StatusFromTorchError(e, absl::StrCat("loading ", dir));
  }
  return model;
}

void CausalLm::InitLora(const LoraSpec& spec, uint64_t seed) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  absl::StatusOr<std::vector<LoraTarget>> targets = MatchLoraTargets(spec, config_);
  TORCH_CHECK(targets.ok(), "InitLora: ", targets.status().ToString());
  lora_targets_ = *std::move(targets);
  lora_rank_ = spec.rank;
  lora_dropout_ = spec.dropout;
  for (const LoraTarget& target : lora_targets_) {
    ProjectionShape shape = ProjectionShapeOf(config_, target.module);
    Projection& p = layers_[target.layer].projection(target.module);
    double bound = 1.0 / std::sqrt(static_cast<double>(shape.in_features));
    p.lora_a = at::empty({target.rank, shape.in_features}, at::kFloat)
                   .uniform_(-bound, bound, generator)
                   .to(options_.device)
                   .set_requires_grad(true);
    p.lora_b = at::zeros({shape.out_features, target.rank}, at::TensorOptions(options_.device))
                   .set_requires_grad(true);
    p.lora_scale = target.Scale(spec.use_rslora);
  }
  absl::StatusOr<SavedModules> saved = ResolveModulesToSave(spec.modules_to_save);
  TORCH_CHECK(saved.ok(), "InitLora: lora.modules_to_save: ", saved.status().ToString());
  saved_ = *saved;
  // PEFT deep-copies the module: the copy starts as the base weight, in float32 here (the
  // trainable masters' type; the base may be bfloat16), and trains while the base stays
  // frozen. Tied embeddings: both copies start from the one tied weight.
  auto copy = [this](const at::Tensor& base) {
    return base.to(options_.device, at::kFloat, /*non_blocking=*/false, /*copy=*/true)
        .set_requires_grad(true);
  };
  if (saved_.embed_tokens) saved_embed_tokens_ = copy(embed_tokens_);
  if (saved_.lm_head) saved_lm_head_ = copy(config_.tie_word_embeddings ? embed_tokens_ : lm_head_);
}

int64_t CausalLm::QuantizeProjections() {
  at::NoGradGuard no_grad;
  int64_t bytes = 0;
  for (DecoderLayer& layer : layers_) {
    for (const std::string& module : ProjectionModules(config_)) {
      Projection& p = layer.projection(module);
      TORCH_CHECK(!p.weight.requires_grad(), "QuantizeProjections: ", module, " is trainable");
      p.nf4 = kernels::QuantizeNf4(p.weight, p.weight.device());
      p.weight = at::Tensor();
      bytes += p.nf4.nbytes();
    }
  }
  return bytes;
}

absl::Status CausalLm::LoadLora(const LoraSpec& spec, const std::string& dir) {
  LATHE_RETURN_IF_ERROR(LoraTargetsOf(config_, spec.targets).status());
  const std::string config_path = dir + "/adapter_config.json";
  LATHE_ASSIGN_OR_RETURN(std::string config_text, ReadFile(config_path));
  LATHE_ASSIGN_OR_RETURN(PeftAdapterConfig adapter,
                         ParsePeftAdapterConfig(config_text, config_path));
  {
    // The spec decides what trains; an adapter whose saved modules differ would either lose
    // trained weights or start a copy from nothing, so both must name the same modules.
    absl::StatusOr<SavedModules> has = ResolveModulesToSave(adapter.modules_to_save);
    if (!has.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "lora.init_from: ", config_path, ": modules_to_save: ", has.status().message()));
    }
    absl::StatusOr<SavedModules> wants = ResolveModulesToSave(spec.modules_to_save);
    LATHE_RETURN_IF_ERROR(wants.status());
    if (has->embed_tokens != wants->embed_tokens || has->lm_head != wants->lm_head) {
      return absl::InvalidArgumentError(absl::StrCat(
          "lora.init_from: ", config_path, ": modules_to_save is [",
          absl::StrJoin(adapter.modules_to_save, ", "), "] but lora.modules_to_save is [",
          absl::StrJoin(spec.modules_to_save, ", "), "]"));
    }
  }
  if (adapter.r != spec.rank) {
    return absl::InvalidArgumentError(absl::StrCat("lora.init_from: ", config_path, ": r is ",
                                                   adapter.r, " but lora.rank is ", spec.rank));
  }
  const std::string weights_path = dir + "/adapter_model.safetensors";
  LATHE_ASSIGN_OR_RETURN(std::shared_ptr<const SafetensorsFile> file,
                         SafetensorsFile::Open(weights_path));
  LATHE_RETURN_IF_ERROR(MatchLoraTargets(spec, config_).status());
  InitLora(spec, /*seed=*/0);  // shapes and flags; values replaced below
  // Reads tensor `name` of shape `want` into `tensor`, trainable.
  auto load = [&](const std::string& name, const std::vector<int64_t>& want,
                  at::Tensor* tensor) -> absl::Status {
    const TensorView* view = file->Find(name);
    if (view == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("lora.init_from: ", weights_path, ": tensor \"", name, "\" is missing"));
    }
    if (view->shape != want) {
      return absl::InvalidArgumentError(
          absl::StrCat("lora.init_from: ", weights_path, ": tensor \"", name, "\": shape ",
                       ShapeText(view->shape), " vs ", ShapeText(want), " expected"));
    }
    LATHE_ASSIGN_OR_RETURN(at::Tensor loaded,
                           TensorFromFile({view, file}, at::kFloat, /*writable=*/true));
    *tensor = loaded.to(options_.device).set_requires_grad(true);
    return absl::OkStatus();
  };
  for (const LoraTarget& target : lora_targets_) {
    const int64_t l = target.layer;
    const std::string& module = target.module;
    ProjectionShape shape = ProjectionShapeOf(config_, module);
    Projection& p = layers_[l].projection(module);
    LATHE_RETURN_IF_ERROR(
        load(PeftLoraTensorName(l, module, "A"), {target.rank, shape.in_features}, &p.lora_a));
    LATHE_RETURN_IF_ERROR(
        load(PeftLoraTensorName(l, module, "B"), {shape.out_features, target.rank}, &p.lora_b));
  }
  for (auto [name, tensor] : {std::pair{kPeftSavedEmbedTokens, &saved_embed_tokens_},
                              std::pair{kPeftSavedLmHead, &saved_lm_head_}}) {
    if (tensor->defined()) {
      LATHE_RETURN_IF_ERROR(load(name, {config_.vocab_size, config_.hidden_size}, tensor));
    }
  }
  return absl::OkStatus();
}

const at::Tensor& CausalLm::lm_head() const {
  if (saved_.lm_head) return saved_lm_head_;
  return config_.tie_word_embeddings ? embed_tokens_ : lm_head_;
}

const at::Tensor& CausalLm::embedding() const {
  return saved_.embed_tokens ? saved_embed_tokens_ : embed_tokens_;
}

std::pair<at::Tensor, at::Tensor> CausalLm::RopeTables(int64_t seq,
                                                       const at::Tensor& inv_freq) const {
  at::Tensor positions = at::arange(seq, at::TensorOptions(at::kFloat).device(options_.device));
  const RopeScaling& scaling = config_.rope_scaling;
  // LongRoPE (Phi-3, whose layers all use inv_freq_): the long factors' frequencies beyond
  // its original length.
  const bool long_rope = scaling.kind == RopeScaling::Kind::kLongRope;
  const bool long_seq = long_rope && seq > scaling.original_max_position_embeddings;
  at::Tensor freqs = at::outer(positions, long_seq ? long_inv_freq_ : inv_freq);
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  at::Tensor cos = emb.cos(), sin = emb.sin();
  if (long_rope) {
    // Transformers scales both tables in float32, before the cast.
    cos = cos * scaling.attention_factor;
    sin = sin * scaling.attention_factor;
  }
  return {cos.to(options_.compute_dtype), sin.to(options_.compute_dtype)};
}

at::Tensor CausalLm::Attention(const DecoderLayer& layer, const at::Tensor& x,
                               const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& mask) const {
  const int64_t batch = x.size(0), seq = x.size(1);
  const int64_t heads = config_.num_attention_heads, kv_heads = config_.num_key_value_heads;
  const int64_t head_dim = config_.head_dim;
  const bool fused = options_.fused_kernels;
  // Gemma scales the scores by query_pre_attn_scalar^-0.5, the others by head_dim^-0.5.
  const double scale =
      1.0 / std::sqrt(static_cast<double>(
                config_.query_pre_attn_scalar > 0 ? config_.query_pre_attn_scalar : head_dim));
  at::Tensor q, k, v;
  if (config_.model_type == "phi3") {
    // Phi-3: one product, then the q, k and v rows (views, read in place).
    at::Tensor qkv = layer.qkv_proj.Forward(x, lora_dropout_, training_, fused);
    q = qkv.narrow(-1, 0, heads * head_dim);
    k = qkv.narrow(-1, heads * head_dim, kv_heads * head_dim);
    v = qkv.narrow(-1, (heads + kv_heads) * head_dim, kv_heads * head_dim);
  } else {
    q = layer.q_proj.Forward(x, lora_dropout_, training_, fused);
    k = layer.k_proj.Forward(x, lora_dropout_, training_, fused);
    v = layer.v_proj.Forward(x, lora_dropout_, training_, fused);
  }
  q = q.view({batch, seq, heads, head_dim});
  k = k.view({batch, seq, kv_heads, head_dim});
  v = v.view({batch, seq, kv_heads, head_dim}).transpose(1, 2);
  if (config_.qk_norm) {
    // Qwen3 and Gemma 3: each head of q and k normalised over head_dim, before RoPE.
    q = Norm(q, layer.q_norm);
    k = Norm(k, layer.k_norm);
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  // Partial rotary (Phi-4-mini): the first `rotary` features of each head turn, the rest
  // pass through.
  const int64_t rotary = cos.size(-1);
  at::Tensor q_pass, k_pass;
  if (rotary < head_dim) {
    q_pass = q.narrow(-1, rotary, head_dim - rotary);
    k_pass = k.narrow(-1, rotary, head_dim - rotary);
    q = q.narrow(-1, 0, rotary);
    k = k.narrow(-1, 0, rotary);
  }
  if (fused) {
    std::tie(q, k) = kernels::ApplyRope(q, k, cos, sin);
  } else {
    q = kernels::unfused::Rope(q, cos, sin);
    k = kernels::unfused::Rope(k, cos, sin);
  }
  if (rotary < head_dim) {
    q = at::cat({q, q_pass}, -1);
    k = at::cat({k, k_pass}, -1);
  }
  if (kv_heads != heads) {
    k = k.repeat_interleave(heads / kv_heads, 1);
    v = v.repeat_interleave(heads / kv_heads, 1);
  } else if (config_.model_type == "phi3") {
    // v is still a view of the fused qkv output: attention saves it for backward, which would
    // keep all of qkv alive; a copy keeps v alone, as the separate projections do.
    v = v.contiguous();
  }
  if (FusedSdpa(seq)) {
    // libtorch's fused attention (flash or memory-efficient kernels). Without a sliding
    // window there is no mask (nullopt, not an undefined tensor) and the kernel applies
    // causality itself.
    const std::optional<at::Tensor> attn_mask =
        mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt;
    at::Tensor out = at::scaled_dot_product_attention(q, k, v, attn_mask, /*dropout_p=*/0.0,
                                                      /*is_causal=*/!mask.defined(), scale);
    out = out.transpose(1, 2).reshape({batch, seq, heads * head_dim});
    return layer.o_proj.Forward(out, lora_dropout_, training_, fused);
  }
  // The fused path's products go through the engine's (oneDNN on the CPU); the unfused one
  // stays ATen's, the baseline. A bf16 LoRA job on the CPU (float32 activations, frozen
  // bfloat16 weights) multiplies them in bfloat16 where the CPU can, as its projections.
  const bool bf16 = options_.weight_dtype == at::kBFloat16 &&
                    options_.compute_dtype == at::kFloat && !trainable_base_;
  // The softmax keeps its output for backward: the product saves it as it is (keep_a).
  auto matmul = [fused, bf16](const at::Tensor& a, const at::Tensor& b, bool keep_a) {
    return fused ? kernels::BatchedMatmul(a, b, bf16, keep_a) : at::matmul(a, b);
  };
  at::Tensor scores = matmul(q, k.transpose(-2, -1), false) * scale;
  if (const double cap = config_.attn_logit_softcapping; cap > 0) {
    // Gemma 2: cap * tanh(s / cap) on the scaled scores, before the mask.
    scores = at::tanh(scores * (1.0 / cap)) * cap;
  }
  at::Tensor out = matmul(at::softmax(scores + mask, -1, at::kFloat).to(v.scalar_type()), v, true);
  out = out.transpose(1, 2).reshape({batch, seq, heads * head_dim});
  return layer.o_proj.Forward(out, lora_dropout_, training_, fused);
}

at::Tensor CausalLm::Block(int64_t layer_index, const at::Tensor& x, const at::Tensor& cos,
                           const at::Tensor& sin, const at::Tensor& mask) const {
  // Also around its recomputation in backward (activation checkpointing).
  ProfileScope scope("forward/block", layer_index);
  const DecoderLayer& layer = layers_[layer_index];
  const bool fused = options_.fused_kernels;
  if (IsGemma(config_)) {
    // Gemma normalises the attention's and the MLP's outputs too, and its MLP is GeGLU.
    at::Tensor y = x + Norm(Attention(layer, Norm(x, layer.input_norm), cos, sin, mask),
                            layer.post_attention_norm);
    at::Tensor h = Norm(y, layer.pre_feedforward_norm);
    at::Tensor gate = layer.gate_proj.Forward(h, lora_dropout_, training_, fused);
    at::Tensor up = layer.up_proj.Forward(h, lora_dropout_, training_, fused);
    at::Tensor down = layer.down_proj.Forward(
        fused ? kernels::GeGlu(gate, up) : kernels::unfused::GeGlu(gate, up), lora_dropout_,
        training_, fused);
    return y + Norm(down, layer.post_feedforward_norm);
  }
  at::Tensor y = x + Attention(layer, Norm(x, layer.input_norm), cos, sin, mask);
  at::Tensor h = Norm(y, layer.post_attention_norm);
  at::Tensor gate, up;
  if (config_.model_type == "phi3") {
    // Phi-3: the gate rows, then the up rows (transformers' chunk(2)).
    at::Tensor gate_up = layer.gate_up_proj.Forward(h, lora_dropout_, training_, fused);
    gate = gate_up.narrow(-1, 0, config_.intermediate_size);
    up = gate_up.narrow(-1, config_.intermediate_size, config_.intermediate_size);
  } else {
    gate = layer.gate_proj.Forward(h, lora_dropout_, training_, fused);
    up = layer.up_proj.Forward(h, lora_dropout_, training_, fused);
  }
  return y + layer.down_proj.Forward(
                 fused ? kernels::SwiGlu(gate, up) : kernels::unfused::SwiGlu(gate, up),
                 lora_dropout_, training_, fused);
}

at::Tensor CausalLm::Hidden(const at::Tensor& input_ids) const {
  const int64_t seq = input_ids.size(1);
  const at::ScalarType type = options_.compute_dtype;
  // The pad_token_id row gets no gradient from the lookup: every family's transformers
  // module is nn.Embedding(vocab, hidden, padding_idx=config.pad_token_id). It matters where
  // the embeddings train (full fine-tuning, modules_to_save) and pad_token_id occurs in the
  // data (often it is the EOS token).
  const int64_t padding_idx = config_.pad_token_id.value_or(-1);
  std::optional<ProfileScope> embeddings_scope;
  embeddings_scope.emplace("forward/embeddings");
  // Entered first: under ZeRO-3 the unit's slots hold its weights only once entered.
  const at::Tensor ids = hooks_ ? hooks_->Enter(0, input_ids) : input_ids;
  const at::Tensor& table = embedding();
  at::Tensor x = at::embedding(table, ids, padding_idx).to(type);
  if (IsGemma(config_)) {
    // Gemma scales the embeddings by sqrt(hidden_size), rounded as transformers rounds it: to
    // the embeddings' dtype (and here to the compute dtype too): 55.5, not 55.43, in bfloat16.
    // The base's dtype also for a modules_to_save copy, float32 here but the model's own
    // dtype in PEFT.
    const double normalizer =
        at::scalar_tensor(std::sqrt(static_cast<double>(config_.hidden_size)), at::kDouble)
            .to(embed_tokens_.scalar_type())
            .to(type)
            .item<double>();
    x = x * normalizer;
  }
  if (hooks_) x = hooks_->Leave(0, x);
  embeddings_scope.reset();
  auto [cos, sin] = RopeTables(seq, inv_freq_);
  at::Tensor local_cos = cos, local_sin = sin;
  if (local_inv_freq_.defined()) std::tie(local_cos, local_sin) = RopeTables(seq, local_inv_freq_);
  const at::TensorOptions mask_options = at::TensorOptions(type).device(options_.device);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const bool sliding = config_.sliding_window && *config_.sliding_window < seq;
  // Additive masks, of the global layers and of the sliding ones (Gemma has both; the others
  // one kind). Undefined with libtorch's fused attention and no sliding window.
  at::Tensor mask;
  if (!FusedSdpa(seq)) mask = at::full({seq, seq}, neg_inf, mask_options).triu(1);
  at::Tensor sliding_mask = mask;
  if (sliding) {
    sliding_mask = at::full({seq, seq}, neg_inf, mask_options).triu(1) +
                   at::full({seq, seq}, neg_inf, mask_options).tril(-*config_.sliding_window);
  }
  const bool checkpoint =
      options_.activation_checkpointing && training_ && at::GradMode::is_enabled();
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    if (hooks_) x = hooks_->Enter(l + 1, x);
    const at::Tensor& layer_mask = LayerSlides(config_, l) ? sliding_mask : mask;
    const bool local = local_inv_freq_.defined() && config_.sliding_layers[l];
    const at::Tensor& layer_cos = local ? local_cos : cos;
    const at::Tensor& layer_sin = local ? local_sin : sin;
    if (!checkpoint) {
      x = Block(l, x, layer_cos, layer_sin, layer_mask);
    } else {
      std::vector<at::Tensor> inputs = {x, layer_cos, layer_sin};
      for (at::Tensor& t : layers_[l].TrainableTensors()) inputs.push_back(std::move(t));
      x = CheckpointedBlock::apply(at::TensorList(inputs), this, l, &layer_mask);
    }
    if (hooks_) x = hooks_->Leave(l + 1, x);
  }
  if (hooks_) x = hooks_->Enter(num_units() - 1, x);  // left by SumLossOfHidden or Logits
  return Norm(x, norm_);
}

at::Tensor CausalLm::LeaveHead(const at::Tensor& output) const {
  return hooks_ ? hooks_->Leave(num_units() - 1, output) : output;
}

at::Tensor CausalLm::Norm(const at::Tensor& x, const at::Tensor& weight) const {
  if (IsGemma(config_)) {
    // (1 + weight), in float32: the fused kernel multiplies by its float32 weight before its
    // one rounding, as Gemma's norm does.
    return options_.fused_kernels
               ? kernels::RmsNorm(x, weight.to(at::kFloat) + 1.0, config_.rms_norm_eps)
               : kernels::unfused::GemmaRmsNorm(x, weight, config_.rms_norm_eps);
  }
  return options_.fused_kernels ? kernels::RmsNorm(x, weight, config_.rms_norm_eps)
                                : kernels::unfused::RmsNorm(x, weight, config_.rms_norm_eps);
}

at::Tensor CausalLm::HeadLogits(const at::Tensor& hidden) const {
  at::Tensor logits =
      (options_.fused_kernels
           ? kernels::LoraLinear(hidden, lm_head(), {}, {}, {}, 0.0, 0.0, false)
           : kernels::unfused::LoraLinear(hidden, lm_head(), {}, {}, {}, 0.0, 0.0, false))
          .to(at::kFloat);
  if (const double cap = config_.final_logit_softcapping; cap > 0) {
    logits = at::tanh(logits * (1.0 / cap)) * cap;  // Gemma 2
  }
  return logits;
}

at::Tensor CausalLm::Logits(const at::Tensor& input_ids) const {
  return LeaveHead(HeadLogits(Hidden(input_ids)));
}

at::Tensor CausalLm::SumLoss(const at::Tensor& input_ids, const at::Tensor& labels) const {
  return SumLossOfHidden(Hidden(input_ids), labels);
}

at::Tensor CausalLm::SumLossOfHidden(const at::Tensor& all_hidden, const at::Tensor& labels) const {
  const int64_t seq = all_hidden.size(1);
  at::Tensor hidden = all_hidden.slice(1, 0, seq - 1).reshape({-1, config_.hidden_size});
  at::Tensor targets = labels.slice(1, 1, seq).reshape({-1});
  // Only rows with a target need logits: prompts and padding cost nothing here.
  at::Tensor rows = targets.ne(-100).nonzero().squeeze(1);
  MemoryScope scope(MemoryComponent::kLogits);
  at::Tensor target_hidden = hidden.index_select(0, rows);
  at::Tensor target_ids = targets.index_select(0, rows);
  if (!options_.chunked_loss) {
    return LeaveHead(
        at::cross_entropy_loss(HeadLogits(target_hidden), target_ids, {}, at::Reduction::Sum));
  }
  // Chunk by chunk, never the [targets, vocab] logits. The kernel takes float32 hidden with a
  // frozen bfloat16 head on the CPU as it is (a bf16 job there: bfloat16 products where the CPU
  // has them); any other 16-bit head under float32 compute (fp16 on the CPU, a head that
  // trains) is widened for the call.
  const at::Tensor& head = lm_head();
  const bool as_is =
      head.scalar_type() == target_hidden.scalar_type() ||
      (target_hidden.scalar_type() == at::kFloat && head.scalar_type() == at::kBFloat16 &&
       !head.requires_grad() && target_hidden.is_cpu());
  kernels::LinearCrossEntropyOptions loss_options;
  loss_options.softcap = config_.final_logit_softcapping;  // Gemma 2; 0: none
  return LeaveHead(kernels::LinearCrossEntropy(target_hidden,
                                               as_is ? head : head.to(target_hidden.scalar_type()),
                                               target_ids, loss_options));
}

std::vector<UnitTensor> CausalLm::UnitTensors(int64_t unit) {
  TORCH_CHECK(unit >= 0 && unit < num_units(), "no unit ", unit);
  const bool head = unit == num_units() - 1;
  const std::string block_prefix = absl::StrCat("model.layers.", unit - 1, ".");
  std::vector<UnitTensor> tensors;
  for (auto& [name, slot] : BaseWeights()) {
    const bool mine = unit == 0 ? name == "model.embed_tokens.weight"
                      : head    ? name == "model.norm.weight" || name == "lm_head.weight"
                                : absl::StartsWith(name, block_prefix);
    if (mine) tensors.push_back({name, slot, trainable_base_, DecaysWeight(name)});
  }
  if (unit == 0 && saved_.embed_tokens) {
    tensors.push_back({kPeftSavedEmbedTokens, &saved_embed_tokens_, true, true});
  }
  if (head && saved_.lm_head) tensors.push_back({kPeftSavedLmHead, &saved_lm_head_, true, true});
  if (unit == 0 || head) return tensors;
  for (const std::string& module : ProjectionModules(config_)) {
    Projection& p = layers_[unit - 1].projection(module);
    if (!p.lora_a.defined()) continue;
    tensors.push_back({PeftLoraTensorName(unit - 1, module, "A"), &p.lora_a, true, true});
    tensors.push_back({PeftLoraTensorName(unit - 1, module, "B"), &p.lora_b, true, true});
  }
  return tensors;
}

std::vector<std::pair<std::string, kernels::Nf4Weight*>> CausalLm::UnitNf4Weights(int64_t unit) {
  TORCH_CHECK(unit >= 0 && unit < num_units(), "no unit ", unit);
  std::vector<std::pair<std::string, kernels::Nf4Weight*>> weights;
  if (unit == 0 || unit == num_units() - 1) return weights;
  for (const std::string& module : ProjectionModules(config_)) {
    Projection& p = layers_[unit - 1].projection(module);
    if (p.nf4.defined()) {
      weights.emplace_back(absl::StrCat("model.layers.", unit - 1, ".", module), &p.nf4);
    }
  }
  return weights;
}

std::vector<NamedParameter> CausalLm::TrainableParameters() {
  std::vector<NamedParameter> params;
  if (lora_rank_ > 0) {
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
      for (const std::string& module : ProjectionModules(config_)) {
        Projection& p = layers_[l].projection(module);
        if (!p.lora_a.defined()) continue;
        params.push_back({PeftLoraTensorName(l, module, "A"), p.lora_a, true});
        params.push_back({PeftLoraTensorName(l, module, "B"), p.lora_b, true});
      }
    }
    // AdamW decays them, as transformers' Trainer does (not a bias, not a norm).
    if (saved_.embed_tokens) params.push_back({kPeftSavedEmbedTokens, saved_embed_tokens_, true});
    if (saved_.lm_head) params.push_back({kPeftSavedLmHead, saved_lm_head_, true});
    return params;
  }
  for (auto& [name, slot] : BaseWeights()) {
    if (!slot->requires_grad()) continue;
    params.push_back({name, *slot, DecaysWeight(name)});
  }
  return params;
}

absl::Status CausalLm::ExportAdapter(const std::string& dir,
                                     const PeftAdapterConfig& config) const {
  TensorsToWrite tensors;
  try {
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
      for (const std::string& module : ProjectionModules(config_)) {
        const Projection& p = layers_[l].projection(module);
        if (!p.lora_a.defined()) continue;
        tensors.Add(PeftLoraTensorName(l, module, "A"), p.lora_a);
        tensors.Add(PeftLoraTensorName(l, module, "B"), p.lora_b);
      }
    }
    // PEFT saves a ModulesToSaveWrapper's copy under the wrapped module's own name.
    if (saved_.embed_tokens) tensors.Add(kPeftSavedEmbedTokens, saved_embed_tokens_);
    if (saved_.lm_head) tensors.Add(kPeftSavedLmHead, saved_lm_head_);
  } catch (const c10::Error& e) {
    return StatusFromTorchError(e, "exporting the adapter");
  }
  return WritePeftAdapter(dir, config, tensors.tensors());
}

std::vector<std::pair<std::string, at::Tensor>> CausalLm::NamedBaseWeights() const {
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (auto& [name, slot] : const_cast<CausalLm*>(this)->BaseWeights()) {
    named.emplace_back(name, *slot);
  }
  return named;
}

absl::Status CausalLm::ExportModel(const std::string& dir) const {
  TensorsToWrite tensors;
  try {
    for (const auto& [name, tensor] : NamedBaseWeights()) tensors.Add(name, tensor);
  } catch (const c10::Error& e) {
    return StatusFromTorchError(e, "exporting the model");
  }
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return absl::InternalError(absl::StrCat(dir, ": ", error.message()));
  LATHE_RETURN_IF_ERROR(
      WriteSafetensors(dir + "/model.safetensors", tensors.tensors(), {{"format", "pt"}}));
  return WriteExportedConfig(dir);
}

absl::Status CausalLm::MergeLora() {
  if (config_.tie_word_embeddings && saved_.any()) {
    // A copy replaces one use of the tied weight (or two copies trained apart): the merged
    // model would need untied embed_tokens and lm_head, which its config cannot say here.
    return absl::FailedPreconditionError(
        "merging modules_to_save copies of tied embeddings: the merged model would need untied "
        "embed_tokens and lm_head");
  }
  try {
    at::NoGradGuard no_grad;
    for (DecoderLayer& layer : layers_) {
      for (const std::string& module : ProjectionModules(config_)) {
        Projection& p = layer.projection(module);
        if (!p.lora_a.defined()) continue;
        if (!p.weight.defined()) {
          return absl::FailedPreconditionError(
              "merging an adapter into NF4 weights: load the base model unquantized");
        }
        const at::Tensor delta = at::matmul(p.lora_b.to(at::kFloat), p.lora_a.to(at::kFloat));
        p.weight = (p.weight.to(at::kFloat) + p.lora_scale * delta).to(p.weight.scalar_type());
        p.lora_a = at::Tensor();
        p.lora_b = at::Tensor();
        p.lora_scale = 0.0;
      }
    }
    if (saved_.embed_tokens) {
      embed_tokens_ = saved_embed_tokens_.detach().to(embed_tokens_.scalar_type());
      saved_embed_tokens_ = at::Tensor();
    }
    if (saved_.lm_head) {
      lm_head_ = saved_lm_head_.detach().to(lm_head_.scalar_type());
      saved_lm_head_ = at::Tensor();
    }
    saved_ = SavedModules();
  } catch (const c10::Error& e) {
    return StatusFromTorchError(e, "merging the adapter");
  }
  return absl::OkStatus();
}

absl::Status CausalLm::WriteExportedConfig(const std::string& dir) const {
  ModelConfig exported = config_;
  exported.torch_dtype = "float32";
  return WriteFileAtomically(dir + "/config.json", ModelConfigToJson(exported));
}

}  // namespace lathe
