#include "worker/engine/causal_lm.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "worker/engine/memory_tracker.h"
#include "worker/engine/weights.h"

namespace lathe {
namespace {

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * weight;
}

at::Tensor RotateHalf(const at::Tensor& x) {
  int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

std::string ShapeText(at::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

double LoraScale(const LoraSpec& spec) {
  return spec.use_rslora ? spec.alpha / std::sqrt(static_cast<double>(spec.rank))
                         : spec.alpha / static_cast<double>(spec.rank);
}

}  // namespace

at::Tensor Projection::Forward(const at::Tensor& x, double lora_dropout, bool training) const {
  at::Tensor y = at::linear(x, weight, bias);
  if (!lora_a.defined()) return y;
  at::Tensor lora_in = training && lora_dropout > 0 ? at::dropout(x, lora_dropout, true) : x;
  return y + at::linear(at::linear(lora_in, lora_a), lora_b) * lora_scale;
}

Projection& DecoderLayer::projection(absl::string_view module) {
  return const_cast<Projection&>(std::as_const(*this).projection(module));
}

const Projection& DecoderLayer::projection(absl::string_view module) const {
  if (module == "q_proj") return q_proj;
  if (module == "k_proj") return k_proj;
  if (module == "v_proj") return v_proj;
  if (module == "o_proj") return o_proj;
  if (module == "gate_proj") return gate_proj;
  if (module == "up_proj") return up_proj;
  TORCH_CHECK(module == "down_proj", "unknown projection ", std::string(module));
  return down_proj;
}

at::Tensor RopeInverseFrequencies(const ModelConfig& config) {
  const int64_t dim = config.head_dim;
  at::Tensor exponents = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  at::Tensor inv_freq = 1.0 / at::pow(config.rope_theta, exponents);
  const RopeScaling& scaling = config.rope_scaling;
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

CausalLm::CausalLm(const ModelConfig& config)
    : config_(config),
      layers_(config.num_hidden_layers),
      inv_freq_(RopeInverseFrequencies(config)) {}

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
    for (const std::string& module : LoraTargetModules()) {
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
                                                         bool trainable_base) {
  std::unique_ptr<CausalLm> model(new CausalLm(config));
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
      LATHE_ASSIGN_OR_RETURN(*slot, TensorFromFile(entry, at::kFloat, trainable_base));
      if (trainable_base) slot->set_requires_grad(true);
    }
  } catch (const c10::Error& e) {
    return StatusFromTorchError(e, absl::StrCat("loading ", dir));
  }
  return model;
}

void CausalLm::InitLora(const LoraSpec& spec, uint64_t seed) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  lora_targets_ = spec.targets;
  lora_rank_ = spec.rank;
  lora_dropout_ = spec.dropout;
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    for (const std::string& module : LoraTargetModules()) {
      if (std::find(spec.targets.begin(), spec.targets.end(), module) == spec.targets.end()) {
        continue;
      }
      ProjectionShape shape = ProjectionShapeOf(config_, module);
      Projection& p = layers_[l].projection(module);
      double bound = 1.0 / std::sqrt(static_cast<double>(shape.in_features));
      p.lora_a = at::empty({spec.rank, shape.in_features}, at::kFloat)
                     .uniform_(-bound, bound, generator)
                     .set_requires_grad(true);
      p.lora_b = at::zeros({shape.out_features, spec.rank}, at::kFloat).set_requires_grad(true);
      p.lora_scale = LoraScale(spec);
    }
  }
}

absl::Status CausalLm::LoadLora(const LoraSpec& spec, const std::string& dir) {
  const std::string config_path = dir + "/adapter_config.json";
  LATHE_ASSIGN_OR_RETURN(std::string config_text, ReadFile(config_path));
  LATHE_ASSIGN_OR_RETURN(PeftAdapterConfig adapter,
                         ParsePeftAdapterConfig(config_text, config_path));
  if (adapter.r != spec.rank) {
    return absl::InvalidArgumentError(absl::StrCat("lora.init_from: ", config_path, ": r is ",
                                                   adapter.r, " but lora.rank is ", spec.rank));
  }
  const std::string weights_path = dir + "/adapter_model.safetensors";
  LATHE_ASSIGN_OR_RETURN(std::shared_ptr<const SafetensorsFile> file,
                         SafetensorsFile::Open(weights_path));
  InitLora(spec, /*seed=*/0);  // shapes and flags; values replaced below
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    for (const std::string& module : spec.targets) {
      ProjectionShape shape = ProjectionShapeOf(config_, module);
      Projection& p = layers_[l].projection(module);
      for (auto [which, tensor, want] :
           {std::tuple{"A", &p.lora_a, std::vector<int64_t>{spec.rank, shape.in_features}},
            std::tuple{"B", &p.lora_b, std::vector<int64_t>{shape.out_features, spec.rank}}}) {
        std::string name = PeftLoraTensorName(l, module, which);
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
        *tensor = loaded.set_requires_grad(true);
      }
    }
  }
  return absl::OkStatus();
}

const at::Tensor& CausalLm::lm_head() const {
  return config_.tie_word_embeddings ? embed_tokens_ : lm_head_;
}

std::pair<at::Tensor, at::Tensor> CausalLm::RopeTables(int64_t seq) const {
  at::Tensor positions = at::arange(seq, at::kFloat);
  at::Tensor freqs = at::outer(positions, inv_freq_);
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos(), emb.sin()};
}

at::Tensor CausalLm::Attention(const DecoderLayer& layer, const at::Tensor& x,
                               const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& mask) const {
  const int64_t batch = x.size(0), seq = x.size(1);
  const int64_t heads = config_.num_attention_heads, kv_heads = config_.num_key_value_heads;
  const int64_t head_dim = config_.head_dim;
  at::Tensor q = layer.q_proj.Forward(x, lora_dropout_, training_)
                     .view({batch, seq, heads, head_dim})
                     .transpose(1, 2);
  at::Tensor k = layer.k_proj.Forward(x, lora_dropout_, training_)
                     .view({batch, seq, kv_heads, head_dim})
                     .transpose(1, 2);
  at::Tensor v = layer.v_proj.Forward(x, lora_dropout_, training_)
                     .view({batch, seq, kv_heads, head_dim})
                     .transpose(1, 2);
  q = q * cos + RotateHalf(q) * sin;
  k = k * cos + RotateHalf(k) * sin;
  if (kv_heads != heads) {
    k = k.repeat_interleave(heads / kv_heads, 1);
    v = v.repeat_interleave(heads / kv_heads, 1);
  }
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(head_dim)));
  at::Tensor probs = at::softmax(scores + mask, -1);
  at::Tensor out = at::matmul(probs, v).transpose(1, 2).reshape({batch, seq, heads * head_dim});
  return layer.o_proj.Forward(out, lora_dropout_, training_);
}

at::Tensor CausalLm::Hidden(const at::Tensor& input_ids) const {
  const int64_t seq = input_ids.size(1);
  at::Tensor x = at::embedding(embed_tokens_, input_ids);
  auto [cos, sin] = RopeTables(seq);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::Tensor mask = at::full({seq, seq}, neg_inf, at::kFloat).triu(1);
  if (config_.sliding_window && *config_.sliding_window < seq) {
    mask = mask + at::full({seq, seq}, neg_inf, at::kFloat).tril(-*config_.sliding_window);
  }
  const double eps = config_.rms_norm_eps;
  for (const DecoderLayer& layer : layers_) {
    x = x + Attention(layer, RmsNorm(x, layer.input_norm, eps), cos, sin, mask);
    at::Tensor h = RmsNorm(x, layer.post_attention_norm, eps);
    at::Tensor gate = layer.gate_proj.Forward(h, lora_dropout_, training_);
    at::Tensor up = layer.up_proj.Forward(h, lora_dropout_, training_);
    x = x + layer.down_proj.Forward(at::silu(gate) * up, lora_dropout_, training_);
  }
  return RmsNorm(x, norm_, eps);
}

at::Tensor CausalLm::Logits(const at::Tensor& input_ids) const {
  return at::matmul(Hidden(input_ids), lm_head().t());
}

at::Tensor CausalLm::SumLoss(const at::Tensor& input_ids, const at::Tensor& labels) const {
  const int64_t seq = input_ids.size(1);
  at::Tensor hidden = Hidden(input_ids).slice(1, 0, seq - 1).reshape({-1, config_.hidden_size});
  at::Tensor targets = labels.slice(1, 1, seq).reshape({-1});
  // Only rows with a target need logits: prompts and padding cost nothing here.
  at::Tensor rows = targets.ne(-100).nonzero().squeeze(1);
  MemoryScope scope(MemoryComponent::kLogits);
  at::Tensor logits = at::matmul(hidden.index_select(0, rows), lm_head().t());
  return at::cross_entropy_loss(logits, targets.index_select(0, rows), {}, at::Reduction::Sum);
}

std::vector<NamedParameter> CausalLm::TrainableParameters() {
  std::vector<NamedParameter> params;
  if (lora_rank_ > 0) {
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
      for (const std::string& module : LoraTargetModules()) {
        Projection& p = layers_[l].projection(module);
        if (!p.lora_a.defined()) continue;
        params.push_back({PeftLoraTensorName(l, module, "A"), p.lora_a, true});
        params.push_back({PeftLoraTensorName(l, module, "B"), p.lora_b, true});
      }
    }
    return params;
  }
  for (auto& [name, slot] : BaseWeights()) {
    if (!slot->requires_grad()) continue;
    bool no_decay = absl::EndsWith(name, ".bias") || absl::EndsWith(name, "norm.weight");
    params.push_back({name, *slot, !no_decay});
  }
  return params;
}

absl::Status CausalLm::ExportAdapter(const std::string& dir,
                                     const PeftAdapterConfig& config) const {
  TensorsToWrite tensors;
  try {
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
      for (const std::string& module : LoraTargetModules()) {
        const Projection& p = layers_[l].projection(module);
        if (!p.lora_a.defined()) continue;
        tensors.Add(PeftLoraTensorName(l, module, "A"), p.lora_a);
        tensors.Add(PeftLoraTensorName(l, module, "B"), p.lora_b);
      }
    }
  } catch (const c10::Error& e) {
    return StatusFromTorchError(e, "exporting the adapter");
  }
  return WritePeftAdapter(dir, config, tensors.tensors());
}

absl::Status CausalLm::ExportModel(const std::string& dir) const {
  TensorsToWrite tensors;
  try {
    for (auto& [name, slot] : const_cast<CausalLm*>(this)->BaseWeights()) tensors.Add(name, *slot);
  } catch (const c10::Error& e) {
    return StatusFromTorchError(e, "exporting the model");
  }
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return absl::InternalError(absl::StrCat(dir, ": ", error.message()));
  LATHE_RETURN_IF_ERROR(
      WriteSafetensors(dir + "/model.safetensors", tensors.tensors(), {{"format", "pt"}}));
  ModelConfig exported = config_;
  exported.torch_dtype = "float32";
  return WriteFileAtomically(dir + "/config.json", ModelConfigToJson(exported));
}

}  // namespace lathe
