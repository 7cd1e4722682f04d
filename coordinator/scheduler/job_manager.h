// Admission of jobs: validates a submitted spec (every field, what the engine can run, then
// the paths and the model it names), plans it (coordinator/planner/: the strategy, the
// memory per rank it predicts), makes its id, and hands it to the Scheduler. Also answers
// PlanJob with the same checks and plan, storing nothing, and pages job lists.
//
// The memory a rank may use: the spec's resources.memory_per_rank; else the largest a
// registered worker of the job's device offers (a GPU's memory; a CPU host's divided by the
// job's ranks); else, with no such worker yet, the coordinator host's memory over the ranks
// (CPU) or an H100's 80 GiB (CUDA).
//
// Thread-safety: thread-safe (stateless apart from the scheduler it calls).
#ifndef LATHE_COORDINATOR_SCHEDULER_JOB_MANAGER_H_
#define LATHE_COORDINATOR_SCHEDULER_JOB_MANAGER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/planner/planner.h"
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
  // RESOURCE_EXHAUSTED "spec: nothing fits: ..." when no strategy fits the memory per rank.
  absl::StatusOr<v1::SubmitJobResponse> Submit(const v1::SubmitJobRequest& request);

  // The plan Submit would make, with every configuration considered; the same errors.
  absl::StatusOr<v1::PlanJobResponse> Plan(const v1::PlanJobRequest& request) const;

  // Newest first, page_size jobs (default 100, at most 1000) after page_token (the id of
  // the last job of the previous page). INVALID_ARGUMENT for an unknown token or size < 0.
  absl::StatusOr<v1::ListJobsResponse> List(const v1::ListJobsRequest& request) const;

 private:
  struct Admitted {
    JobSpec spec;
    PlanResult plan;
    uint64_t memory_per_rank;
  };
  absl::StatusOr<Admitted> Admit(const v1::JobSpec& spec) const;
  uint64_t DefaultMemoryPerRank(const JobSpec& spec) const;
  absl::Status CheckPaths(const v1::JobSpec& spec) const;

  Scheduler* const scheduler_;
  const JobManagerOptions options_;
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_SCHEDULER_JOB_MANAGER_H_
