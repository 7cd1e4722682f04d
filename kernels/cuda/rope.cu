#include "kernels/cuda/device_types.cuh"
#include "kernels/cuda/rope.h"

namespace lathe::kernels::cuda {
namespace {

template <typename T>
__global__ void RopeKernel(const T* __restrict__ x, const T* __restrict__ cos,
                           const T* __restrict__ sin, RopeLayout layout, bool transpose,
                           T* __restrict__ y) {
  const int64_t half = layout.head_dim / 2;
  const int64_t total = layout.rows() * half;
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < total;
       index += step) {
    const int64_t row = index / half;
    const int64_t i = index % half;
    const int64_t lo = layout.Offset(row) + i;
    const int64_t table = layout.Position(row) * layout.head_dim + i;
    const float a = ToFloat(x[lo]);
    const float b = ToFloat(x[lo + half]);
    const float c_lo = ToFloat(cos[table]);
    const float c_hi = ToFloat(cos[table + half]);
    const float s_lo = ToFloat(sin[table]);
    const float s_hi = ToFloat(sin[table + half]);
    if (!transpose) {
      y[lo] = FromFloat<T>(a * c_lo - b * s_lo);
      y[lo + half] = FromFloat<T>(b * c_hi + a * s_hi);
    } else {
      y[lo] = FromFloat<T>(a * c_lo + b * s_hi);
      y[lo + half] = FromFloat<T>(b * c_hi - a * s_lo);
    }
  }
}

template <typename T>
cudaError_t LaunchRope(const T* x, const T* cos, const T* sin, const RopeLayout& layout,
                       bool transpose, T* y, cudaStream_t stream) {
  const int64_t total = layout.rows() * (layout.head_dim / 2);
  if (total == 0) return cudaSuccess;
  RopeKernel<<<GridFor(total), kBlockThreads, 0, stream>>>(Device(x), Device(cos), Device(sin),
                                                           layout, transpose, Device(y));
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t RopeForward(const T* x, const T* cos, const T* sin, const RopeLayout& layout, T* y,
                        cudaStream_t stream) {
  return LaunchRope(x, cos, sin, layout, /*transpose=*/false, y, stream);
}

template <typename T>
cudaError_t RopeBackward(const T* dy, const T* cos, const T* sin, const RopeLayout& layout, T* dx,
                         cudaStream_t stream) {
  return LaunchRope(dy, cos, sin, layout, /*transpose=*/true, dx, stream);
}

#define LATHE_INSTANTIATE(T)                                                                \
  template cudaError_t RopeForward<T>(const T*, const T*, const T*, const RopeLayout&, T*,  \
                                      cudaStream_t);                                        \
  template cudaError_t RopeBackward<T>(const T*, const T*, const T*, const RopeLayout&, T*, \
                                       cudaStream_t);
LATHE_INSTANTIATE(float)
LATHE_INSTANTIATE(BFloat16)
LATHE_INSTANTIATE(Half)
#undef LATHE_INSTANTIATE

}  // namespace lathe::kernels::cuda
