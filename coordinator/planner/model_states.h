// Per-rank bytes of a job's model states (frozen weights, trainable parameters, gradients,
// optimizer state, gathered units) under a ZeRO stage and offload: the formulas of
// docs/sharding.md, over the same units the engine shards (worker/shard): the embeddings,
// every block, the final norm with the head. Activations and the loss peak are not here.
//
// Thread-safety: pure functions.
#ifndef LATHE_COORDINATOR_PLANNER_MODEL_STATES_H_
#define LATHE_COORDINATOR_PLANNER_MODEL_STATES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "coordinator/planner/model_shape.h"

namespace lathe {

// Element counts of one unit's flat buffers.
struct UnitElements {
  int64_t frozen = 0;
  int64_t trainable = 0;
};

// The [in, out] features of a projection by the engine's name (q_proj, k_proj, v_proj,
// o_proj, gate_proj, up_proj, down_proj). INVALID_ARGUMENT "lora.targets: ..." for a name
// the family has no projection of.
struct ProjectionDims {
  int64_t in = 0;
  int64_t out = 0;
};
absl::StatusOr<ProjectionDims> ProjectionOf(const ModelShape& shape, absl::string_view name);

// LoRA parameters of one block for `rank` on `targets` (the engine's names: q_proj, k_proj,
// v_proj, o_proj, gate_proj, up_proj, down_proj). INVALID_ARGUMENT "lora.targets: ..." for
// a name the family has no projection of.
absl::StatusOr<int64_t> LoraParamsPerBlock(const ModelShape& shape, int64_t rank,
                                           const std::vector<std::string>& targets);

// The units in the engine's order: the embeddings, each block, the head (final norm and LM
// head; with tied embeddings the final norm alone). LoRA: frozen base, trainable adapters;
// full fine-tuning: everything trainable.
absl::StatusOr<std::vector<UnitElements>> UnitsOf(const ModelShape& shape, Method method,
                                                  int64_t lora_rank,
                                                  const std::vector<std::string>& targets);

struct ShardingChoice {
  int64_t ranks = 1;
  int64_t zero_stage = 0;
  bool offload_optimizer = false;
  bool offload_params = false;
};

struct ModelStateBytes {
  // On the device, per rank.
  int64_t weights = 0;
  int64_t trainable = 0;
  int64_t gradients = 0;
  int64_t optimizer = 0;
  int64_t gathered_unit = 0;  // stage 3: the largest unit, gathered whole (comm_buffers)
  // In host memory, per rank, with offload (optimizer state and master; parameter slices).
  int64_t host = 0;
};

// `weight_bytes`: bytes per frozen weight (4 fp32, 2 bf16/fp16); trainable tensors are
// float32 masters and AdamW keeps two float32 moments.
ModelStateBytes ModelStates(const std::vector<UnitElements>& units, int64_t weight_bytes,
                            const ShardingChoice& choice);

}  // namespace lathe

#endif  // LATHE_COORDINATOR_PLANNER_MODEL_STATES_H_
