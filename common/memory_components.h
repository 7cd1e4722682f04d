// The eight memory components (docs/training.md, "Outputs"), defined once: the planner's
// estimate, the trainer's measurement (worker/engine/memory_tracker.h), the proto
// MemoryBreakdown (common/proto/memory_breakdown.h), the CLI and the Prometheus label
// `component` all use these names, in this order.
//
// Thread-safety: constants and pure functions.
#ifndef LATHE_COMMON_MEMORY_COMPONENTS_H_
#define LATHE_COMMON_MEMORY_COMPONENTS_H_

#include <array>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace lathe {

// In the order of MemoryBreakdown's fields.
enum class MemoryComponent : uint8_t {
  kWeights,    // frozen base
  kTrainable,  // LoRA or full parameters, master copy
  // What backward makes: the trainable tensors' gradients (kept until the optimizer step),
  // the gradients flowing back through the activations, and backward's working buffers.
  // Activations recomputed under checkpointing are kActivations.
  kGradients,
  kOptimizer,
  kActivations,  // saved for backward, peak
  kLogits,       // loss computation peak
  kCommBuffers,  // gathered ZeRO-3 units, bucket buffers
  kOverhead,     // runtime, allocator slack
};
inline constexpr int kNumMemoryComponents = 8;

// Every component, in order, for loops.
inline constexpr std::array<MemoryComponent, kNumMemoryComponents> kMemoryComponents = {
    MemoryComponent::kWeights,     MemoryComponent::kTrainable,   MemoryComponent::kGradients,
    MemoryComponent::kOptimizer,   MemoryComponent::kActivations, MemoryComponent::kLogits,
    MemoryComponent::kCommBuffers, MemoryComponent::kOverhead,
};

// "weights", "trainable", "gradients", "optimizer", "activations", "logits",
// "comm_buffers", "overhead".
inline absl::string_view MemoryComponentName(MemoryComponent component) {
  static constexpr absl::string_view kNames[kNumMemoryComponents] = {
      "weights",     "trainable", "gradients",    "optimizer",
      "activations", "logits",    "comm_buffers", "overhead"};
  return kNames[static_cast<int>(component)];
}

}  // namespace lathe

#endif  // LATHE_COMMON_MEMORY_COMPONENTS_H_
