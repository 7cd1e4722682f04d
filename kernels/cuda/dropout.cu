#include "kernels/cuda/device_types.cuh"
#include "kernels/cuda/dropout.h"
#include "kernels/dropout_mask.h"

namespace lathe::kernels::cuda {
namespace {

template <typename T>
__global__ void DropoutKernel(const T* x, uint64_t seed, uint32_t threshold, float scale,
                              int64_t rows, int64_t cols, T* y) {
  const int64_t n = rows * cols;
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += step) {
    const int64_t row = i / cols;
    const bool keep = DropoutKeep(DropoutRowKey(seed, row), i - row * cols, threshold);
    y[i] = FromFloat<T>(keep ? ToFloat(x[i]) * scale : 0.0f);
  }
}

}  // namespace

template <typename T>
cudaError_t Dropout(const T* x, uint64_t seed, double p, int64_t rows, int64_t cols, T* y,
                    cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return cudaSuccess;
  DropoutKernel<<<GridFor(n), kBlockThreads, 0, stream>>>(Device(x), seed, DropoutThreshold(p),
                                                          static_cast<float>(1.0 / (1.0 - p)), rows,
                                                          cols, Device(y));
  return cudaGetLastError();
}

template cudaError_t Dropout<float>(const float*, uint64_t, double, int64_t, int64_t, float*,
                                    cudaStream_t);
template cudaError_t Dropout<BFloat16>(const BFloat16*, uint64_t, double, int64_t, int64_t,
                                       BFloat16*, cudaStream_t);
template cudaError_t Dropout<Half>(const Half*, uint64_t, double, int64_t, int64_t, Half*,
                                   cudaStream_t);

}  // namespace lathe::kernels::cuda
