// The planner's memory model (issue #11, docs/planner.md): the bytes one rank holds at the
// peak of a training step, in the eight memory components (common/memory_components.h), for a job
// and one point of the strategy space. Model states come from model_states.h; activations and the
// loss peak follow the tensors the engine's kernels keep (worker/engine/causal_lm.cc,
// kernels/ops/), with the backward pass's transient buffers calibrated against the tracking
// allocator (bench/planner_accuracy.py). The estimate walks the step's moments in the engine's
// order and groups them into a timeline of named phases (kPhaseForward ... kPhasePerturbation),
// each at its own largest moment by component; the step's peak is its first largest moment.
//
// Thread-safety: pure functions.
#ifndef LATHE_PLANNER_MEMORY_MODEL_H_
#define LATHE_PLANNER_MEMORY_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "common/plan.h"
#include "planner/model_shape.h"
#include "planner/model_states.h"

namespace lathe {

// What the memory model needs of a job besides its strategy.
struct JobShape {
  ModelShape model;
  Method method = Method::kLora;
  int64_t lora_rank = 0;
  std::vector<std::string> lora_targets;
  SavedModules saved;  // lora.modules_to_save (methods lora and qlora)
  int64_t seq_len = 0;
  int64_t global_batch = 0;  // sequences per step over all ranks; 0: one micro-batch per step
  int64_t ranks = 1;
  DeviceKind device = DeviceKind::kCpu;
  Precision precision = Precision::kFp32;
  OptimizerChoice optimizer;
  bool paged_optimizer = false;
  bool zeroth_order = false;  // method mezo over `method`
};

// The job's shape from a spec and the model's shape.
JobShape JobShapeOf(const JobSpec& spec, const ModelShape& model);

// Bytes per frozen weight: 4 in fp32 (and for full fine-tuning, whose weights are float32
// masters), 2 under bf16 and fp16.
int64_t WeightBytes(const JobShape& job);

// Bytes of `elements` frozen weights in NF4 with double-quantized block maxima (method qlora).
int64_t Nf4Bytes(int64_t elements);

// The phases of a training step, in order (docs/planner.md, "The memory model"). A step has
// forward, loss, backward, hand-over (backward and hand-over alternate, unit by unit from the
// head) and optimizer; reduce at ZeRO-2/3; all-reduce at stage 0 on several ranks; MeZO's
// has forward, loss and perturbation.
inline constexpr absl::string_view kPhaseForward = "forward";       // the last block done
inline constexpr absl::string_view kPhaseLoss = "loss";             // inside the loss
inline constexpr absl::string_view kPhaseBackward = "backward";     // a block running backward
inline constexpr absl::string_view kPhaseHandOver = "hand-over";    // a unit hands over gradients
inline constexpr absl::string_view kPhaseReduce = "reduce";         // the last reductions drain
inline constexpr absl::string_view kPhaseAllReduce = "all-reduce";  // stage 0's flat gradients
inline constexpr absl::string_view kPhaseOptimizer = "optimizer";   // the optimizer step
inline constexpr absl::string_view kPhasePerturbation = "perturbation";  // MeZO's directions

// The phase's moment of the step in words, as MemoryEstimate::peak_phase says it: "the forward
// pass" (forward, loss), "the backward pass" (backward, hand-over, reduce), "the gradient
// all-reduce", "the optimizer step", "the perturbation".
std::string PhaseMoment(absl::string_view phase);

// One phase of the step at its own peak: the bytes one rank holds then, by component (a CUDA
// rank's runtime allowance in overhead in every phase).
struct MemoryPhase {
  std::string name;  // kPhaseForward ...
  MemoryBytes bytes;
};

struct MemoryEstimate {
  MemoryBytes device;      // per rank, components at the peak; total = their sum
  uint64_t host = 0;       // per rank, in host memory (offloaded states), beyond `device` on CPU
  std::string peak_phase;  // PhaseMoment of the peak phase: "the backward pass", ...
  std::vector<MemoryPhase> timeline;  // the step's phases in order; `device` is the peak's

  // The phase of that name, or nullptr where the step has none.
  const MemoryPhase* Phase(absl::string_view name) const;
};

// The per-rank estimate. INVALID_ARGUMENT for a LoRA target the family lacks.
absl::StatusOr<MemoryEstimate> EstimateMemory(const JobShape& job, const Strategy& point);

}  // namespace lathe

#endif  // LATHE_PLANNER_MEMORY_MODEL_H_
