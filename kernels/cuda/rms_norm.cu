#include "kernels/cuda/device_types.cuh"
#include "kernels/cuda/rms_norm.h"

namespace lathe::kernels::cuda {
namespace {

constexpr int64_t kMaxPartialRows = 512;

template <typename T>
__global__ void RmsNormForwardKernel(const T* __restrict__ x, const float* __restrict__ weight,
                                     int64_t hidden, float eps, T* __restrict__ y,
                                     float* __restrict__ rstd) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* in = x + row * hidden;
  T* out = y + row * hidden;
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
    const float v = ToFloat(in[j]);
    sum += v * v;
  }
  sum = BlockSum(sum, scratch);
  const float s = 1.0f / sqrtf(sum / static_cast<float>(hidden) + eps);
  for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
    out[j] = FromFloat<T>(ToFloat(in[j]) * s * weight[j]);
  }
  if (threadIdx.x == 0) rstd[row] = s;
}

template <typename T>
__global__ void RmsNormBackwardKernel(const T* __restrict__ dy, const T* __restrict__ x,
                                      const float* __restrict__ weight,
                                      const float* __restrict__ rstd, int64_t rows, int64_t hidden,
                                      T* __restrict__ dx, float* __restrict__ dweight_partial) {
  __shared__ float scratch[32];
  float* dw = dweight_partial == nullptr ? nullptr : dweight_partial + blockIdx.x * hidden;
  if (dw != nullptr) {
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) dw[j] = 0.0f;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* g = dy + row * hidden;
    const T* in = x + row * hidden;
    T* out = dx + row * hidden;
    const float s = rstd[row];
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
      dot += ToFloat(g[j]) * weight[j] * ToFloat(in[j]);
    }
    dot = BlockSum(dot, scratch);
    const float c = s * s * s * dot / static_cast<float>(hidden);
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
      const float gj = ToFloat(g[j]);
      const float xj = ToFloat(in[j]);
      out[j] = FromFloat<T>(s * gj * weight[j] - c * xj);
      // Each thread owns columns j of its block's partial row: no race.
      if (dw != nullptr) dw[j] += gj * xj * s;
    }
  }
}

}  // namespace

int64_t RmsNormBackwardPartialRows(int64_t rows) {
  return rows < kMaxPartialRows ? rows : kMaxPartialRows;
}

template <typename T>
cudaError_t RmsNormForward(const T* x, const float* weight, int64_t rows, int64_t hidden, float eps,
                           T* y, float* rstd, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  RmsNormForwardKernel<<<static_cast<unsigned>(rows), kBlockThreads, 0, stream>>>(
      Device(x), weight, hidden, eps, Device(y), rstd);
  return cudaGetLastError();
}

template <typename T>
cudaError_t RmsNormBackward(const T* dy, const T* x, const float* weight, const float* rstd,
                            int64_t rows, int64_t hidden, T* dx, float* dweight_partial,
                            cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>(RmsNormBackwardPartialRows(rows));
  RmsNormBackwardKernel<<<blocks, kBlockThreads, 0, stream>>>(
      Device(dy), Device(x), weight, rstd, rows, hidden, Device(dx), dweight_partial);
  return cudaGetLastError();
}

#define LATHE_INSTANTIATE(T)                                                                       \
  template cudaError_t RmsNormForward<T>(const T*, const float*, int64_t, int64_t, float, T*,      \
                                         float*, cudaStream_t);                                    \
  template cudaError_t RmsNormBackward<T>(const T*, const T*, const float*, const float*, int64_t, \
                                          int64_t, T*, float*, cudaStream_t);
LATHE_INSTANTIATE(float)
LATHE_INSTANTIATE(BFloat16)
LATHE_INSTANTIATE(Half)
#undef LATHE_INSTANTIATE

}  // namespace lathe::kernels::cuda
