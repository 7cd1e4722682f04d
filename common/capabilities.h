// What the training engine (worker/engine) can run, in one list. The trainer checks a job
// against it before it loads a byte, and the coordinator's SubmitJob checks every spec
// against it at the door, so that a job the engine cannot run is refused at once with the
// same one-line message (naming the spec field) and never stored, queued or placed.
//
// Extending the engine means extending this list in the same change; nothing else decides
// what is supported.
//
// Thread-safety: constants and pure functions.
#ifndef LATHE_COMMON_CAPABILITIES_H_
#define LATHE_COMMON_CAPABILITIES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"

namespace lathe {

struct EngineCapabilities {
  std::vector<Method> methods;
  std::vector<std::string> model_types;  // config.json's model_type
  std::vector<Precision> precisions;
  std::vector<OptimizerKind> optimizers;
  std::vector<DeviceKind> devices;
  StrategyLimits strategy;
};

// This build's engine.
const EngineCapabilities& Engine();

// True when `model_type` is one the engine runs.
bool IsSupportedModelType(absl::string_view model_type);

// OK when `caps` can run `spec` (a valid spec, ValidateJobSpec). Otherwise UNIMPLEMENTED
// with "<field>: <value> is not supported by this engine yet (supported: ...)" for the
// first field it cannot run.
absl::Status CheckEngineSupports(const JobSpec& spec, const EngineCapabilities& caps = Engine());

}  // namespace lathe

#endif  // LATHE_COMMON_CAPABILITIES_H_
