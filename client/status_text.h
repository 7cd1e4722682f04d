// Human-readable renderings of job and worker status for the `lathe` CLI: the `list` and
// `workers` tables, the multi-line `status` view, and the small pieces they share (state
// names, durations, byte sizes, timestamps, the ETA). The JSON of `--output json` is
// client/job_json.h.
//
// Every function that shows an age takes `now` so that output is a pure function of its
// inputs.
//
// Thread-safety: pure functions.
#ifndef LATHE_CLIENT_STATUS_TEXT_H_
#define LATHE_CLIENT_STATUS_TEXT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/job_spec.h"  // FormatBytes
#include "common/proto/job_state.h"
#include "lathe/v1/coordinator.pb.h"
#include "lathe/v1/job.pb.h"

namespace lathe {

// "QUEUED", "RUNNING", ... (the enum name without its prefix); "UNKNOWN" for 0 or an
// unrecognised value.
std::string JobStateName(v1::JobState state);
std::string AttemptStateName(v1::AttemptState state);
std::string ProfileStateName(v1::ProfileState state);

// One capture in `lathe status`: its id, state, attempt, ranks, steps (the steps profiled
// once known), when it was asked; then a line per file (rank, name, size) and the error.
std::string ProfileText(const v1::ProfileCapture& capture, const v1::Attempt& attempt);

// Parses a state as a user types it: "running", "RUNNING" or "JOB_STATE_RUNNING".
// INVALID_ARGUMENT listing the accepted names otherwise.
absl::StatusOr<v1::JobState> ParseJobState(absl::string_view text);

// "45s", "1m05s", "2h03m", "3d04h"; negative durations read "0s". (Not named FormatDuration:
// argument-dependent lookup would find absl::FormatDuration too.)
std::string ShortDuration(absl::Duration duration);

// "2026-01-02T03:04:05Z" (UTC); "-" for 0.
std::string FormatTimestamp(int64_t unix_ms);

// The last attempt's progress (rank 0), or nullptr when there is no attempt or it has not
// reported a step yet. Points into `status`.
const v1::Progress* LatestProgress(const v1::JobStatus& status);

// The number of optimizer steps the job will run: the progress's total, else the plan's;
// 0 when neither is known.
int64_t TotalSteps(const v1::JobStatus& status);

// "12/100", "12/?" or "-".
std::string StepText(const v1::JobStatus& status);

// The job's expected remaining time in seconds: (total - step) x step_seconds of the latest
// progress, for a RUNNING job whose latest progress reports step_seconds > 0 and whose total
// steps are known (TotalSteps > 0); 0 once the step reaches the total. nullopt otherwise (not
// running, no progress yet, no step time yet, unknown total). The one ETA of the CLI: `lathe
// watch`'s progress bar and the JSON job object's eta_seconds both show it.
std::optional<double> EtaSeconds(const v1::JobStatus& status);

// `text` cut to at most `max_chars` bytes, ending in "..." when cut; line breaks become spaces.
std::string Truncate(absl::string_view text, size_t max_chars);

// The `lathe list` table: ID, NAME, STATE, STEP, LOSS, AGE, REASON; a header line even when
// `jobs` is empty.
std::string JobTable(const std::vector<v1::JobStatus>& jobs, absl::Time now);

// The `lathe status` view: state, reason, plan, attempts, profile captures, latest progress, memory
// (predicted next to measured), final loss, result paths. Ends with a newline.
std::string JobDetails(const v1::JobStatus& status, absl::Time now);

// The `lathe workers` table: ID, STATE, DEVICE, SLOTS, LAST HEARTBEAT, RUNNING.
std::string WorkerTable(const std::vector<v1::WorkerStatus>& workers, absl::Time now);

// `lathe plan`: the chosen plan, its predicted speed and memory per component, and the
// first `max_candidates` configurations considered with their verdicts.
std::string PlanReportText(const v1::PlanJobResponse& response, size_t max_candidates);

// `lathe plan --history`: each attempt's predicted, planned (corrected) and measured peak
// per rank with the errors, their median and worst, and the corrections. Ends with a newline.
std::string PlanHistoryText(const v1::GetPlanHistoryResponse& history);

}  // namespace lathe

#endif  // LATHE_CLIENT_STATUS_TEXT_H_
