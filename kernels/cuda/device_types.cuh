// Device-side helpers shared by the CUDA kernels (.cu files only): the CUDA type of each
// element type of kernels/float16.h, conversions to and from float, a block-wide sum, and the
// launch shape of grid-stride loops.
#ifndef LATHE_KERNELS_CUDA_DEVICE_TYPES_CUH_
#define LATHE_KERNELS_CUDA_DEVICE_TYPES_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/float16.h"

namespace lathe::kernels::cuda {

template <typename T>
struct DeviceTypeOf {
  using type = T;
};
template <>
struct DeviceTypeOf<BFloat16> {
  using type = __nv_bfloat16;
};
template <>
struct DeviceTypeOf<Half> {
  using type = __half;
};
template <typename T>
using DeviceType = typename DeviceTypeOf<T>::type;

// The device view of a host-typed pointer (same layout, see kernels/float16.h).
template <typename T>
const DeviceType<T>* Device(const T* p) {
  return reinterpret_cast<const DeviceType<T>*>(p);
}
template <typename T>
DeviceType<T>* Device(T* p) {
  return reinterpret_cast<DeviceType<T>*>(p);
}

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}

// Threads per block of every kernel here; a multiple of the warp size.
inline constexpr int kBlockThreads = 256;

// The sum of `v` over the block, returned to every thread. `scratch` holds 32 floats of
// shared memory; every thread of the block must call this (it synchronises).
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? scratch[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  v = scratch[0];
  __syncthreads();  // scratch may be reused by the next call
  return v;
}

// Blocks for a grid-stride loop over n items, one item per thread per step.
inline unsigned GridFor(int64_t n) {
  const int64_t blocks = (n + kBlockThreads - 1) / kBlockThreads;
  return static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(blocks, 1), 65536));
}

}  // namespace lathe::kernels::cuda

#endif  // LATHE_KERNELS_CUDA_DEVICE_TYPES_CUH_
