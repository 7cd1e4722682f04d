// Admission of jobs: validates a submitted spec (every field, what the engine can run, then
// the paths and the model it names), makes its plan and id, and hands it to the Scheduler.
// Also pages job lists.
//
// Until the planner (coordinator/planner/) lands, the plan is PlanFromSpec's
// (common/plan.h): the spec's explicit choices, or no sharding with an auto micro-batch.
//
// Thread-safety: thread-safe (stateless apart from the scheduler it calls).
#ifndef LATHE_COORDINATOR_SCHEDULER_JOB_MANAGER_H_
#define LATHE_COORDINATOR_SCHEDULER_JOB_MANAGER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/scheduler/scheduler.h"
#include "lathe/v1/coordinator.pb.h"

namespace lathe {

struct JobManagerOptions {
  // When not empty, every path of a spec must lie inside one of these directories (after
  // resolving "." and ".."; symbolic links are not followed).
  std::vector<std::string> allowed_roots;
};

class JobManager {
 public:
  // REQUIRES: `scheduler` outlives the manager.
  JobManager(Scheduler* scheduler, JobManagerOptions options);

  // INVALID_ARGUMENT "spec: <field>: <problem>" for a bad spec, a relative path, a path
  // outside the allowed roots, a model directory without a readable config.json, a missing
  // training file, or seq_len above the model's max_position_embeddings; UNIMPLEMENTED
  // "spec: <field>: ..." for what the engine cannot run (common/capabilities.h). Nothing is
  // stored then. A repeated request_id returns the job it created first (existing = true).
  absl::StatusOr<v1::SubmitJobResponse> Submit(const v1::SubmitJobRequest& request);

  // Newest first, page_size jobs (default 100, at most 1000) after page_token (the id of
  // the last job of the previous page). INVALID_ARGUMENT for an unknown token or size < 0.
  absl::StatusOr<v1::ListJobsResponse> List(const v1::ListJobsRequest& request) const;

 private:
  absl::Status CheckPaths(const v1::JobSpec& spec) const;

  Scheduler* const scheduler_;
  const JobManagerOptions options_;
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_SCHEDULER_JOB_MANAGER_H_
