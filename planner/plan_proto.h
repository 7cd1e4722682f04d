// The planner's answer as lathe.v1.PlanJobResponse: what JobService.PlanJob and SubmitJob
// answer, and what `lathe plan --local` prints without a coordinator (the plan itself:
// plan_spec.h).
//
// Thread-safety: pure functions.
#ifndef LATHE_PLANNER_PLAN_PROTO_H_
#define LATHE_PLANNER_PLAN_PROTO_H_

#include "absl/status/statusor.h"
#include "lathe/v1/coordinator.pb.h"
#include "planner/planner.h"

namespace lathe {

v1::PlanJobResponse PlanResultToProto(const PlanResult& result, uint64_t memory_per_rank);

}  // namespace lathe

#endif  // LATHE_PLANNER_PLAN_PROTO_H_
