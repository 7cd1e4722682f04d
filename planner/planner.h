// The strategy search (issue #11, docs/planner.md): every combination of ZeRO stage,
// optimizer and parameter offload, activation checkpointing, the loss kind and the
// micro-batch the job's ranks and device allow, minus the fields the spec fixes; each is
// sized by the memory model (memory_model.h), dropped when its per-rank peak (with a
// headroom) exceeds the memory a rank has, and timed by a cost model: compute from the
// step's FLOPs and the device's rate, communication from the bytes each collective moves
// and the link's bandwidth, offload from the host link's. The fastest that fits wins. A
// peak is the memory model's times the correction learned from the measured peaks of
// earlier attempts like it (calibration.h), when the caller passes those.
//
// Thread-safety: pure functions.
#ifndef LATHE_PLANNER_PLANNER_H_
#define LATHE_PLANNER_PLANNER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "common/plan.h"
#include "planner/calibration.h"
#include "planner/device_pools.h"
#include "planner/memory_model.h"
#include "planner/model_shape.h"

namespace lathe {

struct PlanOptions {
  DeviceRates rates;
  std::string pool = "cpu";  // the device pool the rates describe, for calibration keys
  // Corrections learned from measured peaks (calibration.h); none when null.
  const MemoryCalibration* calibration = nullptr;
  double headroom = 0.10;  // a plan fits when its peak is at most (1 - headroom) x memory
  // The engine's limits (common/capabilities.h): the stages and offload it runs.
  StrategyLimits limits;
  // Why sharding and offload are left out of the search when they are (the device kind's
  // engine cannot run them), for "nothing fits"; empty when they are not.
  std::string without_sharding_because;
};

struct Candidate {
  Strategy point;         // what the candidate runs
  MemoryEstimate memory;  // the memory model's
  MemoryCorrection correction;
  uint64_t peak = 0;  // memory.device.total x correction.factor: what must fit
  double step_seconds = 0;
  double compute_seconds = 0, comm_seconds = 0, offload_seconds = 0;
  bool fits = false;
  std::string verdict;  // "chosen", or why it lost
};

struct PlanResult {
  Plan plan;                          // the chosen strategy, its memory and explanation
  std::vector<Candidate> candidates;  // fastest first; the chosen one first of all
  double tokens_per_second = 0;
};

// Plans `spec` (valid, ValidateJobSpec) for the model `shape`. Fields the spec fixes
// (an explicit strategy's fields other than `auto`, a micro-batch) are honoured.
// RESOURCE_EXHAUSTED when nothing fits, with the smallest configuration's breakdown and
// what would make it fit; INVALID_ARGUMENT for a LoRA target the model lacks.
absl::StatusOr<PlanResult> PlanJob(const JobSpec& spec, const ModelShape& shape,
                                   const PlanOptions& options);

}  // namespace lathe

#endif  // LATHE_PLANNER_PLANNER_H_
