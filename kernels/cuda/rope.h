// RoPE on CUDA: the same arithmetic as kernels/cpu/rope.h over the whole tensor described by
// `layout` (kernels/rope_layout.h), launched on `stream`; one thread per pair (i, i + h) of a
// row. The output has the input's strides and must not alias it.
//
// Raw-pointer kernels without libtorch; T is float, BFloat16 or Half (kernels/float16.h).
// Each function returns the launch's error (cudaGetLastError()), cudaSuccess when empty.
// Thread-safety: stateless; calls on different streams may run concurrently.
#ifndef LATHE_KERNELS_CUDA_ROPE_H_
#define LATHE_KERNELS_CUDA_ROPE_H_

#include <cuda_runtime_api.h>

#include "kernels/float16.h"
#include "kernels/rope_layout.h"

namespace lathe::kernels::cuda {

// y = RoPE(x). cos, sin: [seq, head_dim] row-major device buffers of x's type.
template <typename T>
cudaError_t RopeForward(const T* x, const T* cos, const T* sin, const RopeLayout& layout, T* y,
                        cudaStream_t stream);

// dx = RoPE^T(dy).
template <typename T>
cudaError_t RopeBackward(const T* dy, const T* cos, const T* sin, const RopeLayout& layout, T* dx,
                         cudaStream_t stream);

}  // namespace lathe::kernels::cuda

#endif  // LATHE_KERNELS_CUDA_ROPE_H_
