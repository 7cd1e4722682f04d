// Zeroth-order training (MeZO, Malladi et al. 2023; docs/training.md "MeZO"): the gradient
// along a random direction z, estimated from two forward passes at theta +- eps z, with z
// regenerated from a per-step seed each time it is needed (never stored), so the run holds
// no gradients, no optimizer state and no activations past their block.
//
// Thread-safety: free functions; not for concurrent use on the same parameters.
#ifndef LATHE_WORKER_TRAIN_MEZO_H_
#define LATHE_WORKER_TRAIN_MEZO_H_

#include <cstdint>
#include <vector>

#include "kernels/ops/torch_compat.h"
#include "worker/engine/causal_lm.h"

namespace lathe {

// The seed of step `step` (1-based) of a run seeded `seed`: seed + step * 0x9E3779B97F4A7C15
// modulo 2^64.
uint64_t MezoSeed(uint64_t seed, int64_t step);

// `params` in MeZO's order, in which the directions are drawn: ascending by name (PEFT
// adapter names for LoRA, Hugging Face names for full weights).
std::vector<NamedParameter> MezoOrder(std::vector<NamedParameter> params);

// Adds `scale` z to each parameter, z ~ N(0, 1) float32 drawn on the CPU from a generator
// seeded `seed`, one tensor at a time in the order of `params`.
void MezoPerturb(const std::vector<NamedParameter>& params, uint64_t seed, double scale);

// The update with the same directions: p -= lr (projected z + weight_decay p), the weight
// decay only where the parameter decays (torch.optim.SGD's on the gradient projected z).
void MezoUpdate(const std::vector<NamedParameter>& params, uint64_t seed, double projected,
                double lr, double weight_decay);

}  // namespace lathe

#endif  // LATHE_WORKER_TRAIN_MEZO_H_
