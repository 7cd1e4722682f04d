// A linear projection with an optional LoRA adapter as one autograd node
// (docs/kernels.md, "LoRA linear"; docs/training.md, "LoRA" and "Precision").
//
// Thread-safety: as any ATen op. LoraLinear draws from its generator under the generator's
// lock.
#ifndef LATHE_KERNELS_OPS_LORA_LINEAR_H_
#define LATHE_KERNELS_OPS_LORA_LINEAR_H_

#include <cstdint>

#include "kernels/ops/torch_compat.h"

namespace lathe::kernels {

// y = x W^T (+ b) + scale * dropout(x) A^T B^T, in x's dtype.
//   x: [..., in]; weight W: [out, in]; bias b: [out] or undefined; lora_a A: [r, in] and
//   lora_b B: [out, r], both defined or both undefined (then y = x W^T + b).
// Tensors of another dtype than x (a frozen bfloat16/float16 W with float32 x, float32 LoRA
// masters with bfloat16 x) are converted as they are used, in forward and again in backward;
// no converted copy is kept. The products run in x's dtype, except for bfloat16/float16 x on
// the CPU, where they run in float32 (libtorch's CPU bfloat16 product accumulates in
// bfloat16) and y is rounded once. A frozen bfloat16 W with float32 x (a bf16 LoRA job) on a
// CPU that multiplies bfloat16 natively (AVX512-BF16 or AMX, unless LATHE_CPU_BF16=0) is not
// widened: each product large enough for the kernel (NativeBFloat16Product) runs bfloat16 x
// bfloat16 with float32 accumulation, its operands rounded to bfloat16 as CUDA autocast
// rounds them: x W^T and dy W, and the adapter's x A^T, (x A^T) B^T and their gradients
// (with s dy, the gradient autograd would hand the scaled product). A and B stay float32
// masters, their gradients float32.
// Gradients: x, A, B, and W and b when they require grad (full fine-tuning), each in its own
// dtype.
//
// Dropout (only when training && dropout_p > 0 && LoRA): the mask of kernels/dropout_mask.h
// with a seed drawn from `generator` (DrawDropoutSeed: libtorch's default CPU generator when
// absent, also for CUDA tensors). Saved for backward: x (the caller's storage when x is
// contiguous) when a gradient reads it (W or A trains), or instead its bfloat16 rounding when
// only the native bf16 x A^T gradient does (no dropout); W, A, B and the rank-r product
// dropout(x) A^T [tokens, r] (in the product dtype), plus the seed: neither the mask nor
// dropout(x) is stored, backward regenerates them. Not twice differentiable.
// REQUIRES: 0 <= dropout_p < 1.
at::Tensor LoraLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      const at::Tensor& lora_a, const at::Tensor& lora_b, double scale,
                      double dropout_p, bool training,
                      std::optional<at::Generator> generator = std::nullopt);

// The same with the dropout seed given: dropout with probability dropout_p (0: none) and the
// mask of `seed`, as ApplyDropoutMask(x, dropout_p, seed) draws it.
at::Tensor LoraLinearWithSeed(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                              const at::Tensor& lora_a, const at::Tensor& lora_b, double scale,
                              double dropout_p, uint64_t seed);

}  // namespace lathe::kernels

#endif  // LATHE_KERNELS_OPS_LORA_LINEAR_H_
