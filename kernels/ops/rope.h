// Fused rotary position embedding as one autograd node (docs/kernels.md, "RoPE").
//
// Thread-safety: as any ATen op; the CPU kernels run on ATen's intra-op thread pool.
#ifndef LATHE_KERNELS_OPS_ROPE_H_
#define LATHE_KERNELS_OPS_ROPE_H_

#include <utility>

#include "kernels/ops/torch_compat.h"

namespace lathe::kernels {

// x * cos + rotate_half(x) * sin for x: [batch, heads, seq, head_dim] (float32, bfloat16 or
// float16; head_dim even) and tables cos, sin: [seq, head_dim] (converted to x's dtype, as
// the unfused x * cos does). x may be any dense view whose last dimension is contiguous: in
// particular the projection output viewed as [batch, seq, heads, head_dim] and transposed to
// [batch, heads, seq, head_dim], which is read in place (other layouts are copied first). The
// result is a new tensor with x's strides. Saved for backward: the two tables only (the
// backward is the transposed rotation of the gradient). Not twice differentiable; cos and sin
// receive no gradient.
at::Tensor Rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// {Rope(q, cos, sin), Rope(k, cos, sin)}.
std::pair<at::Tensor, at::Tensor> ApplyRope(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& cos, const at::Tensor& sin);

}  // namespace lathe::kernels

#endif  // LATHE_KERNELS_OPS_ROPE_H_
