#include "common/proto/memory_breakdown.h"

namespace lathe {

uint64_t ComponentBytes(const v1::MemoryBreakdown& m, MemoryComponent component) {
  switch (component) {
    case MemoryComponent::kWeights:
      return m.weights();
    case MemoryComponent::kTrainable:
      return m.trainable();
    case MemoryComponent::kGradients:
      return m.gradients();
    case MemoryComponent::kOptimizer:
      return m.optimizer();
    case MemoryComponent::kActivations:
      return m.activations();
    case MemoryComponent::kLogits:
      return m.logits();
    case MemoryComponent::kCommBuffers:
      return m.comm_buffers();
    case MemoryComponent::kOverhead:
      return m.overhead();
  }
  return 0;
}

void SetComponentBytes(v1::MemoryBreakdown* m, MemoryComponent component, uint64_t bytes) {
  switch (component) {
    case MemoryComponent::kWeights:
      return m->set_weights(bytes);
    case MemoryComponent::kTrainable:
      return m->set_trainable(bytes);
    case MemoryComponent::kGradients:
      return m->set_gradients(bytes);
    case MemoryComponent::kOptimizer:
      return m->set_optimizer(bytes);
    case MemoryComponent::kActivations:
      return m->set_activations(bytes);
    case MemoryComponent::kLogits:
      return m->set_logits(bytes);
    case MemoryComponent::kCommBuffers:
      return m->set_comm_buffers(bytes);
    case MemoryComponent::kOverhead:
      return m->set_overhead(bytes);
  }
}

double EffectiveCorrection(double stored) { return stored > 0 ? stored : 1.0; }

uint64_t CorrectedTotal(const v1::MemoryBreakdown& predicted, double correction) {
  return static_cast<uint64_t>(static_cast<double>(predicted.total()) *
                               EffectiveCorrection(correction));
}

}  // namespace lathe
