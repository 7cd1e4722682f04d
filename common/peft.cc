#include "common/peft.h"

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/file_util.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace lathe {
namespace {

using Json = nlohmann::json;

// PEFT's LoraConfig defaults for fields a config may omit.
constexpr int64_t kDefaultR = 8;
constexpr double kDefaultLoraAlpha = 8.0;

absl::string_view BlockOf(absl::string_view module) {
  if (module == "q_proj" || module == "k_proj" || module == "v_proj" || module == "qkv_proj" ||
      module == "o_proj") {
    return "self_attn.";
  }
  if (module == "gate_proj" || module == "up_proj" || module == "gate_up_proj" ||
      module == "down_proj") {
    return "mlp.";
  }
  return "";
}

// A whole-valued alpha is written as an integer, as PEFT (whose field is an int) writes it.
Json AlphaJson(double alpha) {
  if (std::isfinite(alpha) && alpha == std::floor(alpha) && std::fabs(alpha) < 1e15) {
    return static_cast<int64_t>(alpha);
  }
  return alpha;
}

// Whether `value` leaves `option` off: null, or its default (false or empty where it has
// no other).
bool IsOff(const UnsupportedPeftOption& option, const Json& value) {
  if (value.is_null()) return true;
  if (!option.also_off.empty()) return value == Json::parse(option.also_off);
  if (value.is_boolean() && !value.get<bool>()) return true;
  return (value.is_object() || value.is_array()) && value.empty();
}

}  // namespace

absl::Span<const UnsupportedPeftOption> UnsupportedPeftOptions() {
  static constexpr UnsupportedPeftOption kOptions[] = {
      {"use_dora", ""},
      {"fan_in_fan_out", ""},
      {"init_lora_weights", "true"},
      {"bias", "\"none\""},
      {"layers_to_transform", ""},
      {"layers_pattern", ""},
      {"lora_bias", ""},
      {"megatron_config", ""},
      {"loftq_config", ""},
      {"layer_replication", ""},
      {"exclude_modules", ""},
      {"target_parameters", ""},
      {"trainable_token_indices", ""},
      {"use_qalora", ""},
      {"alora_invocation_tokens", ""},
      {"eva_config", ""},
      {"corda_config", ""},
      {"lora_ga_config", ""},
      {"velora_config", ""},
      {"monteclora_config", ""},
      {"arrow_config", ""},
      {"kasa_config", ""},
      {"use_bdlora", ""},
      {"ensure_weight_tying", ""},
  };
  return kOptions;
}

std::string PeftLoraTensorName(int64_t layer, absl::string_view module, absl::string_view which) {
  return absl::StrCat("base_model.model.model.layers.", layer, ".", BlockOf(module), module,
                      ".lora_", which, ".weight");
}

std::string PeftAdapterConfigJson(const PeftAdapterConfig& config) {
  Json rank_pattern = Json::object();
  for (const auto& [key, rank] : config.rank_pattern) rank_pattern[key] = rank;
  Json alpha_pattern = Json::object();
  for (const auto& [key, alpha] : config.alpha_pattern) alpha_pattern[key] = AlphaJson(alpha);
  // nlohmann::json keeps keys sorted, matching PEFT's json.dumps(..., sort_keys=True).
  Json json = {
      {"alpha_pattern", alpha_pattern},
      {"base_model_name_or_path", config.base_model_name_or_path},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"layers_pattern", nullptr},
      {"layers_to_transform", nullptr},
      {"lora_alpha", AlphaJson(config.lora_alpha)},
      {"lora_dropout", config.lora_dropout},
      {"modules_to_save",
       config.modules_to_save.empty() ? Json(nullptr) : Json(config.modules_to_save)},
      {"peft_type", "LORA"},
      {"r", config.r},
      {"rank_pattern", rank_pattern},
      {"revision", nullptr},
      {"target_modules", config.target_modules_pattern.empty()
                             ? Json(config.target_modules)
                             : Json(config.target_modules_pattern)},
      {"task_type", "CAUSAL_LM"},
      {"use_dora", false},
      {"use_rslora", config.use_rslora},
  };
  return json.dump(2) + "\n";
}

absl::StatusOr<PeftAdapterConfig> ParsePeftAdapterConfig(absl::string_view json_text,
                                                         absl::string_view source) {
  auto invalid = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", what));
  };
  Json json;
  try {
    json = Json::parse(json_text);
  } catch (const Json::exception& e) {
    return invalid(absl::StrCat("not JSON: ", e.what()));
  }
  if (!json.is_object()) return invalid("not a JSON object");

  auto peft_type = json.find("peft_type");
  if (peft_type == json.end() || !peft_type->is_string() || *peft_type != "LORA") {
    return invalid(absl::StrCat("peft_type is ",
                                peft_type == json.end() ? "missing" : peft_type->dump(),
                                ", expected \"LORA\""));
  }

  for (const UnsupportedPeftOption& option : UnsupportedPeftOptions()) {
    auto it = json.find(std::string(option.name));
    if (it == json.end()) continue;
    // How A and B were initialised no longer matters once they are trained and saved, as
    // long as the base was left alone: not so for PiSSA, OLoRA, LoftQ, CorDA, ...
    if (option.name == "init_lora_weights" && (it->is_boolean() || *it == "gaussian")) continue;
    if (!IsOff(option, *it)) {
      std::string value = it->dump();
      if (value.size() > 40) value = value.substr(0, 40) + "...";
      return invalid(absl::StrCat(option.name, " is ", value, ": not supported by Lathe"));
    }
  }

  PeftAdapterConfig config;
  if (auto it = json.find("base_model_name_or_path"); it != json.end() && !it->is_null()) {
    if (!it->is_string()) return invalid("base_model_name_or_path is not a string");
    config.base_model_name_or_path = it->get<std::string>();
  }

  config.r = kDefaultR;
  if (auto it = json.find("r"); it != json.end()) {
    if (!it->is_number_integer())
      return invalid(absl::StrCat("r is ", it->dump(), ", not an integer"));
    config.r = it->get<int64_t>();
  }
  if (config.r <= 0) return invalid(absl::StrCat("r is ", config.r, ", must be positive"));

  config.lora_alpha = kDefaultLoraAlpha;
  if (auto it = json.find("lora_alpha"); it != json.end()) {
    if (!it->is_number())
      return invalid(absl::StrCat("lora_alpha is ", it->dump(), ", not a number"));
    config.lora_alpha = it->get<double>();
  }

  if (auto it = json.find("lora_dropout"); it != json.end()) {
    if (!it->is_number()) {
      return invalid(absl::StrCat("lora_dropout is ", it->dump(), ", not a number"));
    }
    config.lora_dropout = it->get<double>();
    if (!(config.lora_dropout >= 0.0 && config.lora_dropout < 1.0)) {
      return invalid(absl::StrCat("lora_dropout is ", it->dump(), ", must be in [0, 1)"));
    }
  }

  if (auto it = json.find("use_rslora"); it != json.end() && !it->is_null()) {
    if (!it->is_boolean()) return invalid("use_rslora is not a boolean");
    config.use_rslora = it->get<bool>();
  }

  if (auto it = json.find("rank_pattern"); it != json.end() && !it->is_null()) {
    if (!it->is_object()) return invalid("rank_pattern is not an object");
    for (const auto& [key, value] : it->items()) {
      if (!value.is_number_integer() || value.get<int64_t>() <= 0) {
        return invalid(absl::StrCat("rank_pattern \"", key, "\" is ", value.dump(),
                                    ", not a positive integer"));
      }
      config.rank_pattern.emplace_back(key, value.get<int64_t>());
    }
  }
  if (auto it = json.find("alpha_pattern"); it != json.end() && !it->is_null()) {
    if (!it->is_object()) return invalid("alpha_pattern is not an object");
    for (const auto& [key, value] : it->items()) {
      if (!value.is_number()) {
        return invalid(
            absl::StrCat("alpha_pattern \"", key, "\" is ", value.dump(), ", not a number"));
      }
      config.alpha_pattern.emplace_back(key, value.get<double>());
    }
  }
  if (auto it = json.find("modules_to_save"); it != json.end() && !it->is_null()) {
    if (!it->is_array()) return invalid("modules_to_save is not a list");
    for (const Json& module : *it) {
      if (!module.is_string()) {
        return invalid(absl::StrCat("modules_to_save entry ", module.dump(), " is not a string"));
      }
      config.modules_to_save.push_back(module.get<std::string>());
    }
  }

  auto modules = json.find("target_modules");
  if (modules == json.end() || modules->is_null()) return invalid("target_modules is missing");
  if (modules->is_string()) {
    config.target_modules_pattern = modules->get<std::string>();
    if (config.target_modules_pattern.empty()) return invalid("target_modules is empty");
  } else if (modules->is_array()) {
    for (const Json& module : *modules) {
      if (!module.is_string() || module.get_ref<const std::string&>().empty()) {
        return invalid(
            absl::StrCat("target_modules entry ", module.dump(), " is not a non-empty string"));
      }
      config.target_modules.push_back(module.get<std::string>());
    }
  } else {
    return invalid("target_modules is neither a list nor a string");
  }
  if (config.target_modules.empty() && config.target_modules_pattern.empty()) {
    return invalid("target_modules is empty");
  }
  return config;
}

absl::Status WritePeftAdapter(const std::string& dir, const PeftAdapterConfig& config,
                              absl::Span<const TensorToWrite> tensors) {
  if (config.r <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, ": adapter config r is ", config.r, ", must be positive"));
  }
  if (config.target_modules.empty() && config.target_modules_pattern.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(dir, ": adapter config has no target_modules"));
  }
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    return absl::InternalError(absl::StrCat(dir, ": create directory: ", error.message()));
  }
  const std::filesystem::path root(dir);
  LATHE_RETURN_IF_ERROR(
      WriteSafetensors((root / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}}));
  return WriteFileAtomically((root / "adapter_config.json").string(),
                             PeftAdapterConfigJson(config));
}

}  // namespace lathe
