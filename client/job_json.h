// The JSON that `lathe --output json` prints: a stable schema for scripts, documented field by
// field in docs/cli-json.md. Unlike protobuf's JSON mapping, counts and sizes are JSON numbers,
// states and enum values are lowercase words ("running", "cuda", "bf16"), and every field is
// always present: zero values are printed, and null appears only where the schema allows it
// (a loss not reported yet, no ETA, no progress, a spec that does not convert) and for a
// floating-point value that is not finite.
//
// Stability: fields may be added; none is renamed, removed or retyped. A state left
// UNSPECIFIED, or an enum value that this client has no name for (from a newer coordinator),
// reads as "unknown".
//
// Thread-safety: pure functions.
#ifndef LATHE_CLIENT_JOB_JSON_H_
#define LATHE_CLIENT_JOB_JSON_H_

#include <string>

#include "lathe/v1/coordinator.pb.h"
#include "lathe/v1/job.pb.h"
#include "nlohmann/json.hpp"

namespace lathe {

// The job object: the same shape from `submit`, `status`, `list`, `cancel` and `watch`. Its
// `spec` is the spec in its own YAML schema (JobSpecToJson), or null when the status's spec
// does not convert (an empty one, say); `eta_seconds` is EtaSeconds (client/status_text.h).
nlohmann::ordered_json JobJson(const v1::JobStatus& status);

// The worker object of `lathe workers`.
nlohmann::ordered_json WorkerJson(const v1::WorkerStatus& worker);

// A profile capture (`lathe profile`, and each attempt's "profiles" in JobJson).
nlohmann::ordered_json ProfileJson(const v1::ProfileCapture& capture);

// The progress object (one rank's latest report) and the memory object (bytes per rank), as
// they appear inside a job object.
nlohmann::ordered_json ProgressJson(const v1::Progress& progress);
nlohmann::ordered_json MemoryJson(const v1::MemoryBreakdown& memory);

// The object of `lathe plan`: the plan (as inside a job object), the predicted tokens/s, the
// memory per rank it was fitted to, and every candidate with its memory and verdict.
nlohmann::ordered_json PlanResponseJson(const v1::PlanJobResponse& response);

// The object of `lathe plan --history`: the measured attempts and the corrections.
nlohmann::ordered_json PlanHistoryJson(const v1::GetPlanHistoryResponse& history);

// `json` on one line, without a trailing newline. Invalid UTF-8 in a string (a trainer's log
// line in an attempt's error, say) becomes U+FFFD instead of failing.
std::string JsonLine(const nlohmann::ordered_json& json);

}  // namespace lathe

#endif  // LATHE_CLIENT_JOB_JSON_H_
