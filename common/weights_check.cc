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
  if (!adapter.modules_to_save.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(config_path, ": modules_to_save (",
                                                   absl::StrJoin(adapter.modules_to_save, ", "),
                                                   ") is not supported by Lathe"));
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
  return absl::OkStatus();
}

}  // namespace lathe
