// Admission of jobs: validates a submitted spec (every field, what the engine can run, then
// the paths and the model it names), plans it (planner/: the strategy, the
// memory per rank it predicts), makes its id, and hands it to the Scheduler. Also answers
// PlanJob with the same checks and plan, storing nothing, and pages job lists.
//
// A job is planned for the pool (planner/device_pools.h) of the registered
// worker of its device where a rank would have the most memory, and with that memory: a
// GPU's, or a CPU host's divided by the job's ranks; the spec's resources.memory_per_rank
// overrides it. With no such worker yet: the cpu pool and the coordinator host's memory
// over the ranks, or the h100 pool and its 80 GiB. Plans apply the memory corrections the
// scheduler learned from earlier attempts (Scheduler::Calibration).
//
// Thread-safety: thread-safe (stateless apart from the scheduler it calls).
#ifndef LATHE_COORDINATOR_SCHEDULER_JOB_MANAGER_H_
#define LATHE_COORDINATOR_SCHEDULER_JOB_MANAGER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/scheduler/scheduler.h"
#include "lathe/v1/coordinator.pb.h"
#include "planner/planner.h"

namespace lathe {

struct JobManagerOptions {
  // When not empty, every path of a spec must lie inside one of these directories, after
  // resolving ".", ".." and symbolic links (of the part of the path that exists).
  std::vector<std::string> allowed_roots;
  // The rates the planner uses for each device pool (--device-rates).
  DevicePools pools = DefaultPools();
};

class JobManager {
 public:
  // REQUIRES: `scheduler` outlives the manager.
  JobManager(Scheduler* scheduler, JobManagerOptions options);

  // INVALID_ARGUMENT "spec: <field>: <problem>" for a bad spec, a relative path, a path
  // outside the allowed roots, a model directory without a readable config.json, seq_len
  // above the model's max_position_embeddings, weights that are missing, malformed or lack
  // a tensor the model needs (common/weights_check.h: headers only), a missing data file,
  // or a bad record among a data file's first lines ("spec: data.train: <path>: line <n>:
  // ...": common/data_check.h, at most 1000 lines and 4 MiB per file); UNIMPLEMENTED
  // "spec: <field>: ..." for what the engine cannot run (common/capabilities.h). Nothing is
  // stored then. A repeated request_id returns the job it created first (existing = true).
  // RESOURCE_EXHAUSTED "spec: nothing fits: ..." when no strategy fits the memory per rank.
  // INVALID_ARGUMENT for a request_id longer than 128 bytes. The job is the requester's.
  absl::StatusOr<v1::SubmitJobResponse> Submit(const v1::SubmitJobRequest& request,
                                               const Requester& requester = {});

  // The plan Submit would make, with every configuration considered; the same errors.
  absl::StatusOr<v1::PlanJobResponse> Plan(const v1::PlanJobRequest& request) const;

  // The predicted and measured peaks of the latest `limit` measured attempts (0: 20, at most
  // 1000) of the jobs the requester sees, and the corrections; INVALID_ARGUMENT for a
  // negative limit.
  absl::StatusOr<v1::GetPlanHistoryResponse> PlanHistory(const v1::GetPlanHistoryRequest& request,
                                                         const Requester& requester = {}) const;

  // Newest first, page_size jobs (default 100, at most 1000; fewer when they would pass
  // 2 MiB) after page_token (the id of the last job of the previous page).
  // INVALID_ARGUMENT for an unknown token or size < 0. Only the jobs the requester sees.
  absl::StatusOr<v1::ListJobsResponse> List(const v1::ListJobsRequest& request,
                                            const Requester& requester = {}) const;

 private:
  struct Admitted {
    JobSpec spec;
    PlanResult plan;
    uint64_t memory_per_rank;
  };
  absl::StatusOr<Admitted> Admit(const v1::JobSpec& spec) const;
  // The device pool a job would be planned for, with its rates and a rank's memory there.
  std::pair<std::string, DeviceRates> PoolFor(const JobSpec& spec) const;
  // Replaces each path of the spec by its canonical form (links resolved: two spellings of
  // one directory compare equal, and the trainer re-checks exactly what was admitted);
  // INVALID_ARGUMENT "spec: <field>: ..." for a relative one or one outside the roots.
  absl::Status CanonicalizePaths(JobSpec& spec) const;

  Scheduler* const scheduler_;
  const JobManagerOptions options_;
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_SCHEDULER_JOB_MANAGER_H_
