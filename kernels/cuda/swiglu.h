// SwiGLU and GeGLU on CUDA: the same arithmetic as kernels/cpu/swiglu.h over n contiguous elements,
// launched on `stream` (the sigmoid uses CUDA's expf, the CPU kernel its own exp: results
// agree to a few ulp).
//
// Raw-pointer kernels without libtorch; T is float, BFloat16 or Half (kernels/float16.h).
// Each function returns the launch's error (cudaGetLastError()), cudaSuccess for n == 0.
// Thread-safety: stateless; calls on different streams may run concurrently.
#ifndef LATHE_KERNELS_CUDA_SWIGLU_H_
#define LATHE_KERNELS_CUDA_SWIGLU_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/float16.h"

namespace lathe::kernels::cuda {

template <typename T>
cudaError_t SwiGluForward(const T* gate, const T* up, int64_t n, T* y, cudaStream_t stream);

template <typename T>
cudaError_t SwiGluBackward(const T* dy, const T* gate, const T* up, int64_t n, T* dgate, T* dup,
                           cudaStream_t stream);

// GeGLU (kernels/cpu/swiglu.h's formulas).
template <typename T>
cudaError_t GeGluForward(const T* gate, const T* up, int64_t n, T* y, cudaStream_t stream);

template <typename T>
cudaError_t GeGluBackward(const T* dy, const T* gate, const T* up, int64_t n, T* dgate, T* dup,
                          cudaStream_t stream);

}  // namespace lathe::kernels::cuda

#endif  // LATHE_KERNELS_CUDA_SWIGLU_H_
