// Dropout with a counter-based mask (kernels/dropout_mask.h): the mask is a function of a
// 64-bit seed and the element's (row, column) in the [rows, last dim] view of the tensor, so
// forward, backward and recomputations regenerate it instead of storing it. Used by
// LoraLinear; public for tests and for callers that need the mask itself.
//
// Thread-safety: as any ATen op; DrawDropoutSeed takes the generator's lock.
#ifndef LATHE_KERNELS_OPS_DROPOUT_H_
#define LATHE_KERNELS_OPS_DROPOUT_H_

#include <cstdint>

#include "kernels/ops/torch_compat.h"

namespace lathe::kernels {

// A new tensor: x / (1 - p) where the mask of `seed` keeps an element, else 0. x: float32,
// bfloat16 or float16 on the CPU (or CUDA with a CUDA libtorch). Not differentiable (the
// gradient of this op is the op applied to the gradient with the same seed).
// REQUIRES: 0 <= p < 1.
at::Tensor ApplyDropoutMask(const at::Tensor& x, double p, uint64_t seed);

// A fresh seed: the next 64-bit number of `generator` (a CPU generator; libtorch's default CPU
// generator when absent), whatever device the tensors live on, so that restoring the CPU
// generator's state (as activation checkpointing does) reproduces the masks.
uint64_t DrawDropoutSeed(std::optional<at::Generator> generator = std::nullopt);

}  // namespace lathe::kernels

#endif  // LATHE_KERNELS_OPS_DROPOUT_H_
