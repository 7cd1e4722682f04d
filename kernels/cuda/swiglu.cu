#include "kernels/cuda/device_types.cuh"
#include "kernels/cuda/swiglu.h"

namespace lathe::kernels::cuda {
namespace {

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T>
__global__ void SwiGluForwardKernel(const T* __restrict__ gate, const T* __restrict__ up, int64_t n,
                                    T* __restrict__ y) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += step) {
    const float a = ToFloat(gate[i]);
    y[i] = FromFloat<T>(a * Sigmoid(a) * ToFloat(up[i]));
  }
}

template <typename T>
__global__ void SwiGluBackwardKernel(const T* __restrict__ dy, const T* __restrict__ gate,
                                     const T* __restrict__ up, int64_t n, T* __restrict__ dgate,
                                     T* __restrict__ dup) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += step) {
    const float a = ToFloat(gate[i]);
    const float s = Sigmoid(a);
    const float g = ToFloat(dy[i]);
    dgate[i] = FromFloat<T>(g * ToFloat(up[i]) * s * (1.0f + a * (1.0f - s)));
    dup[i] = FromFloat<T>(g * a * s);
  }
}

constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

template <typename T>
__global__ void GeGluForwardKernel(const T* __restrict__ gate, const T* __restrict__ up, int64_t n,
                                   T* __restrict__ y) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += step) {
    const float a = ToFloat(gate[i]);
    const float s = Sigmoid(2.0f * kGeluBeta * (a + kGeluKappa * a * a * a));
    y[i] = FromFloat<T>(a * s * ToFloat(up[i]));
  }
}

template <typename T>
__global__ void GeGluBackwardKernel(const T* __restrict__ dy, const T* __restrict__ gate,
                                    const T* __restrict__ up, int64_t n, T* __restrict__ dgate,
                                    T* __restrict__ dup) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += step) {
    const float a = ToFloat(gate[i]);
    const float a2 = a * a;
    const float s = Sigmoid(2.0f * kGeluBeta * (a + kGeluKappa * a2 * a));
    const float slope = s + 2.0f * a * s * (1.0f - s) * kGeluBeta * (1.0f + 3.0f * kGeluKappa * a2);
    const float g = ToFloat(dy[i]);
    dgate[i] = FromFloat<T>(g * ToFloat(up[i]) * slope);
    dup[i] = FromFloat<T>(g * a * s);
  }
}

}  // namespace

template <typename T>
cudaError_t GeGluForward(const T* gate, const T* up, int64_t n, T* y, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  GeGluForwardKernel<<<GridFor(n), kBlockThreads, 0, stream>>>(Device(gate), Device(up), n,
                                                               Device(y));
  return cudaGetLastError();
}

template <typename T>
cudaError_t GeGluBackward(const T* dy, const T* gate, const T* up, int64_t n, T* dgate, T* dup,
                          cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  GeGluBackwardKernel<<<GridFor(n), kBlockThreads, 0, stream>>>(
      Device(dy), Device(gate), Device(up), n, Device(dgate), Device(dup));
  return cudaGetLastError();
}

template <typename T>
cudaError_t SwiGluForward(const T* gate, const T* up, int64_t n, T* y, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  SwiGluForwardKernel<<<GridFor(n), kBlockThreads, 0, stream>>>(Device(gate), Device(up), n,
                                                                Device(y));
  return cudaGetLastError();
}

template <typename T>
cudaError_t SwiGluBackward(const T* dy, const T* gate, const T* up, int64_t n, T* dgate, T* dup,
                           cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  SwiGluBackwardKernel<<<GridFor(n), kBlockThreads, 0, stream>>>(
      Device(dy), Device(gate), Device(up), n, Device(dgate), Device(dup));
  return cudaGetLastError();
}

#define LATHE_INSTANTIATE(T)                                                            \
  template cudaError_t SwiGluForward<T>(const T*, const T*, int64_t, T*, cudaStream_t); \
  template cudaError_t SwiGluBackward<T>(const T*, const T*, const T*, int64_t, T*, T*, \
                                         cudaStream_t);                                 \
  template cudaError_t GeGluForward<T>(const T*, const T*, int64_t, T*, cudaStream_t);  \
  template cudaError_t GeGluBackward<T>(const T*, const T*, const T*, int64_t, T*, T*,  \
                                        cudaStream_t);
LATHE_INSTANTIATE(float)
LATHE_INSTANTIATE(BFloat16)
LATHE_INSTANTIATE(Half)
#undef LATHE_INSTANTIATE

}  // namespace lathe::kernels::cuda
