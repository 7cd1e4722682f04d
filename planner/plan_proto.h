// The planner's answer as lathe.v1.PlanJobResponse, and the plan of a spec from its model
// directory: what JobService.PlanJob and SubmitJob answer, and what `lathe plan --local`
// prints without a coordinator.
//
// Thread-safety: pure functions, except PlanSpec, which reads the model's config.json, and
// PlanOptionsFor, which may read /proc/meminfo.
#ifndef LATHE_COORDINATOR_PLANNER_PLAN_PROTO_H_
#define LATHE_COORDINATOR_PLANNER_PLAN_PROTO_H_

#include "absl/status/statusor.h"
#include "planner/planner.h"
#include "lathe/v1/coordinator.pb.h"

namespace lathe {

v1::PlanJobResponse PlanResultToProto(const PlanResult& result, uint64_t memory_per_rank);

// The options for `spec` on a device of `pool` with `rates`: the memory per rank is the
// spec's resources.memory_per_rank when it gives one, else rates.memory_bytes, else for the
// CPU this host's memory over the job's ranks (FAILED_PRECONDITION when it cannot be read,
// or for a GPU pool without a memory).
absl::StatusOr<PlanOptions> PlanOptionsFor(const JobSpec& spec, absl::string_view pool,
                                           DeviceRates rates);

// Reads `spec.model.path`/config.json and plans. NOT_FOUND / INVALID_ARGUMENT naming
// model.path's file for a missing or bad config; otherwise PlanJob's errors.
absl::StatusOr<PlanResult> PlanSpec(const JobSpec& spec, const PlanOptions& options);

}  // namespace lathe

#endif  // LATHE_COORDINATOR_PLANNER_PLAN_PROTO_H_
