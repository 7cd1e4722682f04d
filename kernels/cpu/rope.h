// Rotary position embedding, half-rotation convention (Hugging Face's rotate_half), forward
// and backward (docs/kernels.md, "RoPE"). For a vector x of head_dim = 2h elements at
// position s, with tables c = cos[s, :] and n = sin[s, :] ([seq, head_dim], as CausalLm
// builds them):
//   y[i]     = x[i]     * c[i]     - x[i + h] * n[i]        (i < h)
//   y[i + h] = x[i + h] * c[i + h] + x[i]     * n[i + h]
// Backward applies the transposed map (the inverse rotation when the two halves of the
// tables agree, as they do for RoPE):
//   dx[i]     = dy[i]     * c[i]     + dy[i + h] * n[i + h]
//   dx[i + h] = dy[i + h] * c[i + h] - dy[i]     * n[i]
//
// Raw-pointer kernels without libtorch, on the layout of kernels/rope_layout.h. Each call
// processes rows [begin, end) on the calling thread; ops/ splits the rows across threads.
// The output has the input's strides.
// Thread-safety: calls on disjoint row ranges may run concurrently. The output must not
// alias the input.
#ifndef LATHE_KERNELS_CPU_ROPE_H_
#define LATHE_KERNELS_CPU_ROPE_H_

#include <cstdint>

#include "kernels/float16.h"
#include "kernels/rope_layout.h"

namespace lathe::kernels::cpu {

// y = RoPE(x) for rows [begin, end). cos, sin: [seq, head_dim] row-major, of x's type.
// REQUIRES: layout.head_dim even and >= 2; 0 <= begin <= end <= layout.rows().
template <typename T>
void RopeForward(const T* x, const T* cos, const T* sin, const RopeLayout& layout, int64_t begin,
                 int64_t end, T* y);

// dx = RoPE^T(dy) for rows [begin, end), dy and dx with `layout`'s strides.
template <typename T>
void RopeBackward(const T* dy, const T* cos, const T* sin, const RopeLayout& layout, int64_t begin,
                  int64_t end, T* dx);

}  // namespace lathe::kernels::cpu

#endif  // LATHE_KERNELS_CPU_ROPE_H_
