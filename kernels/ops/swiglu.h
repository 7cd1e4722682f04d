// Fused SwiGLU and GeGLU as one autograd node each (docs/kernels.md, "SwiGLU").
//
// Thread-safety: as any ATen op; the CPU kernels run on ATen's intra-op thread pool.
#ifndef LATHE_KERNELS_OPS_SWIGLU_H_
#define LATHE_KERNELS_OPS_SWIGLU_H_

#include "kernels/ops/torch_compat.h"

namespace lathe::kernels {

// silu(gate) * up, elementwise, for gate and up of one shape and dtype (float32, bfloat16 or
// float16), computed in float32 with one rounding. Saved for backward: gate and up only (the
// caller's tensors, or contiguous copies of non-contiguous ones); backward recomputes the
// sigmoid. Not twice differentiable.
at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up);

// gelu_tanh(gate) * up (Gemma's MLP, transformers' gelu_pytorch_tanh), as SwiGlu: float32
// arithmetic, one rounding, gate and up saved, the activation recomputed in backward.
at::Tensor GeGlu(const at::Tensor& gate, const at::Tensor& up);

}  // namespace lathe::kernels

#endif  // LATHE_KERNELS_OPS_SWIGLU_H_
