// Dropout on CUDA with the counter-based mask of kernels/dropout_mask.h: bit-for-bit the mask
// of kernels/cpu/dropout.h for the same seed, over a whole [rows, cols] row-major device
// buffer, launched on `stream`.
//
// Raw-pointer kernel without libtorch; T is float, BFloat16 or Half (kernels/float16.h).
// Returns the launch's error (cudaGetLastError()), cudaSuccess when empty.
// Thread-safety: stateless; calls on different streams may run concurrently.
#ifndef LATHE_KERNELS_CUDA_DROPOUT_H_
#define LATHE_KERNELS_CUDA_DROPOUT_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/float16.h"

namespace lathe::kernels::cuda {

// y[r, c] = x[r, c] / (1 - p) where the mask of `seed` keeps (r, c), else 0. y may be x.
// REQUIRES: 0 <= p < 1.
template <typename T>
cudaError_t Dropout(const T* x, uint64_t seed, double p, int64_t rows, int64_t cols, T* y,
                    cudaStream_t stream);

}  // namespace lathe::kernels::cuda

#endif  // LATHE_KERNELS_CUDA_DROPOUT_H_
