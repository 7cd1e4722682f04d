#include "planner/plan_spec.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/capabilities.h"
#include "common/host_memory.h"
#include "common/model_config.h"

namespace lathe {

absl::StatusOr<PlanOptions> PlanOptionsFor(const JobSpec& spec, absl::string_view pool,
                                           DeviceRates rates) {
  const bool cuda = spec.resources.device == DeviceKind::kCuda;
  PlanOptions options;
  options.rates = rates;
  options.pool = std::string(pool);
  if (spec.resources.memory_per_rank > 0) {
    options.rates.memory_bytes = spec.resources.memory_per_rank;
  } else if (rates.memory_bytes == 0) {
    if (cuda) {
      return absl::FailedPreconditionError(
          absl::StrCat("resources.memory_per_rank: not given, and the ", pool,
                       " pool's memory is unknown (no worker of it registered)"));
    }
    // This machine's memory, shared by the job's ranks: a stand-in for the workers'.
    absl::StatusOr<uint64_t> host = HostMemoryBytes();
    if (!host.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("resources.memory_per_rank: not given, and this host's memory is unknown: ",
                       host.status().message()));
    }
    options.rates.memory_bytes = *host / static_cast<uint64_t>(spec.resources.ranks);
  }
  options.limits = Engine().strategy;
  return options;
}

absl::StatusOr<PlanResult> PlanSpec(const JobSpec& spec, const PlanOptions& options) {
  absl::StatusOr<ModelConfig> model = LoadModelConfig(spec.model.path);
  if (!model.ok()) {
    return absl::Status(model.status().code(),
                        absl::StrCat("model.path: ", model.status().message()));
  }
  return PlanJob(spec, ModelShapeOf(*model), options);
}

}  // namespace lathe
