// Which projections a LoRA spec targets, matched as PEFT matches target_modules
// (peft/tuners/tuners_utils.py, check_target_module_exists and
// _maybe_include_all_linear_layers), against the full module names of a model
// (model.layers.3.self_attn.q_proj).
//
// Thread-safety: pure functions.
#ifndef LATHE_COMMON_LORA_TARGETS_H_
#define LATHE_COMMON_LORA_TARGETS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/job_spec.h"
#include "common/model_config.h"
#include "common/peft.h"

namespace lathe {

// PEFT's INCLUDE_LINEAR_LAYERS_SHORTHAND.
inline constexpr absl::string_view kAllLinear = "all-linear";

// Whether a targets pattern is "all-linear" (PEFT compares it lowercased).
bool IsAllLinear(absl::string_view pattern);

// OK when `pattern` (LoraSpec::targets_pattern) is "all-linear" or a regular expression that
// compiles; otherwise INVALID_ARGUMENT with the regex library's complaint (no field name).
absl::Status CheckLoraTargetsPattern(absl::string_view pattern);

// OK when every key of lora.rank_pattern and lora.alpha_pattern compiles as PEFT uses it;
// INVALID_ARGUMENT "lora.rank_pattern: ..." / "lora.alpha_pattern: ..." otherwise.
absl::Status CheckLoraPatternKeys(const LoraSpec& lora);

// One targeted projection: layer index and module name ("q_proj"), with its rank and alpha
// (LoraSpec::rank / alpha, or a rank_pattern / alpha_pattern entry's).
struct LoraTarget {
  int64_t layer = 0;
  std::string module;
  int64_t rank = 0;
  double alpha = 0.0;
  bool operator==(const LoraTarget& other) const {
    return layer == other.layer && module == other.module && rank == other.rank &&
           alpha == other.alpha;
  }
  // The adapter's scaling: alpha / rank, or alpha / sqrt(rank) with rsLoRA.
  double Scale(bool use_rslora) const;
};

// The projections of a model of `num_layers` layers, each with the projections `modules`
// (in model order), that `lora`'s targets select, in model order (layer, then `modules`):
// a list entry selects a module whose full name (ProjectionName) is the entry or ends with
// "." + entry; "all-linear", or no targets at all (the spec's default), selects every
// projection; another pattern selects the modules whose full name it matches entirely. Each
// target's rank and alpha are the first matching rank_pattern / alpha_pattern entry's (PEFT's
// get_pattern_key), else lora.rank / lora.alpha. INVALID_ARGUMENT "lora.targets: ..." (one line)
// when the targets select nothing or the pattern does not compile; "lora.rank_pattern: ..." /
// "lora.alpha_pattern: ..." when a key does not compile or applies to no selected module.
absl::StatusOr<std::vector<LoraTarget>> MatchLoraTargets(const LoraSpec& lora, int64_t num_layers,
                                                         absl::Span<const std::string> modules);

// MatchLoraTargets over the projections of `config`'s model (ProjectionModules(config)) in its
// num_hidden_layers layers. A list entry that names (or ends with) a projection this
// architecture lacks ("q_proj" on Phi-3, whose attention has qkv_proj) is refused as
// LoraTargetsOf refuses it: INVALID_ARGUMENT "lora.targets: \"q_proj\" is not a projection of
// this phi3 model (its modules: ...)".
absl::StatusOr<std::vector<LoraTarget>> MatchLoraTargets(const LoraSpec& lora,
                                                         const ModelConfig& config);

// The modules of `modules` that `targets` (MatchLoraTargets' result) select in any layer, in
// `modules`' order: the per-block targets of a count that assumes every block alike (the
// planner's), exact when each layer has the same ones and an upper bound otherwise.
std::vector<std::string> ModulesOfTargets(absl::Span<const LoraTarget> targets,
                                          absl::Span<const std::string> modules);

// Sets config's target_modules as PEFT's adapter_config.json stores them after matching: the
// list itself; a regular expression as that string; for "all-linear" the full names of the
// `matched` modules (PEFT replaces the shorthand by them); for no targets (every projection
// of the model) the module names of `matched`, in model order ("qkv_proj", "o_proj", ...).
void SetPeftTargetModules(const LoraSpec& lora, absl::Span<const LoraTarget> matched,
                          PeftAdapterConfig* config);

// The targets of an adapter's config as a spec's: a list as `targets`, a string as
// `targets_pattern`.
void SetSpecTargets(const PeftAdapterConfig& config, LoraSpec* lora);

// The modules PEFT's modules_to_save names, among the two that every supported family has
// (model.embed_tokens and lm_head): each is trained as a full float32 copy beside the
// adapters, the base module frozen (docs/training.md, "Modules to save").
struct SavedModules {
  bool embed_tokens = false;
  bool lm_head = false;
  bool any() const { return embed_tokens || lm_head; }
};

// Resolves modules_to_save entries as PEFT matches them (a module whose full name ends with
// the entry), restricted to whole name components: "embed_tokens" and "model.embed_tokens"
// name the embedding, "lm_head" the head; two entries may name the same module. Any other
// entry (a projection, "head", "norm") is INVALID_ARGUMENT "\"<entry>\" is not a module Lathe
// trains whole (...)", without a field name: callers add theirs.
absl::StatusOr<SavedModules> ResolveModulesToSave(absl::Span<const std::string> names);

// PEFT's adapter_model.safetensors key of a saved module's weight
// ("base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight").
inline constexpr char kPeftSavedEmbedTokens[] = "base_model.model.model.embed_tokens.weight";
inline constexpr char kPeftSavedLmHead[] = "base_model.model.lm_head.weight";

}  // namespace lathe

#endif  // LATHE_COMMON_LORA_TARGETS_H_
