// Per-rank bytes of a job's model states (frozen weights, trainable parameters, gradients,
// optimizer state, gathered units) under a ZeRO stage and offload: the formulas of
// docs/sharding.md, over the same units the engine shards (worker/shard): the embeddings,
// every block, the final norm with the head. Activations and the loss peak are not here.
//
// Thread-safety: pure functions.
#ifndef LATHE_PLANNER_MODEL_STATES_H_
#define LATHE_PLANNER_MODEL_STATES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "common/lora_targets.h"
#include "common/strategy.h"
#include "planner/model_shape.h"

namespace lathe {

// Element counts of one unit's flat buffers.
struct UnitElements {
  int64_t frozen = 0;
  int64_t trainable = 0;
};

// The engine's projections of `shape`'s family, in model order (common/model_config.h's
// ProjectionModules): Phi-3's qkv_proj, o_proj, gate_up_proj, down_proj; the others' seven.
const std::vector<std::string>& ProjectionNamesOf(const ModelShape& shape);

// A spec's lora.targets on `shape`: every projection of the family when empty (the spec's
// default), else `targets` as given.
std::vector<std::string> LoraTargetsOn(const ModelShape& shape,
                                       const std::vector<std::string>& targets);

// ProjectionShapeOf for a name the spec gave (ProjectionNamesOf's). INVALID_ARGUMENT
// "lora.targets: ..." for a name the family has no projection of.
absl::StatusOr<ProjectionShape> ProjectionOf(const ModelShape& shape, absl::string_view name);

// LoRA parameters of one block for `rank` on `targets` (the engine's names; empty: every
// projection, LoraTargetsOn). INVALID_ARGUMENT "lora.targets: ..." for a name the family
// has no projection of.
absl::StatusOr<int64_t> LoraParamsPerBlock(const ModelShape& shape, int64_t rank,
                                           const std::vector<std::string>& targets);

// The units in the engine's order: the embeddings, each block, the head (final norm and LM
// head; with tied embeddings the final norm alone). LoRA: frozen base, trainable adapters,
// and `saved`'s copies (lora.modules_to_save: the embeddings' in unit 0, the LM head's in the
// head unit, vocab x hidden each, tied or not); full fine-tuning: everything trainable.
absl::StatusOr<std::vector<UnitElements>> UnitsOf(const ModelShape& shape, Method method,
                                                  int64_t lora_rank,
                                                  const std::vector<std::string>& targets,
                                                  SavedModules saved = {});

// One trainable tensor's shape.
struct TrainableShape {
  std::vector<int64_t> dims;
  bool embeddings = false;  // the token embeddings (8-bit AdamW keeps them in float32)
};

// The shapes of the trainable tensors, in no particular order: LoRA's A [rank, in] and
// B [out, rank] per block and target, and [vocab, hidden] per copy of `saved`; with full
// fine-tuning every weight ([rows, cols]) and every bias and norm weight ([n]).
// INVALID_ARGUMENT as UnitsOf.
absl::StatusOr<std::vector<TrainableShape>> TrainableShapes(const ModelShape& shape, Method method,
                                                            int64_t lora_rank,
                                                            const std::vector<std::string>& targets,
                                                            SavedModules saved = {});

// The optimizer and what decides the size of its state.
struct OptimizerChoice {
  OptimizerKind kind = OptimizerKind::kAdamW;
  bool first_moment = true;   // adafactor: adafactor_beta1 > 0; sgd: sgd_momentum > 0
  bool weight_decay = false;  // train.weight_decay > 0
  bool nesterov = false;      // sgd: sgd_nesterov
};
OptimizerChoice OptimizerChoiceOf(const TrainSpec& train);

// Bytes of optimizer state for tensors of `shapes` on one rank (docs/training.md,
// "Optimizers"): AdamW 8 per element; 8-bit AdamW 2 per element (padded to whole blocks of
// 2048) and 8 per block, or 8 per element below 4096 elements and for the embeddings;
// Adafactor 4 x (rows + cols) per matrix and 4 per vector element, plus 4 per element with a
// first moment; SGD 4 per element with momentum, else nothing. Sharded over `ranks` (ZeRO
// 1-3), the per-element state of a rank's 1/ranks of each tensor (8-bit blocks of that
// piece) and Adafactor's factored statistics whole.
int64_t OptimizerStateBytes(const std::vector<TrainableShape>& shapes,
                            const OptimizerChoice& optimizer, int64_t ranks = 1);

// Bytes per element of the largest trainable tensor that the optimizer step's temporaries
// take, as bench/planner_accuracy.py measured them (AdamW: its denominator and a quotient;
// 8-bit AdamW: both moments in float32 and, while quantizing one, its scaled copy, the
// 64-bit code index and the codes; Adafactor: the squared gradient and the update; SGD: the
// decayed gradient and the Nesterov direction, each when asked for).
int64_t StepTemporaryBytesPerElement(const OptimizerChoice& optimizer);

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
// float32 masters and AdamW keeps two float32 moments. Of `strategy`, the ZeRO stage and
// offload over `ranks` ranks.
ModelStateBytes ModelStates(const std::vector<UnitElements>& units, int64_t weight_bytes,
                            int64_t ranks, const Strategy& strategy);

}  // namespace lathe

#endif  // LATHE_PLANNER_MODEL_STATES_H_
