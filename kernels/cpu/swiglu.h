// SwiGLU, forward and backward (docs/kernels.md, "SwiGLU"):
//   y = silu(gate) * up = gate * sigmoid(gate) * up
//   dgate = dy * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate))),  dup = dy * silu(gate)
// elementwise in float32, one rounding per output to the element type T (float, BFloat16,
// Half). Backward recomputes the sigmoid from gate, so the forward saves nothing else.
//
// GeGLU (Gemma's MLP, transformers' gelu_pytorch_tanh), the same way:
//   y = gelu_tanh(gate) * up,  gelu_tanh(a) = 0.5 a (1 + tanh(u)) = a * s,
//   u = sqrt(2 / pi) (a + 0.044715 a^3),  s = sigmoid(2 u)
//   dgate = dy * up * (s + 2 a s (1 - s) sqrt(2 / pi) (1 + 3 * 0.044715 a^2)),
//   dup = dy * gelu_tanh(gate)
// (1 + tanh(u) = 2 sigmoid(2 u) and 1 - tanh(u)^2 = 4 s (1 - s): the sigmoid SwiGLU uses,
// without tanh's cancellation near zero).
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

template <typename T>
void GeGluForward(const T* gate, const T* up, int64_t cols, int64_t begin, int64_t end, T* y);

template <typename T>
void GeGluBackward(const T* dy, const T* gate, const T* up, int64_t cols, int64_t begin,
                   int64_t end, T* dgate, T* dup);

}  // namespace lathe::kernels::cpu

#endif  // LATHE_KERNELS_CPU_SWIGLU_H_
