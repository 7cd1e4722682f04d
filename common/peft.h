// The PEFT (Hugging Face `peft`) LoRA adapter format, so that `PeftModel.from_pretrained`
// loads Lathe's adapters unchanged and Lathe can start from an existing adapter.
//
// An adapter directory holds `adapter_model.safetensors`, with tensors named
//   base_model.model.model.layers.{L}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight
//   base_model.model.model.layers.{L}.mlp.{gate,up,down}_proj.lora_{A,B}.weight
// (lora_A: [r, in_features], lora_B: [out_features, r]), and `adapter_config.json`.
//
// Thread-safety: pure functions; WritePeftAdapter writes files (see its contract).
#ifndef LATHE_COMMON_PEFT_H_
#define LATHE_COMMON_PEFT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/safetensors.h"

namespace lathe {

// "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"; `which` is "A" or "B".
// REQUIRES: `module` is q_proj, k_proj, v_proj, o_proj (under self_attn) or gate_proj,
// up_proj, down_proj (under mlp). Any other module is placed directly under the layer
// ("...layers.3.foo.lora_A.weight"), which matches nothing PEFT writes for Llama-style models.
std::string PeftLoraTensorName(int64_t layer, absl::string_view module, absl::string_view which);

struct PeftAdapterConfig {
  std::string base_model_name_or_path;
  int64_t r = 0;
  double lora_alpha = 0.0;
  double lora_dropout = 0.0;
  bool use_rslora = false;
  // PEFT's target_modules: a list of module names (or full names), or a string (a regular
  // expression over full module names), exactly one of them non-empty.
  std::vector<std::string> target_modules;
  std::string target_modules_pattern;
  // PEFT's rank_pattern and alpha_pattern (LoraSpec's), in order.
  std::vector<std::pair<std::string, int64_t>> rank_pattern;
  std::vector<std::pair<std::string, double>> alpha_pattern;
  // PEFT's modules_to_save: whole modules trained and saved beside the adapters; empty: null.
  std::vector<std::string> modules_to_save;
};

// A PEFT LoraConfig option Lathe does not support. Null leaves it off, and so does its
// default: `also_off` (JSON text) where that is not false or empty.
struct UnsupportedPeftOption {
  absl::string_view name;
  absl::string_view also_off;  // "": false and an empty list or map leave it off
};
// Every such option: use_dora, fan_in_fan_out, init_lora_weights, bias, layers_to_transform,
// layers_pattern, lora_bias, megatron_config, loftq_config, layer_replication, ...
absl::Span<const UnsupportedPeftOption> UnsupportedPeftOptions();

// The adapter_config.json text for `config` (peft_type "LORA", task_type "CAUSAL_LM",
// bias "none", fan_in_fan_out false, inference_mode true).
std::string PeftAdapterConfigJson(const PeftAdapterConfig& config);

// Parses adapter_config.json text. INVALID_ARGUMENT naming `source` and the field when
// the text is not a JSON object, peft_type is not LORA, r <= 0, lora_dropout is outside
// [0, 1), a field has the wrong type, or target_modules is missing or empty. Missing r,
// lora_alpha, lora_dropout and use_rslora take PEFT's defaults (8, 8, 0, false); a string
// target_modules is target_modules_pattern. INVALID_ARGUMENT naming `source` and the key when
// an UnsupportedPeftOptions() option is on (e.g. "use_dora": true), except init_lora_weights
// true, false or "gaussian" (they initialised A and B alone). Other keys are ignored.
absl::StatusOr<PeftAdapterConfig> ParsePeftAdapterConfig(absl::string_view json_text,
                                                         absl::string_view source);

// Writes `dir`/adapter_model.safetensors and `dir`/adapter_config.json (creating `dir`),
// each atomically; the config is written last, so a directory with a config has complete
// weights. The safetensors metadata is {"format": "pt"}, as PEFT writes it.
// INVALID_ARGUMENT (before writing anything) when config.r <= 0 or both target_modules and
// target_modules_pattern are empty; otherwise INVALID_ARGUMENT / INTERNAL as WriteSafetensors.
absl::Status WritePeftAdapter(const std::string& dir, const PeftAdapterConfig& config,
                              absl::Span<const TensorToWrite> tensors);

}  // namespace lathe

#endif  // LATHE_COMMON_PEFT_H_
