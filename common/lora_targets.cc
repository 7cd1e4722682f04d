#include "common/lora_targets.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <regex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/model_config.h"
#include "common/status_macros.h"

namespace lathe {
namespace {

// Patterns come from untrusted specs and run in the coordinator (the planner at submit), so
// their cost is bounded: a length, the counted repetitions' product (each {n} copies its
// operand n times into the automaton), and libstdc++'s polynomial-time executor (no
// backtracking; back-references are refused).
constexpr size_t kMaxPatternBytes = 512;
constexpr int64_t kMaxRepetitionProduct = 10000;

#if defined(__GLIBCXX__)
constexpr std::regex::flag_type kRegexFlags =
    std::regex::ECMAScript | std::regex_constants::__polynomial;
#else
constexpr std::regex::flag_type kRegexFlags = std::regex::ECMAScript;
#endif

// The product of the largest count of every {n}, {n,} or {n,m} in `pattern`.
int64_t RepetitionProduct(absl::string_view pattern) {
  int64_t product = 1;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '\\') {
      ++i;  // an escaped character
      continue;
    }
    if (pattern[i] != '{') continue;
    int64_t largest = 0, number = 0;
    for (++i; i < pattern.size() && pattern[i] != '}'; ++i) {
      if (absl::ascii_isdigit(static_cast<unsigned char>(pattern[i]))) {
        number = std::min<int64_t>(number * 10 + (pattern[i] - '0'), kMaxRepetitionProduct + 1);
        largest = std::max(largest, number);
      } else {
        number = 0;
      }
    }
    product = std::min<int64_t>(product * std::max<int64_t>(largest, 1), kMaxRepetitionProduct + 1);
  }
  return product;
}

absl::StatusOr<std::regex> CompilePattern(absl::string_view pattern) {
  if (pattern.size() > kMaxPatternBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a pattern of ", pattern.size(), " bytes is longer than ", kMaxPatternBytes));
  }
  if (RepetitionProduct(pattern) > kMaxRepetitionProduct) {
    return absl::InvalidArgumentError(absl::StrCat("\"", absl::CHexEscape(pattern),
                                                   "\": its counted repetitions ({n}) multiply "
                                                   "to more than ",
                                                   kMaxRepetitionProduct));
  }
  try {
    return std::regex(pattern.begin(), pattern.end(), kRegexFlags);
  } catch (const std::regex_error& e) {
    return absl::InvalidArgumentError(absl::StrCat("\"", absl::CHexEscape(pattern),
                                                   "\" is not a regular expression: ", e.what()));
  }
}

template <typename T>
std::vector<std::string> PatternKeysOf(const std::vector<std::pair<std::string, T>>& entries) {
  std::vector<std::string> keys;
  for (const auto& entry : entries) keys.push_back(entry.first);
  return keys;
}

// PEFT's get_pattern_key: the first key for which (.*\.)?(<key>) matches the whole name.
template <typename T>
const std::pair<std::string, T>* PatternEntryOf(
    const std::vector<std::pair<std::string, T>>& entries, const std::vector<std::regex>& compiled,
    const std::string& name) {
  for (size_t i = 0; i < entries.size(); ++i) {
    if (std::regex_match(name, compiled[i])) return &entries[i];
  }
  return nullptr;
}

// Each key of a rank or alpha pattern as PEFT applies it.
template <typename T>
absl::StatusOr<std::vector<std::regex>> CompilePatternKeys(
    const std::vector<std::pair<std::string, T>>& entries, absl::string_view field) {
  std::vector<std::regex> compiled;
  for (const auto& [key, value] : entries) {
    absl::StatusOr<std::regex> regex = CompilePattern(absl::StrCat("(.*\\.)?(", key, ")"));
    if (!regex.ok() || key.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": key \"", absl::CHexEscape(key), "\" is not a regular expression"));
    }
    compiled.push_back(*std::move(regex));
  }
  return compiled;
}

// Marks the keys that match `name`. INVALID_ARGUMENT when two keys with different values
// match it: PEFT applies the first, but its saved adapter_config.json sorts the keys
// (json.dumps(sort_keys=True)), so the adapter reloaded could apply the other.
template <typename T>
absl::Status MarkMatches(const std::vector<std::pair<std::string, T>>& entries,
                         const std::vector<std::regex>& compiled, const std::string& name,
                         absl::string_view field, std::vector<bool>* used) {
  const std::pair<std::string, T>* first = nullptr;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!std::regex_match(name, compiled[i])) continue;
    (*used)[i] = true;
    if (first == nullptr) {
      first = &entries[i];
    } else if (first->second != entries[i].second) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": keys \"", absl::CHexEscape(first->first), "\" and \"",
          absl::CHexEscape(entries[i].first), "\" both match ", name,
          " with different values; PEFT's saved config sorts its keys, so make them disjoint"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

double LoraTarget::Scale(bool use_rslora) const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank))
                    : alpha / static_cast<double>(rank);
}

absl::Status CheckLoraPatternKeys(const LoraSpec& lora) {
  LATHE_RETURN_IF_ERROR(CompilePatternKeys(lora.rank_pattern, "lora.rank_pattern").status());
  return CompilePatternKeys(lora.alpha_pattern, "lora.alpha_pattern").status();
}

bool IsAllLinear(absl::string_view pattern) { return absl::AsciiStrToLower(pattern) == kAllLinear; }

absl::Status CheckLoraTargetsPattern(absl::string_view pattern) {
  if (IsAllLinear(pattern)) return absl::OkStatus();
  return CompilePattern(pattern).status();
}

absl::StatusOr<std::vector<LoraTarget>> MatchLoraTargets(const LoraSpec& lora, int64_t num_layers,
                                                         absl::Span<const std::string> modules) {
  // No targets at all (the spec's default): every projection of the model.
  const bool all_linear =
      lora.targets_pattern.empty() ? lora.targets.empty() : IsAllLinear(lora.targets_pattern);
  std::regex regex;
  if (!lora.targets_pattern.empty() && !all_linear) {
    absl::StatusOr<std::regex> compiled = CompilePattern(lora.targets_pattern);
    if (!compiled.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("lora.targets: ", compiled.status().message()));
    }
    regex = *std::move(compiled);
  }
  auto selects = [&](const std::string& name) {
    if (all_linear) return true;
    if (!lora.targets_pattern.empty()) return std::regex_match(name, regex);
    for (const std::string& entry : lora.targets) {
      if (name == entry || absl::EndsWith(name, absl::StrCat(".", entry))) return true;
    }
    return false;
  };
  LATHE_ASSIGN_OR_RETURN(std::vector<std::regex> rank_keys,
                         CompilePatternKeys(lora.rank_pattern, "lora.rank_pattern"));
  LATHE_ASSIGN_OR_RETURN(std::vector<std::regex> alpha_keys,
                         CompilePatternKeys(lora.alpha_pattern, "lora.alpha_pattern"));
  std::vector<bool> rank_key_used(rank_keys.size()), alpha_key_used(alpha_keys.size());
  std::vector<LoraTarget> matched;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    for (const std::string& module : modules) {
      const std::string name = ProjectionName(layer, module);
      if (!selects(name)) continue;
      LoraTarget target{layer, module, lora.rank, lora.alpha};
      if (const auto* entry = PatternEntryOf(lora.rank_pattern, rank_keys, name)) {
        target.rank = entry->second;
      }
      if (const auto* entry = PatternEntryOf(lora.alpha_pattern, alpha_keys, name)) {
        target.alpha = entry->second;
      }
      LATHE_RETURN_IF_ERROR(
          MarkMatches(lora.rank_pattern, rank_keys, name, "lora.rank_pattern", &rank_key_used));
      LATHE_RETURN_IF_ERROR(
          MarkMatches(lora.alpha_pattern, alpha_keys, name, "lora.alpha_pattern", &alpha_key_used));
      matched.push_back(std::move(target));
    }
  }
  if (matched.empty()) {
    const std::string example =
        modules.empty() ? std::string("none") : ProjectionName(0, modules.front());
    return absl::InvalidArgumentError(
        absl::StrCat("lora.targets: ",
                     lora.targets_pattern.empty()
                         ? absl::StrCat("[", absl::StrJoin(lora.targets, ", "), "]")
                         : absl::StrCat("\"", absl::CHexEscape(lora.targets_pattern), "\""),
                     " selects no module of the model (", num_layers,
                     " layers; full names such as ", example, ")"));
  }
  // PEFT warns about a key that applies to no targeted module; here it is refused, so that a
  // typo does not silently train at the default rank.
  for (const auto& [field, keys, used] :
       {std::tuple{"lora.rank_pattern", PatternKeysOf(lora.rank_pattern), &rank_key_used},
        std::tuple{"lora.alpha_pattern", PatternKeysOf(lora.alpha_pattern), &alpha_key_used}}) {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!(*used)[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ": key \"", absl::CHexEscape(keys[i]),
                         "\" matches no module that lora.targets selects"));
      }
    }
  }
  return matched;
}

absl::StatusOr<std::vector<LoraTarget>> MatchLoraTargets(const LoraSpec& lora,
                                                         const ModelConfig& config) {
  if (lora.targets_pattern.empty()) {
    // The projection each entry names (its last dotted component); the spec allows any
    // architecture's (IsProjectionModule), the model has its own.
    std::vector<std::string> named;
    for (const std::string& entry : lora.targets) {
      const size_t dot = entry.rfind('.');
      const std::string module = dot == std::string::npos ? entry : entry.substr(dot + 1);
      if (IsProjectionModule(module)) named.push_back(module);
    }
    if (!named.empty()) LATHE_RETURN_IF_ERROR(LoraTargetsOf(config, named).status());
  }
  return MatchLoraTargets(lora, config.num_hidden_layers, ProjectionModules(config));
}

std::vector<std::string> ModulesOfTargets(absl::Span<const LoraTarget> targets,
                                          absl::Span<const std::string> modules) {
  std::vector<std::string> selected;
  for (const std::string& module : modules) {
    for (const LoraTarget& target : targets) {
      if (target.module == module) {
        selected.push_back(module);
        break;
      }
    }
  }
  return selected;
}

void SetPeftTargetModules(const LoraSpec& lora, absl::Span<const LoraTarget> matched,
                          PeftAdapterConfig* config) {
  config->target_modules.clear();
  config->target_modules_pattern.clear();
  if (lora.targets_pattern.empty() && lora.targets.empty()) {
    for (const LoraTarget& target : matched) {
      if (std::find(config->target_modules.begin(), config->target_modules.end(), target.module) ==
          config->target_modules.end()) {
        config->target_modules.push_back(target.module);
      }
    }
  } else if (lora.targets_pattern.empty()) {
    config->target_modules = lora.targets;
  } else if (!IsAllLinear(lora.targets_pattern)) {
    config->target_modules_pattern = lora.targets_pattern;
  } else {
    for (const LoraTarget& target : matched) {
      config->target_modules.push_back(ProjectionName(target.layer, target.module));
    }
  }
}

void SetSpecTargets(const PeftAdapterConfig& config, LoraSpec* lora) {
  lora->targets = config.target_modules;
  lora->targets_pattern = config.target_modules_pattern;
}

absl::StatusOr<SavedModules> ResolveModulesToSave(absl::Span<const std::string> names) {
  SavedModules saved;
  for (const std::string& name : names) {
    if (name == "embed_tokens" || name == "model.embed_tokens") {
      saved.embed_tokens = true;
    } else if (name == "lm_head") {
      saved.lm_head = true;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("\"", name,
                       "\" is not a module Lathe trains whole (embed_tokens, model.embed_tokens or "
                       "lm_head)"));
    }
  }
  return saved;
}

}  // namespace lathe
