// SwiGLU, forward and backward (docs/kernels.md, "SwiGLU"):
//   y = silu(gate) * up = gate * sigmoid(gate) * up
//   dgate = dy * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate))),  dup = dy * silu(gate)
// elementwise in float32, one rounding per output to the element type T (float, BFloat16,
// Half). Backward recomputes the sigmoid from gate, so the forward saves nothing else.
//
// Raw-pointer kernels without libtorch. Each call processes rows [begin, end) of row-major
// [rows, cols] buffers on the calling thread; ops/ splits the rows across threads.
// Thread-safety: calls on disjoint row ranges may run concurrently. Outputs must not alias
// inputs.
#ifndef LATHE_KERNELS_CPU_SWIGLU_H_
#define LATHE_KERNELS_CPU_SWIGLU_H_

#include <cstdint>

#include "kernels/float16.h"

namespace lathe::kernels::cpu {

// REQUIRES: 0 <= begin <= end <= rows.
template <typename T>
void SwiGluForward(const T* gate, const T* up, int64_t cols, int64_t begin, int64_t end, T* y);

template <typename T>
void SwiGluBackward(const T* dy, const T* gate, const T* up, int64_t cols, int64_t begin,
                    int64_t end, T* dgate, T* dup);

}  // namespace lathe::kernels::cpu

#endif  // LATHE_KERNELS_CPU_SWIGLU_H_
