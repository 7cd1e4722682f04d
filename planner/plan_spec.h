// The plan of a spec from its model directory, with the options of the device it will run
// on: what the coordinator's JobManager, `lathe plan --local` and `lathe-worker train --spec`
// (a spec run alone) all call, so that a field left to the planner is chosen the same way
// everywhere. No protobuf: the engine-only build has it too.
//
// Thread-safety: PlanSpec reads the model's config.json and PlanOptionsFor may read
// /proc/meminfo; otherwise pure.
#ifndef LATHE_PLANNER_PLAN_SPEC_H_
#define LATHE_PLANNER_PLAN_SPEC_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "planner/device_pools.h"
#include "planner/planner.h"

namespace lathe {

// The options for `spec` on a device of `pool` with `rates`: the memory per rank is the
// spec's resources.memory_per_rank when it gives one, else rates.memory_bytes, else for the
// CPU this host's memory over the job's ranks (FAILED_PRECONDITION when it cannot be read,
// or for a GPU pool without a memory).
absl::StatusOr<PlanOptions> PlanOptionsFor(const JobSpec& spec, absl::string_view pool,
                                           DeviceRates rates);

// Reads `spec.model.path`/config.json (LoadModelConfig) and plans. NOT_FOUND /
// INVALID_ARGUMENT naming model.path's file for a missing or bad config; otherwise PlanJob's
// errors. (The coordinator, which has read the config already, calls PlanJob itself.)
absl::StatusOr<PlanResult> PlanSpec(const JobSpec& spec, const PlanOptions& options);

}  // namespace lathe

#endif  // LATHE_PLANNER_PLAN_SPEC_H_
