// Conversions between the job spec (common/job_spec.h) and its proto mirror
// (lathe.v1.JobSpec). The YAML schema stays the single source of validation: a proto spec is
// rendered back to that schema (only the fields it sets) and parsed by ParseJobSpec, so the
// coordinator's errors name the same fields as the worker's and the CLI's.
//
// Thread-safety: pure functions.
#ifndef LATHE_COMMON_PROTO_JOB_SPEC_PROTO_H_
#define LATHE_COMMON_PROTO_JOB_SPEC_PROTO_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "lathe/v1/job.pb.h"

namespace lathe {

// The proto form of a parsed spec, every field set (optional scalars present).
v1::JobSpec JobSpecToProto(const JobSpec& spec);

// The spec as JSON text in the YAML schema of docs/job-spec.md, with only the fields the
// proto sets (absent optional scalars, empty strings, UNSPECIFIED enums and empty repeated
// fields are left out, so that ParseJobSpec applies the documented defaults). Accepted by
// ParseJobSpec and LoadJobSpec; lathe-worker agents write it as the trainer's spec file.
std::string JobSpecProtoToJson(const v1::JobSpec& spec);

// Validates and converts a proto spec: JobSpecProtoToJson, then ParseJobSpec with `source`
// naming it in messages ("spec: train.lr: must be > 0, got -1"). INVALID_ARGUMENT as
// ParseJobSpec.
absl::StatusOr<JobSpec> JobSpecFromProto(const v1::JobSpec& spec, absl::string_view source);

}  // namespace lathe

#endif  // LATHE_COMMON_PROTO_JOB_SPEC_PROTO_H_
