// Fused RMSNorm as one autograd node (docs/kernels.md, "RMSNorm").
//
// Thread-safety: as any ATen op; the CPU kernels run on ATen's intra-op thread pool.
#ifndef LATHE_KERNELS_OPS_RMS_NORM_H_
#define LATHE_KERNELS_OPS_RMS_NORM_H_

#include "kernels/ops/torch_compat.h"

namespace lathe::kernels {

// y = x * rsqrt(mean(x^2) + eps) * weight over x's last dimension, in x's dtype (float32,
// bfloat16 or float16) with the statistics in float32, as Hugging Face's LlamaRMSNorm (one
// rounding of y instead of its two). weight: [hidden] of any floating dtype, on x's device;
// it receives a gradient (in its own dtype) when it requires grad. Saved for backward: x
// (the caller's tensor, or a contiguous copy when x is not contiguous), the float32 rstd per
// row and weight. Not twice differentiable.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace lathe::kernels

#endif  // LATHE_KERNELS_OPS_RMS_NORM_H_
