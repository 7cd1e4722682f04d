#include "common/weights_check.h"

#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/lora_targets.h"
#include "common/peft.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace lathe {
namespace {

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::Status CheckModelWeights(const std::string& dir, const ModelConfig& config) {
  LATHE_ASSIGN_OR_RETURN(SafetensorsDirectory files, SafetensorsDirectory::Open(dir));
  // The same checks and words as CausalLm::Load (worker/engine/causal_lm.cc).
  for (const WeightSpec& w : ExpectedWeights(config)) {
    SafetensorsDirectory::Entry entry = files.Find(w.name);
    if (entry.tensor == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(dir, ": tensor \"", w.name,
                                                     "\" is missing (config.json implies shape ",
                                                     ShapeText(w.shape), ")"));
    }
    if (entry.tensor->shape != w.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          entry.file->path(), ": tensor \"", w.name, "\": shape ", ShapeText(entry.tensor->shape),
          " in the file vs ", ShapeText(w.shape), " from config.json"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckLoraInitFrom(const std::string& dir, const ModelConfig& config,
                               const LoraSpec& lora) {
  // The same checks and words as CausalLm::LoadLora.
  const std::string config_path = dir + "/adapter_config.json";
  LATHE_ASSIGN_OR_RETURN(std::string config_text, ReadFile(config_path));
  LATHE_ASSIGN_OR_RETURN(PeftAdapterConfig adapter,
                         ParsePeftAdapterConfig(config_text, config_path));
  absl::StatusOr<SavedModules> has = ResolveModulesToSave(adapter.modules_to_save);
  if (!has.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(config_path, ": modules_to_save: ", has.status().message()));
  }
  LATHE_ASSIGN_OR_RETURN(SavedModules wants, ResolveModulesToSave(lora.modules_to_save));
  if (has->embed_tokens != wants.embed_tokens || has->lm_head != wants.lm_head) {
    return absl::InvalidArgumentError(absl::StrCat(
        config_path, ": modules_to_save is [", absl::StrJoin(adapter.modules_to_save, ", "),
        "] but lora.modules_to_save is [", absl::StrJoin(lora.modules_to_save, ", "), "]"));
  }
  if (adapter.r != lora.rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(config_path, ": r is ", adapter.r, " but lora.rank is ", lora.rank));
  }
  const std::string weights_path = dir + "/adapter_model.safetensors";
  LATHE_ASSIGN_OR_RETURN(std::shared_ptr<const SafetensorsFile> file,
                         SafetensorsFile::Open(weights_path));
  LATHE_ASSIGN_OR_RETURN(std::vector<LoraTarget> targets, MatchLoraTargets(lora, config));
  for (const LoraTarget& target : targets) {
    const ProjectionShape shape = ProjectionShapeOf(config, target.module);
    for (const auto& [which, want] :
         {std::pair{"A", std::vector<int64_t>{target.rank, shape.in_features}},
          std::pair{"B", std::vector<int64_t>{shape.out_features, target.rank}}}) {
      const std::string name = PeftLoraTensorName(target.layer, target.module, which);
      const TensorView* view = file->Find(name);
      if (view == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(weights_path, ": tensor \"", name, "\" is missing"));
      }
      if (view->shape != want) {
        return absl::InvalidArgumentError(absl::StrCat(weights_path, ": tensor \"", name,
                                                       "\": shape ", ShapeText(view->shape), " vs ",
                                                       ShapeText(want), " expected"));
      }
    }
  }
  const std::vector<int64_t> module_shape = {config.vocab_size, config.hidden_size};
  for (const auto& [saved, name] : {std::pair{wants.embed_tokens, kPeftSavedEmbedTokens},
                                    std::pair{wants.lm_head, kPeftSavedLmHead}}) {
    if (!saved) continue;
    const TensorView* view = file->Find(name);
    if (view == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(weights_path, ": tensor \"", name, "\" is missing"));
    }
    if (view->shape != module_shape) {
      return absl::InvalidArgumentError(absl::StrCat(weights_path, ": tensor \"", name,
                                                     "\": shape ", ShapeText(view->shape), " vs ",
                                                     ShapeText(module_shape), " expected"));
    }
  }
  return absl::OkStatus();
}

}  // namespace lathe
