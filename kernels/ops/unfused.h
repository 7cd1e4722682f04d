// The unfused ATen compositions that the fused ops replace, as worker/engine/causal_lm.cc
// computes them today: the baseline of bench/fused_ops_bench.cc and the reference of the
// kernel tests (which run them in float64). Each op here records the autograd graph of its
// individual ATen ops and saves what they save.
//
// Thread-safety: as any ATen op.
#ifndef LATHE_KERNELS_OPS_UNFUSED_H_
#define LATHE_KERNELS_OPS_UNFUSED_H_

#include "kernels/ops/torch_compat.h"

namespace lathe::kernels::unfused {

// x * rsqrt(mean(x^2) + eps) with x widened to at least float32, rounded back to x's dtype,
// times weight in x's dtype.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), all in float32 (x and weight
// widened), rounded once to x's dtype. The engine's fused path is RmsNorm's kernel with the
// float32 weight 1 + weight, which computes the same.
at::Tensor GemmaRmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// x * cos + rotate_half(x) * sin.
at::Tensor Rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// silu(gate) * up.
at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up);

// gelu_tanh(gate) * up (Gemma's MLP, transformers' gelu_pytorch_tanh).
at::Tensor GeGlu(const at::Tensor& gate, const at::Tensor& up);

// Projection::Forward: x W^T + b + scale * (dropout(x) A^T) B^T, each tensor converted to x's
// dtype as it is used (a frozen W of another dtype through a node that saves only W). Dropout:
// with `dropout_mask` defined, dropout(x) = x * dropout_mask (the mask already scaled by
// 1 / (1 - p)); otherwise at::dropout(x, dropout_p) when training and dropout_p > 0.
at::Tensor LoraLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      const at::Tensor& lora_a, const at::Tensor& lora_b, double scale,
                      double dropout_p, bool training, const at::Tensor& dropout_mask = {});

}  // namespace lathe::kernels::unfused

#endif  // LATHE_KERNELS_OPS_UNFUSED_H_
