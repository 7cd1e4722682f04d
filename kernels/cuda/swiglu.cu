#include "kernels/cuda/device_types.cuh"
#include "kernels/cuda/swiglu.h"

namespace lathe::kernels::cuda {
namespace {

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

// The gate's activations, z(a) = a * s(a), as in kernels/cpu/swiglu.cc: S gives s(a);
// GateGrad gives gu * z'(a), where gu is the incoming gradient times up.
struct Silu {
  static __device__ __forceinline__ float S(float a) { return Sigmoid(a); }
  static __device__ __forceinline__ float GateGrad(float gu, float a, float s) {
    return gu * s * (1.0f + a * (1.0f - s));
  }
};
struct GeluTanh {  // transformers' gelu_pytorch_tanh
  static __device__ __forceinline__ float S(float a) {
    return Sigmoid(2.0f * kGeluBeta * (a + kGeluKappa * a * a * a));
  }
  static __device__ __forceinline__ float GateGrad(float gu, float a, float s) {
    const float a2 = a * a;
    return gu * (s + 2.0f * a * s * (1.0f - s) * kGeluBeta * (1.0f + 3.0f * kGeluKappa * a2));
  }
};

template <typename Act, typename T>
__global__ void GluForwardKernel(const T* __restrict__ gate, const T* __restrict__ up, int64_t n,
                                 T* __restrict__ y) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += step) {
    const float a = ToFloat(gate[i]);
    y[i] = FromFloat<T>(a * Act::S(a) * ToFloat(up[i]));
  }
}

template <typename Act, typename T>
__global__ void GluBackwardKernel(const T* __restrict__ dy, const T* __restrict__ gate,
                                  const T* __restrict__ up, int64_t n, T* __restrict__ dgate,
                                  T* __restrict__ dup) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += step) {
    const float a = ToFloat(gate[i]);
    const float s = Act::S(a);
    const float g = ToFloat(dy[i]);
    dgate[i] = FromFloat<T>(Act::GateGrad(g * ToFloat(up[i]), a, s));
    dup[i] = FromFloat<T>(g * a * s);
  }
}

template <typename Act, typename T>
cudaError_t GluForward(const T* gate, const T* up, int64_t n, T* y, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  GluForwardKernel<Act>
      <<<GridFor(n), kBlockThreads, 0, stream>>>(Device(gate), Device(up), n, Device(y));
  return cudaGetLastError();
}

template <typename Act, typename T>
cudaError_t GluBackward(const T* dy, const T* gate, const T* up, int64_t n, T* dgate, T* dup,
                        cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  GluBackwardKernel<Act><<<GridFor(n), kBlockThreads, 0, stream>>>(
      Device(dy), Device(gate), Device(up), n, Device(dgate), Device(dup));
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t SwiGluForward(const T* gate, const T* up, int64_t n, T* y, cudaStream_t stream) {
  return GluForward<Silu>(gate, up, n, y, stream);
}

template <typename T>
cudaError_t SwiGluBackward(const T* dy, const T* gate, const T* up, int64_t n, T* dgate, T* dup,
                           cudaStream_t stream) {
  return GluBackward<Silu>(dy, gate, up, n, dgate, dup, stream);
}

template <typename T>
cudaError_t GeGluForward(const T* gate, const T* up, int64_t n, T* y, cudaStream_t stream) {
  return GluForward<GeluTanh>(gate, up, n, y, stream);
}

template <typename T>
cudaError_t GeGluBackward(const T* dy, const T* gate, const T* up, int64_t n, T* dgate, T* dup,
                          cudaStream_t stream) {
  return GluBackward<GeluTanh>(dy, gate, up, n, dgate, dup, stream);
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
