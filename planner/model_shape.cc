#include "planner/model_shape.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/json_fields.h"
#include "common/status_macros.h"

namespace lathe {
namespace {

struct FamilyInfo {
  ModelFamily family;
  absl::string_view model_type;
  bool tied_by_default;          // the transformers default of tie_word_embeddings
  bool qkv_bias;                 // q, k, v biases always present (Qwen2)
  int64_t norms_per_block;       // over hidden
  int64_t head_norms_per_block;  // over head_dim (Qwen3's and Gemma 3's q_norm and k_norm)
  int64_t default_head_dim;      // when config.json has none (0: hidden_size / heads)
};

constexpr FamilyInfo kFamilies[] = {
    {ModelFamily::kLlama, "llama", false, false, 2, 0, 0},
    {ModelFamily::kMistral, "mistral", false, false, 2, 0, 0},
    {ModelFamily::kQwen2, "qwen2", false, true, 2, 0, 0},
    {ModelFamily::kQwen3, "qwen3", false, false, 2, 2, 0},
    {ModelFamily::kGemma, "gemma", true, false, 2, 0, 0},
    // Transformers' Gemma 2 and 3 configs default head_dim to 256, whatever the hidden size.
    {ModelFamily::kGemma2, "gemma2", true, false, 4, 0, 256},
    {ModelFamily::kGemma3Text, "gemma3_text", true, false, 4, 2, 256},
    {ModelFamily::kPhi3, "phi3", false, false, 2, 0, 0},
};

// Keys that mark a mixture-of-experts config, by the families that use them.
constexpr absl::string_view kExpertKeys[] = {"num_local_experts", "num_experts", "n_routed_experts",
                                             "moe_num_experts"};

}  // namespace

absl::string_view ModelFamilyName(ModelFamily family) {
  for (const FamilyInfo& info : kFamilies) {
    if (info.family == family) return info.model_type;
  }
  return "unknown";
}

int64_t ModelShape::largest_unit_params() const {
  return std::max({block.total(), embeddings, final_norm + lm_head});
}

absl::StatusOr<ModelShape> ParseModelShape(absl::string_view config_json,
                                           absl::string_view source) {
  const nlohmann::json root = nlohmann::json::parse(config_json, nullptr, false);
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  }
  ConfigFields fields(root, source, "");
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
  const FamilyInfo* info = nullptr;
  for (const FamilyInfo& candidate : kFamilies) {
    if (candidate.model_type == *model_type) info = &candidate;
  }
  if (info == nullptr) {
    return fields.Error("model_type",
                        absl::StrCat("\"", *model_type,
                                     "\" is not a known dense decoder (known: llama, mistral, "
                                     "qwen2, qwen3, gemma, gemma2, gemma3_text, phi3)"));
  }
  ModelShape shape;
  shape.family = info->family;
  LATHE_ASSIGN_OR_RETURN(shape.vocab_size, fields.RequiredPositive("vocab_size"));
  LATHE_ASSIGN_OR_RETURN(shape.hidden_size, fields.RequiredPositive("hidden_size"));
  LATHE_ASSIGN_OR_RETURN(shape.intermediate_size, fields.RequiredPositive("intermediate_size"));
  LATHE_ASSIGN_OR_RETURN(shape.num_layers, fields.RequiredPositive("num_hidden_layers"));
  LATHE_ASSIGN_OR_RETURN(shape.num_heads, fields.RequiredPositive("num_attention_heads"));
  LATHE_ASSIGN_OR_RETURN(shape.num_kv_heads,
                         fields.OptionalPositive("num_key_value_heads", shape.num_heads));
  if (shape.num_heads % shape.num_kv_heads != 0) {
    return fields.Error(
        "num_key_value_heads",
        absl::StrCat(shape.num_kv_heads, " does not divide num_attention_heads ", shape.num_heads));
  }
  LATHE_ASSIGN_OR_RETURN(std::optional<int64_t> head_dim, fields.Int("head_dim"));
  if (head_dim.has_value()) {
    if (*head_dim <= 0)
      return fields.Error("head_dim", absl::StrCat("must be > 0, got ", *head_dim));
    shape.head_dim = *head_dim;
  } else if (info->default_head_dim > 0) {
    shape.head_dim = info->default_head_dim;
  } else if (shape.hidden_size % shape.num_heads != 0) {
    return fields.Error("num_attention_heads",
                        absl::StrCat(shape.num_heads, " does not divide hidden_size ",
                                     shape.hidden_size, " and there is no head_dim"));
  } else {
    shape.head_dim = shape.hidden_size / shape.num_heads;
  }
  LATHE_ASSIGN_OR_RETURN(shape.tied_embeddings,
                         fields.BoolOr("tie_word_embeddings", info->tied_by_default));
  LATHE_ASSIGN_OR_RETURN(bool attention_bias, fields.BoolOr("attention_bias", false));
  LATHE_ASSIGN_OR_RETURN(bool mlp_bias, fields.BoolOr("mlp_bias", false));
  if (info->family == ModelFamily::kGemma2 || info->family == ModelFamily::kGemma3Text) {
    shape.geglu = true;
    // Present and null: none; absent: Gemma 2's default 50 (Gemma 3's none).
    auto capped = [&](const char* key) {
      return root.contains(key) ? !root[key].is_null() : info->family == ModelFamily::kGemma2;
    };
    shape.softcapped_attention = capped("attn_logit_softcapping");
    shape.softcapped_logits = capped("final_logit_softcapping");
  }

  const int64_t h = shape.hidden_size, i = shape.intermediate_size;
  const int64_t q = shape.num_heads * shape.head_dim, kv = shape.num_kv_heads * shape.head_dim;
  BlockParams& block = shape.block;
  block.attention = h * q + 2 * h * kv + q * h;
  if (info->qkv_bias) {
    block.attention_bias = q + 2 * kv;
  } else if (attention_bias) {  // Llama's and Qwen3's attention_bias: q, k, v and o
    block.attention_bias = q + 2 * kv + h;
  }
  block.mlp = 3 * h * i;
  if (mlp_bias) block.mlp_bias = 2 * i + h;
  block.head_norms = info->head_norms_per_block;
  block.norms = info->norms_per_block * h + block.head_norms * shape.head_dim;
  shape.embeddings = shape.vocab_size * h;
  shape.lm_head = shape.tied_embeddings ? 0 : shape.vocab_size * h;
  shape.final_norm = h;
  return shape;
}

}  // namespace lathe
