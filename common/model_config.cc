#include "common/model_config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/capabilities.h"
#include "common/file_util.h"
#include "common/json_fields.h"
#include "common/status_macros.h"

namespace lathe {
namespace {

using Json = nlohmann::json;

// Keys that mark a mixture-of-experts config (Mixtral, Qwen2-MoE and Qwen3-MoE, DeepSeek,
// ...): refused by name (docs/mixture-of-experts.md).
constexpr absl::string_view kExpertKeys[] = {"num_local_experts", "num_experts", "n_routed_experts",
                                             "moe_num_experts"};

absl::string_view DefaultArchitecture(absl::string_view model_type) {
  if (model_type == "mistral") return "MistralForCausalLM";
  if (model_type == "qwen2") return "Qwen2ForCausalLM";
  if (model_type == "qwen3") return "Qwen3ForCausalLM";
  if (model_type == "gemma2") return "Gemma2ForCausalLM";
  if (model_type == "gemma3_text") return "Gemma3ForCausalLM";
  if (model_type == "phi3") return "Phi3ForCausalLM";
  return "LlamaForCausalLM";
}

// A list of numbers (LongRoPE's factors), each finite and > 0.
absl::StatusOr<std::vector<double>> PositiveNumbers(const ConfigFields& fields,
                                                    absl::string_view key) {
  const Json* value = fields.Find(key);
  if (value == nullptr) return fields.Error(key, "required field is missing");
  if (!value->is_array()) {
    return fields.Error(key,
                        absl::StrCat("expected a list of numbers, got ", DescribeJson(*value)));
  }
  std::vector<double> numbers;
  for (size_t i = 0; i < value->size(); ++i) {
    const Json& entry = (*value)[i];
    if (!entry.is_number() || !std::isfinite(entry.get<double>()) || entry.get<double>() <= 0) {
      return fields.Error(
          key, absl::StrCat("entry ", i, ": expected a number > 0, got ", DescribeJson(entry)));
    }
    numbers.push_back(entry.get<double>());
  }
  return numbers;
}

// LongRoPE's factors of the "rope_scaling" (or "rope_parameters") object `fields`; the
// factor and the attention factor follow from the top-level keys (FinishLongRope).
absl::StatusOr<RopeScaling> ParseLongRope(const ConfigFields& fields) {
  RopeScaling scaling;
  scaling.kind = RopeScaling::Kind::kLongRope;
  LATHE_ASSIGN_OR_RETURN(scaling.short_factor, PositiveNumbers(fields, "short_factor"));
  LATHE_ASSIGN_OR_RETURN(scaling.long_factor, PositiveNumbers(fields, "long_factor"));
  LATHE_ASSIGN_OR_RETURN(std::optional<double> factor, fields.Double("factor"));
  if (factor.has_value()) {
    if (!std::isfinite(*factor) || *factor <= 0) {
      return fields.Error("factor", absl::StrCat("must be > 0, got ", *factor));
    }
    scaling.factor = *factor;
  } else {
    scaling.factor = 0;  // max_position_embeddings / original_max_position_embeddings
  }
  LATHE_ASSIGN_OR_RETURN(std::optional<double> attention, fields.Double("attention_factor"));
  if (attention.has_value()) {
    if (!std::isfinite(*attention) || *attention <= 0) {
      return fields.Error("attention_factor", absl::StrCat("must be > 0, got ", *attention));
    }
    scaling.attention_factor = *attention;
  } else {
    scaling.attention_factor = 0;  // from the factor
  }
  return scaling;
}

// Phi-3's LongRoPE as transformers completes it: original_max_position_embeddings from the
// top level (Phi3Config's field, default 4096, preferred over the scaling object's), the
// factor and the attention factor where not given, the factors' lengths against the rotary
// dimension.
absl::Status FinishLongRope(const ConfigFields& fields, absl::string_view key,
                            ModelConfig& config) {
  RopeScaling& scaling = config.rope_scaling;
  LATHE_ASSIGN_OR_RETURN(std::optional<int64_t> original,
                         fields.Int("original_max_position_embeddings"));
  scaling.original_max_position_embeddings = original.value_or(4096);
  if (scaling.original_max_position_embeddings <= 0) {
    return fields.Error("original_max_position_embeddings",
                        absl::StrCat("must be > 0, got ", *original));
  }
  if (scaling.factor == 0) {
    scaling.factor = static_cast<double>(config.max_position_embeddings) /
                     static_cast<double>(scaling.original_max_position_embeddings);
  }
  if (scaling.attention_factor == 0) {
    scaling.attention_factor =
        scaling.factor <= 1.0
            ? 1.0
            : std::sqrt(
                  1 + std::log(scaling.factor) /
                          std::log(static_cast<double>(scaling.original_max_position_embeddings)));
  }
  const size_t pairs = static_cast<size_t>(RotaryDim(config) / 2);
  for (const auto& [name, factors] : {std::pair{"short_factor", &scaling.short_factor},
                                      std::pair{"long_factor", &scaling.long_factor}}) {
    if (factors->size() != pairs) {
      return fields.Error(
          absl::StrCat(key, ".", name),
          absl::StrCat(factors->size(), " entries for ", pairs, " rotary frequencies (head_dim ",
                       config.head_dim, " x partial_rotary_factor ", config.partial_rotary_factor,
                       " / 2)"));
    }
  }
  return absl::OkStatus();
}

// The scaling of the "rope_scaling" object (transformers 4), or of "rope_parameters"
// (transformers 5, `key`), which also holds rope_theta; `top` reads the top-level keys.
// Phi-3 takes default and longrope only (and "su" and "yarn", which transformers renames
// longrope); the others take default, linear and llama3.
absl::StatusOr<RopeScaling> ParseRopeScaling(const ConfigFields& top, absl::string_view source,
                                             absl::string_view key, absl::string_view model_type,
                                             absl::string_view outer_prefix = "") {
  RopeScaling scaling;
  const Json* value = top.Find(key);
  if (value == nullptr) return scaling;
  if (!value->is_object()) {
    return top.Error(key, absl::StrCat("expected an object or null, got ", DescribeJson(*value)));
  }
  ConfigFields fields(*value, source, absl::StrCat(outer_prefix, key, "."));
  // Transformers >= 4.43 writes "rope_type"; older configs write "type".
  LATHE_ASSIGN_OR_RETURN(std::optional<std::string> type, fields.String("rope_type"));
  if (!type.has_value()) {
    LATHE_ASSIGN_OR_RETURN(type, fields.String("type"));
  }
  if (!type.has_value()) return fields.Error("rope_type", "required field is missing");
  if (*type == "default") return scaling;

  if (model_type == "phi3") {
    if (*type == "longrope" || *type == "su" || *type == "yarn") return ParseLongRope(fields);
    return fields.Error("rope_type", absl::StrCat("unsupported \"", *type,
                                                  "\" for phi3 (supported: default, longrope)"));
  }
  if (*type == "linear") {
    scaling.kind = RopeScaling::Kind::kLinear;
  } else if (*type == "llama3") {
    scaling.kind = RopeScaling::Kind::kLlama3;
  } else {
    return fields.Error("rope_type", absl::StrCat("unsupported \"", *type,
                                                  "\" (supported: default, linear, llama3)"));
  }
  LATHE_ASSIGN_OR_RETURN(scaling.factor, fields.RequiredDouble("factor"));
  if (!std::isfinite(scaling.factor) || scaling.factor < 1.0) {
    return fields.Error("factor", absl::StrCat("must be >= 1, got ", scaling.factor));
  }
  if (scaling.kind == RopeScaling::Kind::kLinear) return scaling;

  LATHE_ASSIGN_OR_RETURN(scaling.low_freq_factor, fields.RequiredDouble("low_freq_factor"));
  LATHE_ASSIGN_OR_RETURN(scaling.high_freq_factor, fields.RequiredDouble("high_freq_factor"));
  if (!std::isfinite(scaling.low_freq_factor) || scaling.low_freq_factor <= 0) {
    return fields.Error("low_freq_factor",
                        absl::StrCat("must be > 0, got ", scaling.low_freq_factor));
  }
  if (!std::isfinite(scaling.high_freq_factor) ||
      scaling.high_freq_factor <= scaling.low_freq_factor) {
    return fields.Error("high_freq_factor",
                        absl::StrCat("must be > low_freq_factor ", scaling.low_freq_factor,
                                     ", got ", scaling.high_freq_factor));
  }
  LATHE_ASSIGN_OR_RETURN(std::optional<int64_t> original,
                         fields.Int("original_max_position_embeddings"));
  if (!original.has_value()) {
    return fields.Error("original_max_position_embeddings", "required field is missing");
  }
  if (*original <= 0) {
    return fields.Error("original_max_position_embeddings",
                        absl::StrCat("must be > 0, got ", *original));
  }
  scaling.original_max_position_embeddings = *original;
  return scaling;
}

// "layer_types" (transformers 5, and Gemma): per layer, whether it is "sliding_attention"
// rather than "full_attention"; nullopt when absent or null.
absl::StatusOr<std::optional<std::vector<bool>>> ParseLayerTypes(const ConfigFields& fields,
                                                                 int64_t num_layers) {
  const Json* types = fields.Find("layer_types");
  if (types == nullptr) return std::nullopt;
  if (!types->is_array()) {
    return fields.Error("layer_types", absl::StrCat("expected a list, got ", DescribeJson(*types)));
  }
  std::vector<bool> sliding;
  for (size_t i = 0; i < types->size(); ++i) {
    const Json& type = (*types)[i];
    if (type != "sliding_attention" && type != "full_attention") {
      return fields.Error("layer_types", absl::StrCat("entry ", i,
                                                      ": expected \"full_attention\" "
                                                      "or \"sliding_attention\", got ",
                                                      DescribeJson(type)));
    }
    sliding.push_back(type == "sliding_attention");
  }
  if (static_cast<int64_t>(sliding.size()) != num_layers) {
    return fields.Error("layer_types",
                        absl::StrCat(sliding.size(), " entries for ", num_layers, " layers"));
  }
  return sliding;
}

// The window each position attends within, by the rules of each model type's
// transformers implementation.
absl::StatusOr<std::optional<int64_t>> ParseSlidingWindow(const ConfigFields& fields,
                                                          const ModelConfig& config) {
  if (config.model_type == "llama") return std::nullopt;
  const bool qwen = config.model_type == "qwen2" || config.model_type == "qwen3";
  if (qwen) {
    LATHE_ASSIGN_OR_RETURN(bool use, fields.BoolOr("use_sliding_window", false));
    if (!use) return std::nullopt;
  }
  LATHE_ASSIGN_OR_RETURN(std::optional<int64_t> window, fields.Int("sliding_window"));
  if (!window.has_value()) return std::nullopt;
  if (*window <= 0)
    return fields.Error("sliding_window", absl::StrCat("must be > 0, got ", *window));
  if (qwen) {
    // Transformers 5 writes which layers slide as "layer_types", and follows it over
    // max_window_layers. A window on some layers but not others is not representable here,
    // so refuse it rather than train a different model.
    LATHE_ASSIGN_OR_RETURN(std::optional<std::vector<bool>> types,
                           ParseLayerTypes(fields, config.num_hidden_layers));
    if (types.has_value()) {
      std::vector<int64_t> sliding;
      for (size_t i = 0; i < types->size(); ++i) {
        if ((*types)[i]) sliding.push_back(static_cast<int64_t>(i));
      }
      if (sliding.empty()) return std::nullopt;
      if (static_cast<int64_t>(sliding.size()) < config.num_hidden_layers) {
        return fields.Error("layer_types",
                            absl::StrCat("a sliding window on layers ", absl::StrJoin(sliding, ","),
                                         " only is not supported (all layers or none)"));
      }
      return window;
    }
    // Before (and without layer_types): Qwen2 and Qwen3 slide only in layers >=
    // max_window_layers (transformers' default 28).
    LATHE_ASSIGN_OR_RETURN(std::optional<int64_t> max_window_layers,
                           fields.Int("max_window_layers"));
    int64_t first_sliding = max_window_layers.value_or(28);
    if (first_sliding >= config.num_hidden_layers) return std::nullopt;
    if (first_sliding > 0) {
      return fields.Error("max_window_layers",
                          absl::StrCat("sliding window on layers ", first_sliding, "..",
                                       config.num_hidden_layers - 1,
                                       " only is not supported (use 0 for every layer)"));
    }
  }
  return window;
}

// A soft-cap of Gemma's: absent means `fallback`, null none (0), else a number > 0.
absl::StatusOr<double> ParseSoftcap(const Json& root, const ConfigFields& fields,
                                    absl::string_view key, double fallback) {
  if (!root.contains(std::string(key))) return fallback;
  LATHE_ASSIGN_OR_RETURN(std::optional<double> cap, fields.Double(key));
  if (!cap.has_value()) return 0.0;
  if (!std::isfinite(*cap) || *cap <= 0) {
    return fields.Error(key, absl::StrCat("must be > 0 or null, got ", *cap));
  }
  return *cap;
}

// Gemma 3's RoPE: rope_theta and rope_scaling on the global layers, rope_local_base_freq (no
// scaling) on the sliding ones; transformers 5 writes both as rope_parameters, one object per
// layer type.
absl::Status ParseGemma3Rope(const ConfigFields& fields, absl::string_view source,
                             ModelConfig& config) {
  LATHE_ASSIGN_OR_RETURN(config.rope_theta, fields.PositiveDouble("rope_theta", 1e6));
  LATHE_ASSIGN_OR_RETURN(config.rope_local_base_freq,
                         fields.PositiveDouble("rope_local_base_freq", 10000.0));
  const Json* parameters = fields.Find("rope_parameters");
  if (parameters == nullptr) {
    LATHE_ASSIGN_OR_RETURN(config.rope_scaling,
                           ParseRopeScaling(fields, source, "rope_scaling", config.model_type));
    return absl::OkStatus();
  }
  if (!parameters->is_object() ||
      (!parameters->contains("full_attention") && !parameters->contains("sliding_attention"))) {
    return fields.Error("rope_parameters",
                        absl::StrCat("expected one object per layer type (full_attention, "
                                     "sliding_attention), got ",
                                     DescribeJson(*parameters)));
  }
  ConfigFields rope(*parameters, source, "rope_parameters.");
  LATHE_ASSIGN_OR_RETURN(
      config.rope_scaling,
      ParseRopeScaling(rope, source, "full_attention", config.model_type, "rope_parameters."));
  if (const Json* full = rope.Find("full_attention"); full != nullptr) {
    ConfigFields global(*full, source, "rope_parameters.full_attention.");
    LATHE_ASSIGN_OR_RETURN(config.rope_theta,
                           global.PositiveDouble("rope_theta", config.rope_theta));
  }
  LATHE_ASSIGN_OR_RETURN(
      RopeScaling local,
      ParseRopeScaling(rope, source, "sliding_attention", config.model_type, "rope_parameters."));
  if (local.kind != RopeScaling::Kind::kNone) {
    return rope.Error("sliding_attention",
                      "RoPE scaling on the sliding layers is not supported (rope_type default)");
  }
  if (const Json* sliding = rope.Find("sliding_attention"); sliding != nullptr) {
    ConfigFields local_fields(*sliding, source, "rope_parameters.sliding_attention.");
    LATHE_ASSIGN_OR_RETURN(config.rope_local_base_freq,
                           local_fields.PositiveDouble("rope_theta", config.rope_local_base_freq));
  }
  return absl::OkStatus();
}

// What Gemma 2 and Gemma 3 add to the Llama fields, with transformers' defaults; refuses what
// the engine does not implement.
absl::Status ParseGemma(const Json& root, const ConfigFields& fields, ModelConfig& config) {
  const bool gemma2 = config.model_type == "gemma2";
  LATHE_ASSIGN_OR_RETURN(std::optional<std::string> activation, fields.String("hidden_activation"));
  if (activation.has_value() && *activation != "gelu_pytorch_tanh") {
    return fields.Error("hidden_activation",
                        absl::StrCat("unsupported \"", *activation, "\" (only gelu_pytorch_tanh)"));
  }
  LATHE_ASSIGN_OR_RETURN(bool bidirectional, fields.BoolOr("use_bidirectional_attention", false));
  if (bidirectional) {
    return fields.Error("use_bidirectional_attention",
                        "bidirectional attention is not supported (causal only)");
  }
  LATHE_ASSIGN_OR_RETURN(std::optional<double> dropout, fields.Double("attention_dropout"));
  if (dropout.value_or(0.0) != 0.0) {
    return fields.Error(
        "attention_dropout",
        absl::StrCat("attention dropout is not supported (0 only), got ", *dropout));
  }
  LATHE_ASSIGN_OR_RETURN(config.query_pre_attn_scalar,
                         fields.OptionalPositive("query_pre_attn_scalar", 256));
  config.pad_token_id = 0;  // absent: transformers' 0; null: none
  if (root.contains("pad_token_id")) {
    LATHE_ASSIGN_OR_RETURN(config.pad_token_id, fields.Int("pad_token_id"));
    if (config.pad_token_id.has_value() &&
        (*config.pad_token_id < 0 || *config.pad_token_id >= config.vocab_size)) {
      return fields.Error("pad_token_id",
                          absl::StrCat(*config.pad_token_id, " is not a token id (vocab_size ",
                                       config.vocab_size, ")"));
    }
  }
  LATHE_ASSIGN_OR_RETURN(config.attn_logit_softcapping,
                         ParseSoftcap(root, fields, "attn_logit_softcapping", gemma2 ? 50.0 : 0.0));
  LATHE_ASSIGN_OR_RETURN(
      config.final_logit_softcapping,
      ParseSoftcap(root, fields, "final_logit_softcapping", gemma2 ? 30.0 : 0.0));

  // sliding_window: absent means transformers' 4096, null none.
  config.sliding_window = 4096;
  if (root.contains("sliding_window")) {
    LATHE_ASSIGN_OR_RETURN(config.sliding_window, fields.Int("sliding_window"));
    if (config.sliding_window.has_value() && *config.sliding_window <= 0) {
      return fields.Error("sliding_window",
                          absl::StrCat("must be > 0, got ", *config.sliding_window));
    }
  }
  LATHE_ASSIGN_OR_RETURN(std::optional<std::vector<bool>> types,
                         ParseLayerTypes(fields, config.num_hidden_layers));
  if (types.has_value()) {
    config.sliding_layers = std::move(*types);
    return absl::OkStatus();
  }
  // Transformers' defaults: Gemma 2 alternates sliding and global layers from a sliding one;
  // Gemma 3 makes every sliding_window_pattern-th layer (default 6) global.
  int64_t pattern = 2;
  if (!gemma2) {
    LATHE_ASSIGN_OR_RETURN(pattern, fields.OptionalPositive("sliding_window_pattern", 6));
  }
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    config.sliding_layers.push_back((i + 1) % pattern != 0);
  }
  return absl::OkStatus();
}

// bos_token_id / eos_token_id: an integer, a list of integers, or null, each a token id.
absl::StatusOr<std::vector<int64_t>> ParseTokenIds(const ConfigFields& fields,
                                                   absl::string_view key, int64_t vocab_size) {
  const Json* value = fields.Find(key);
  if (value == nullptr) return std::vector<int64_t>();
  std::vector<Json> entries;
  if (value->is_array()) {
    entries.assign(value->begin(), value->end());
  } else {
    entries.push_back(*value);
  }
  std::vector<int64_t> ids;
  for (const Json& entry : entries) {
    if (!entry.is_number_integer()) {
      return fields.Error(key, absl::StrCat("expected an integer or a list of integers, got ",
                                            DescribeJson(*value)));
    }
    const bool fits =
        !entry.is_number_unsigned() ||
        entry.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    const int64_t id = fits ? entry.get<int64_t>() : -1;
    if (id < 0 || id >= vocab_size) {
      return fields.Error(
          key, absl::StrCat(entry.dump(), " is not a token id (vocab_size ", vocab_size, ")"));
    }
    ids.push_back(id);
  }
  return ids;
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text,
                                             absl::string_view source) {
  Json root;
  // nlohmann/json reports syntax errors only by exception; catch it here, at the boundary.
  try {
    root = Json::parse(json_text);
  } catch (const Json::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": malformed JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": expected a JSON object at the top level, got ", DescribeJson(root)));
  }
  ConfigFields fields(root, source, "");
  ModelConfig config;

  // Before model_type, so that a mixture-of-experts model is named as one, by its key.
  for (absl::string_view key : kExpertKeys) {
    LATHE_ASSIGN_OR_RETURN(std::optional<int64_t> experts, fields.Int(key));
    if (experts.has_value() && *experts > 0) {
      return absl::UnimplementedError(
          absl::StrCat(source, ": ", key, ": ", *experts,
                       ": mixture-of-experts models are not supported (dense decoders only)"));
    }
  }
  LATHE_ASSIGN_OR_RETURN(std::optional<std::string> model_type, fields.String("model_type"));
  if (!model_type.has_value()) return fields.Error("model_type", "required field is missing");
  if (*model_type == "gemma3") {
    return fields.Error("model_type",
                        "\"gemma3\" is the multimodal Gemma 3: only its text model "
                        "(model_type gemma3_text, Gemma3ForCausalLM) is supported");
  }
  if (!IsSupportedModelType(*model_type)) {
    return fields.Error("model_type", absl::StrCat("unsupported \"", *model_type, "\" (supported: ",
                                                   absl::StrJoin(Engine().model_types, ", "), ")"));
  }
  config.model_type = *model_type;
  const bool phi3 = config.model_type == "phi3";

  config.architecture = std::string(DefaultArchitecture(config.model_type));
  if (const Json* architectures = fields.Find("architectures"); architectures != nullptr) {
    if (!architectures->is_array() ||
        (!architectures->empty() && !(*architectures)[0].is_string())) {
      return fields.Error("architectures", absl::StrCat("expected a list of strings, got ",
                                                        DescribeJson(*architectures)));
    }
    if (!architectures->empty()) config.architecture = (*architectures)[0].get<std::string>();
  }

  // Gemma's MLP reads hidden_activation (ParseGemma) and ignores hidden_act.
  LATHE_ASSIGN_OR_RETURN(std::optional<std::string> hidden_act, fields.String("hidden_act"));
  if (!IsGemma(config) && hidden_act.has_value() && *hidden_act != "silu") {
    return fields.Error("hidden_act",
                        absl::StrCat("unsupported \"", *hidden_act, "\" (only silu)"));
  }

  LATHE_ASSIGN_OR_RETURN(config.vocab_size, fields.RequiredPositive("vocab_size"));
  LATHE_ASSIGN_OR_RETURN(config.hidden_size, fields.RequiredPositive("hidden_size"));
  LATHE_ASSIGN_OR_RETURN(config.intermediate_size, fields.RequiredPositive("intermediate_size"));
  LATHE_ASSIGN_OR_RETURN(config.num_hidden_layers, fields.RequiredPositive("num_hidden_layers"));
  LATHE_ASSIGN_OR_RETURN(config.num_attention_heads,
                         fields.RequiredPositive("num_attention_heads"));
  LATHE_ASSIGN_OR_RETURN(
      config.num_key_value_heads,
      fields.OptionalPositive("num_key_value_heads", config.num_attention_heads));
  if (config.num_attention_heads % config.num_key_value_heads != 0) {
    return fields.Error("num_key_value_heads", absl::StrCat(config.num_key_value_heads,
                                                            " does not divide num_attention_heads ",
                                                            config.num_attention_heads));
  }
  LATHE_ASSIGN_OR_RETURN(std::optional<int64_t> head_dim, fields.Int("head_dim"));
  if (head_dim.has_value()) {
    if (*head_dim <= 0)
      return fields.Error("head_dim", absl::StrCat("must be > 0, got ", *head_dim));
    config.head_dim = *head_dim;
  } else if (IsGemma(config)) {
    config.head_dim = 256;  // transformers' default for Gemma, not hidden_size / heads
  } else {
    if (config.hidden_size % config.num_attention_heads != 0) {
      return fields.Error(
          "hidden_size",
          absl::StrCat(config.hidden_size, " is not divisible by num_attention_heads ",
                       config.num_attention_heads, " and head_dim is not given"));
    }
    config.head_dim = config.hidden_size / config.num_attention_heads;
  }
  if (config.head_dim % 2 != 0) {
    return fields.Error("head_dim", absl::StrCat(config.head_dim,
                                                 " must be even (RoPE rotates pairs of features)"));
  }
  LATHE_ASSIGN_OR_RETURN(config.max_position_embeddings,
                         fields.RequiredPositive("max_position_embeddings"));
  // Phi3Config's default is 1e-5, the others' 1e-6.
  LATHE_ASSIGN_OR_RETURN(config.rms_norm_eps,
                         fields.PositiveDouble("rms_norm_eps", phi3 ? 1e-5 : 1e-6));
  // Transformers 5 writes rope_theta and the scaling into one "rope_parameters" object and
  // neither at the top; read at the top only, such a model would silently get theta 10000.
  const Json* parameters = fields.Find("rope_parameters");
  const bool in_parameters = parameters != nullptr && !parameters->is_null();
  if (config.model_type == "gemma3_text") {
    LATHE_RETURN_IF_ERROR(ParseGemma3Rope(fields, source, config));
  } else if (in_parameters) {
    LATHE_ASSIGN_OR_RETURN(config.rope_scaling,
                           ParseRopeScaling(fields, source, "rope_parameters", config.model_type));
    ConfigFields rope(*parameters, source, "rope_parameters.");
    LATHE_ASSIGN_OR_RETURN(config.rope_theta, rope.PositiveDouble("rope_theta", 10000.0));
    if (phi3 && rope.Find("partial_rotary_factor") != nullptr) {
      LATHE_ASSIGN_OR_RETURN(config.partial_rotary_factor,
                             rope.PositiveDouble("partial_rotary_factor", 1.0));
    } else if (phi3) {
      LATHE_ASSIGN_OR_RETURN(config.partial_rotary_factor,
                             fields.PositiveDouble("partial_rotary_factor", 1.0));
    }
  } else {
    LATHE_ASSIGN_OR_RETURN(config.rope_theta, fields.PositiveDouble("rope_theta", 10000.0));
    LATHE_ASSIGN_OR_RETURN(config.rope_scaling,
                           ParseRopeScaling(fields, source, "rope_scaling", config.model_type));
    if (phi3) {
      LATHE_ASSIGN_OR_RETURN(config.partial_rotary_factor,
                             fields.PositiveDouble("partial_rotary_factor", 1.0));
    }
  }
  if (phi3) {
    const int64_t rotary = RotaryDim(config);
    if (config.partial_rotary_factor > 1.0 || rotary <= 0 || rotary % 2 != 0) {
      return fields.Error(
          "partial_rotary_factor",
          absl::StrCat(config.partial_rotary_factor, " of head_dim ", config.head_dim, " rotates ",
                       rotary, " features (must be even, > 0 and at most head_dim)"));
    }
    if (config.rope_scaling.kind == RopeScaling::Kind::kLongRope) {
      LATHE_RETURN_IF_ERROR(
          FinishLongRope(fields, in_parameters ? "rope_parameters" : "rope_scaling", config));
    }
  }
  LATHE_ASSIGN_OR_RETURN(config.tie_word_embeddings,
                         fields.BoolOr("tie_word_embeddings", IsGemma(config)));

  if (config.model_type == "qwen2") {
    config.qkv_bias = true;
  } else if (config.model_type == "llama" || config.model_type == "qwen3" || IsGemma(config)) {
    LATHE_ASSIGN_OR_RETURN(bool attention_bias, fields.BoolOr("attention_bias", false));
    if (config.model_type == "llama") {
      LATHE_ASSIGN_OR_RETURN(config.mlp_bias, fields.BoolOr("mlp_bias", false));
    }
    config.qkv_bias = attention_bias;
    config.o_bias = attention_bias;
  }
  config.qk_norm = config.model_type == "qwen3" || config.model_type == "gemma3_text";
  if (phi3) {
    // Transformers' Phi3 has no biases and no dropout Lathe would apply; Phi-4-mini's
    // config.json carries the switches of its remote code, refused where they are on.
    for (absl::string_view key : {"attention_bias", "mlp_bias", "lm_head_bias"}) {
      LATHE_ASSIGN_OR_RETURN(bool on, fields.BoolOr(key, false));
      if (on) return fields.Error(key, "true is not supported for phi3 (no biases)");
    }
    for (absl::string_view key : {"attention_dropout", "resid_pdrop"}) {
      LATHE_ASSIGN_OR_RETURN(std::optional<double> dropout, fields.Double(key));
      if (dropout.value_or(0.0) != 0.0) {
        return fields.Error(key, absl::StrCat(*dropout, " is not supported (only 0)"));
      }
    }
  }
  if (IsGemma(config)) {
    LATHE_RETURN_IF_ERROR(ParseGemma(root, fields, config));
  } else {
    LATHE_ASSIGN_OR_RETURN(config.sliding_window, ParseSlidingWindow(fields, config));
  }

  // Transformers >= 4.56 writes "dtype" in place of "torch_dtype".
  LATHE_ASSIGN_OR_RETURN(std::optional<std::string> dtype, fields.String("torch_dtype"));
  if (!dtype.has_value()) {
    LATHE_ASSIGN_OR_RETURN(dtype, fields.String("dtype"));
  }
  config.torch_dtype = dtype.value_or("");

  LATHE_ASSIGN_OR_RETURN(std::vector<int64_t> bos,
                         ParseTokenIds(fields, "bos_token_id", config.vocab_size));
  if (!bos.empty()) config.bos_token_id = bos.front();
  LATHE_ASSIGN_OR_RETURN(config.eos_token_ids,
                         ParseTokenIds(fields, "eos_token_id", config.vocab_size));
  if (!IsGemma(config)) {  // Gemma's is read with its other settings (ParseGemma)
    // A value that is not a token id (LLaMA 1's -1, which nn.Embedding would read as the last
    // row) is dropped rather than refused: no row is then kept from training.
    if (absl::StatusOr<std::vector<int64_t>> pad =
            ParseTokenIds(fields, "pad_token_id", config.vocab_size);
        pad.ok() && !pad->empty()) {
      config.pad_token_id = pad->front();
    }
  }
  return config;
}

bool IsGemma(const ModelConfig& config) {
  return config.model_type == "gemma2" || config.model_type == "gemma3_text";
}

bool LayerSlides(const ModelConfig& config, int64_t layer) {
  if (!config.sliding_window.has_value()) return false;
  return config.sliding_layers.empty() || config.sliding_layers[layer];
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  std::string path = dir;
  if (!path.empty() && path.back() != '/') path += '/';
  path += "config.json";
  LATHE_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return ParseModelConfig(text, path);
}

int64_t RotaryDim(const ModelConfig& config) {
  // Transformers: int(head_dim * partial_rotary_factor).
  return static_cast<int64_t>(static_cast<double>(config.head_dim) * config.partial_rotary_factor);
}

const std::vector<std::string>& ProjectionModules(const ModelConfig& config) {
  static const auto* const kSeparate = new std::vector<std::string>{
      "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  static const auto* const kPhi3 =
      new std::vector<std::string>{"qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
  return config.model_type == "phi3" ? *kPhi3 : *kSeparate;
}

const std::vector<std::string>& AllProjectionModules() {
  static const auto* const kAll =
      new std::vector<std::string>{"q_proj",    "k_proj",  "v_proj",       "qkv_proj", "o_proj",
                                   "gate_proj", "up_proj", "gate_up_proj", "down_proj"};
  return *kAll;
}

bool IsProjectionModule(absl::string_view module) {
  const std::vector<std::string>& all = AllProjectionModules();
  return std::find(all.begin(), all.end(), module) != all.end();
}

absl::StatusOr<std::vector<std::string>> LoraTargetsOf(const ModelConfig& config,
                                                       const std::vector<std::string>& targets) {
  const std::vector<std::string>& modules = ProjectionModules(config);
  if (targets.empty()) return modules;
  for (const std::string& target : targets) {
    if (std::find(modules.begin(), modules.end(), target) == modules.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "lora.targets: \"", target, "\" is not a projection of this ", config.model_type,
          " model (its modules: ", absl::StrJoin(modules, ", "), ")"));
    }
  }
  std::vector<std::string> ordered;
  for (const std::string& module : modules) {
    if (std::find(targets.begin(), targets.end(), module) != targets.end()) {
      ordered.push_back(module);
    }
  }
  return ordered;
}

namespace {

bool IsAttentionProjection(absl::string_view module) {
  return module == "q_proj" || module == "k_proj" || module == "v_proj" || module == "qkv_proj" ||
         module == "o_proj";
}

}  // namespace

ProjectionShape ProjectionShapeOf(const ModelConfig& config, absl::string_view module) {
  const int64_t hidden = config.hidden_size;
  const int64_t q_features = config.num_attention_heads * config.head_dim;
  const int64_t kv_features = config.num_key_value_heads * config.head_dim;
  if (module == "q_proj") return {hidden, q_features};
  if (module == "k_proj" || module == "v_proj") return {hidden, kv_features};
  if (module == "qkv_proj") return {hidden, q_features + 2 * kv_features};
  if (module == "o_proj") return {q_features, hidden};
  if (module == "down_proj") return {config.intermediate_size, hidden};
  if (module == "gate_up_proj") return {hidden, 2 * config.intermediate_size};
  // gate_proj, up_proj.
  return {hidden, config.intermediate_size};
}

std::string ProjectionName(int64_t layer, absl::string_view module) {
  return absl::StrCat("model.layers.", layer,
                      IsAttentionProjection(module) ? ".self_attn." : ".mlp.", module);
}

std::vector<WeightSpec> ExpectedWeights(const ModelConfig& config) {
  const int64_t hidden = config.hidden_size;
  std::vector<WeightSpec> weights;
  weights.push_back({"model.embed_tokens.weight", {config.vocab_size, hidden}});
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    const std::string prefix = absl::StrCat("model.layers.", layer, ".");
    weights.push_back({prefix + "input_layernorm.weight", {hidden}});
    for (const std::string& module : ProjectionModules(config)) {
      if (module == "gate_proj" || module == "gate_up_proj") {
        weights.push_back({prefix + "post_attention_layernorm.weight", {hidden}});
        // Gemma: the MLP between its own pair of norms.
        if (IsGemma(config))
          weights.push_back({prefix + "pre_feedforward_layernorm.weight", {hidden}});
      }
      const std::string name = ProjectionName(layer, module);
      const ProjectionShape shape = ProjectionShapeOf(config, module);
      weights.push_back({name + ".weight", {shape.out_features, shape.in_features}});
      const bool attention = IsAttentionProjection(module);
      const bool bias = module == "o_proj" ? config.o_bias
                        : attention        ? config.qkv_bias
                                           : config.mlp_bias;
      if (bias) weights.push_back({name + ".bias", {shape.out_features}});
      if (module == "o_proj" && config.qk_norm) {
        // Transformers' order: the projections, then q_norm and k_norm.
        weights.push_back({prefix + "self_attn.q_norm.weight", {config.head_dim}});
        weights.push_back({prefix + "self_attn.k_norm.weight", {config.head_dim}});
      }
    }
    if (IsGemma(config))
      weights.push_back({prefix + "post_feedforward_layernorm.weight", {hidden}});
  }
  weights.push_back({"model.norm.weight", {hidden}});
  if (!config.tie_word_embeddings) {
    weights.push_back({"lm_head.weight", {config.vocab_size, hidden}});
  }
  return weights;
}

int64_t ParameterCount(const ModelConfig& config) {
  int64_t total = 0;
  for (const WeightSpec& weight : ExpectedWeights(config)) {
    int64_t count = 1;
    for (int64_t dim : weight.shape) count *= dim;
    total += count;
  }
  return total;
}

std::string ModelConfigToJson(const ModelConfig& config) {
  nlohmann::ordered_json json;
  json["architectures"] = {config.architecture.empty()
                               ? std::string(DefaultArchitecture(config.model_type))
                               : config.architecture};
  json["model_type"] = config.model_type;
  json["vocab_size"] = config.vocab_size;
  json["hidden_size"] = config.hidden_size;
  json["intermediate_size"] = config.intermediate_size;
  json["num_hidden_layers"] = config.num_hidden_layers;
  json["num_attention_heads"] = config.num_attention_heads;
  json["num_key_value_heads"] = config.num_key_value_heads;
  json["head_dim"] = config.head_dim;
  json["max_position_embeddings"] = config.max_position_embeddings;
  if (IsGemma(config)) {
    json["hidden_activation"] = "gelu_pytorch_tanh";
  } else {
    json["hidden_act"] = "silu";
  }
  json["rms_norm_eps"] = config.rms_norm_eps;
  json["rope_theta"] = config.rope_theta;
  const RopeScaling& rope = config.rope_scaling;
  switch (rope.kind) {
    case RopeScaling::Kind::kNone:
      json["rope_scaling"] = nullptr;
      break;
    case RopeScaling::Kind::kLinear:
      json["rope_scaling"] = {{"rope_type", "linear"}, {"factor", rope.factor}};
      break;
    case RopeScaling::Kind::kLlama3:
      json["rope_scaling"] = {
          {"rope_type", "llama3"},
          {"factor", rope.factor},
          {"low_freq_factor", rope.low_freq_factor},
          {"high_freq_factor", rope.high_freq_factor},
          {"original_max_position_embeddings", rope.original_max_position_embeddings}};
      break;
    case RopeScaling::Kind::kLongRope:
      // The attention factor as computed, so that it need not be derived again.
      json["rope_scaling"] = {{"rope_type", "longrope"},
                              {"short_factor", rope.short_factor},
                              {"long_factor", rope.long_factor},
                              {"factor", rope.factor},
                              {"attention_factor", rope.attention_factor}};
      break;
  }
  if (config.model_type == "phi3") {
    json["partial_rotary_factor"] = config.partial_rotary_factor;
    if (rope.kind == RopeScaling::Kind::kLongRope) {
      json["original_max_position_embeddings"] = rope.original_max_position_embeddings;
    }
  }
  json["tie_word_embeddings"] = config.tie_word_embeddings;
  if (config.model_type == "gemma3_text")
    json["rope_local_base_freq"] = config.rope_local_base_freq;
  if (config.model_type == "llama" || config.model_type == "qwen3" || IsGemma(config)) {
    // Llama, Qwen3 and Gemma have one switch for all four attention biases.
    json["attention_bias"] = config.qkv_bias || config.o_bias;
  }
  if (config.model_type == "llama") json["mlp_bias"] = config.mlp_bias;
  if (config.model_type != "llama") {
    if (config.sliding_window.has_value()) {
      json["sliding_window"] = *config.sliding_window;
    } else {
      json["sliding_window"] = nullptr;
    }
  }
  if (IsGemma(config)) {
    std::vector<std::string> types;
    for (bool sliding : config.sliding_layers) {
      types.push_back(sliding ? "sliding_attention" : "full_attention");
    }
    json["layer_types"] = types;
    json["query_pre_attn_scalar"] = config.query_pre_attn_scalar;
    json["pad_token_id"] =
        config.pad_token_id.has_value() ? Json(*config.pad_token_id) : Json(nullptr);
    auto cap = [](double value) { return value > 0 ? Json(value) : Json(nullptr); };
    json["attn_logit_softcapping"] = cap(config.attn_logit_softcapping);
    json["final_logit_softcapping"] = cap(config.final_logit_softcapping);
  }
  if (config.model_type == "qwen2" || config.model_type == "qwen3") {
    json["use_sliding_window"] = config.sliding_window.has_value();
    // Every layer slides when the window is on (see ParseSlidingWindow).
    json["max_window_layers"] =
        config.sliding_window.has_value() ? int64_t{0} : config.num_hidden_layers;
  }
  if (!config.torch_dtype.empty()) json["torch_dtype"] = config.torch_dtype;
  if (config.bos_token_id.has_value()) json["bos_token_id"] = *config.bos_token_id;
  if (config.pad_token_id.has_value()) {
    json["pad_token_id"] = *config.pad_token_id;
  } else if (config.model_type == "phi3") {
    json["pad_token_id"] = nullptr;  // not Phi3Config's default 32000
  }
  if (config.eos_token_ids.size() == 1) {
    json["eos_token_id"] = config.eos_token_ids.front();
  } else if (!config.eos_token_ids.empty()) {
    json["eos_token_id"] = config.eos_token_ids;
  }
  return json.dump(2) + "\n";
}

}  // namespace lathe
