#include "common/capabilities.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lathe {
namespace {

template <typename T>
bool Contains(const std::vector<T>& values, const T& value) {
  return std::find(values.begin(), values.end(), value) != values.end();
}

// "<field>: <value> is not supported by this engine yet (supported: a, b)".
template <typename T, typename Name>
absl::Status Unsupported(absl::string_view field, const T& value, const std::vector<T>& supported,
                         Name name) {
  std::vector<std::string> names;
  for (const T& v : supported) names.emplace_back(name(v));
  return absl::UnimplementedError(absl::StrCat(
      field, ": ", name(value),
      " is not supported by this engine yet (supported: ", absl::StrJoin(names, ", "), ")"));
}

}  // namespace

const EngineCapabilities& Engine() {
  static const EngineCapabilities* const kEngine = new EngineCapabilities{
      /*methods=*/{Method::kLora, Method::kFull, Method::kQLora, Method::kMezo},
      /*model_types=*/{"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"},
      /*precisions=*/{Precision::kFp32, Precision::kBf16, Precision::kFp16},
      /*optimizers=*/
      {OptimizerKind::kAdamW, OptimizerKind::kAdamW8bit, OptimizerKind::kAdafactor,
       OptimizerKind::kSgd},
      /*devices=*/{DeviceKind::kCpu, DeviceKind::kCuda},
      /*strategy=*/{/*max_zero_stage=*/3, /*offload=*/true, /*sharded_zeroth_order=*/false},
  };
  return *kEngine;
}

bool IsSupportedModelType(absl::string_view model_type) {
  return Contains(Engine().model_types, std::string(model_type));
}

absl::Status CheckEngineSupports(const JobSpec& spec, const EngineCapabilities& caps) {
  if (!Contains(caps.methods, spec.method)) {
    return Unsupported("method", spec.method, caps.methods, MethodName);
  }
  if (!Contains(caps.precisions, spec.train.precision)) {
    return Unsupported("train.precision", spec.train.precision, caps.precisions, PrecisionName);
  }
  if (!Contains(caps.optimizers, spec.train.optimizer)) {
    return Unsupported("train.optimizer", spec.train.optimizer, caps.optimizers, OptimizerKindName);
  }
  if (!Contains(caps.devices, spec.resources.device)) {
    return Unsupported("resources.device", spec.resources.device, caps.devices, DeviceKindName);
  }
  return ValidateStrategy(spec.strategy, StrategyContextOf(spec, caps.strategy));
}

}  // namespace lathe
