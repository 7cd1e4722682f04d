// The one module that converts a job between its C++ form (common/job_spec.h,
// common/plan.h) and its proto form (lathe.v1.JobSpec, lathe.v1.Plan). The spec is parsed
// once from YAML by whoever holds the file (the CLI, `lathe-worker train --spec`) and
// travels as the proto from then on; whoever receives a proto converts it back here, and the
// conversion validates it with the same checks as the YAML parser (ValidateJobSpec), so a
// raw gRPC caller's errors name the same fields as a file's.
//
// Thread-safety: pure functions.
#ifndef LATHE_COMMON_PROTO_JOB_SPEC_PROTO_H_
#define LATHE_COMMON_PROTO_JOB_SPEC_PROTO_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "common/plan.h"
#include "lathe/v1/job.pb.h"

namespace lathe {

// The proto form of a spec, every field set (optional scalars present, defaults filled in).
v1::JobSpec JobSpecToProto(const JobSpec& spec);

// The spec a proto describes: absent optional scalars, empty strings and lists and
// UNSPECIFIED enums take the documented defaults. INVALID_ARGUMENT
// "<source>: <field>: <problem>" for an enum value this build does not know and everything
// ValidateJobSpec refuses.
absl::StatusOr<JobSpec> JobSpecFromProto(const v1::JobSpec& spec, absl::string_view source);

// A spec's strategy: a field the planner chooses is absent (all absent: "strategy: auto").
v1::Strategy StrategySpecToProto(const StrategySpec& spec);
StrategySpec StrategySpecFromProto(const v1::Strategy& strategy);

// A decided strategy: every field present. An absent field reads as its default (0, false;
// fused_kernels true).
v1::Strategy StrategyToProto(const Strategy& strategy);
Strategy StrategyFromProto(const v1::Strategy& strategy);

v1::Plan PlanToProto(const Plan& plan);

v1::MemoryBreakdown MemoryBytesToProto(const MemoryBytes& bytes);

// INVALID_ARGUMENT "<source>: plan.<field>: ..." for an enum value this build does not know.
// (Whether the plan fits a spec is CheckPlanRunsSpec's question.)
absl::StatusOr<Plan> PlanFromProto(const v1::Plan& plan, absl::string_view source);

}  // namespace lathe

#endif  // LATHE_COMMON_PROTO_JOB_SPEC_PROTO_H_
