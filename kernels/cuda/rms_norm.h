// RMSNorm on CUDA: the same arithmetic as kernels/cpu/rms_norm.h (statistics in float32, one
// rounding of each output), over whole [rows, hidden] row-major device buffers, launched on
// `stream`. One block per row in forward; in backward each block takes every
// gridDim-th row and accumulates its own row of dweight partial sums, which the caller
// reduces (ops/ with at::sum).
//
// Raw-pointer kernels without libtorch; T is float, BFloat16 or Half (kernels/float16.h).
// Each function returns the launch's error (cudaGetLastError()), cudaSuccess for rows == 0.
// Thread-safety: stateless; calls on different streams may run concurrently.
#ifndef LATHE_KERNELS_CUDA_RMS_NORM_H_
#define LATHE_KERNELS_CUDA_RMS_NORM_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/float16.h"

namespace lathe::kernels::cuda {

// Writes y [rows, hidden] and rstd [rows]. REQUIRES: hidden >= 1.
template <typename T>
cudaError_t RmsNormForward(const T* x, const float* weight, int64_t rows, int64_t hidden, float eps,
                           T* y, float* rstd, cudaStream_t stream);

// The number of rows of the dweight_partial buffer RmsNormBackward writes for `rows` rows.
int64_t RmsNormBackwardPartialRows(int64_t rows);

// Writes dx [rows, hidden] and, when dweight_partial is not null, dweight_partial
// [RmsNormBackwardPartialRows(rows), hidden], whose column sums are dweight.
template <typename T>
cudaError_t RmsNormBackward(const T* dy, const T* x, const float* weight, const float* rstd,
                            int64_t rows, int64_t hidden, T* dx, float* dweight_partial,
                            cudaStream_t stream);

}  // namespace lathe::kernels::cuda

#endif  // LATHE_KERNELS_CUDA_RMS_NORM_H_
