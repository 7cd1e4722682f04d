#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/linear_cross_entropy_kernels.h"

namespace lathe::kernels::cuda::internal {
namespace {

constexpr int kRowThreads = 256;  // threads per tile row
constexpr int kFinishThreads = 1024;
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
__device__ T WarpSum(T value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value += __shfl_xor_sync(kFullMask, value, offset);
  }
  return value;
}

__device__ float WarpMax(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = fmaxf(value, __shfl_xor_sync(kFullMask, value, offset));
  }
  return value;
}

// The sum (or maximum) of `value` over the block, returned to every thread. `shared` holds
// one T per warp. REQUIRES: blockDim.x is a multiple of 32; every thread of the block calls.
template <typename T>
__device__ T BlockSum(T value, T* shared) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  value = WarpSum(value);
  __syncthreads();  // `shared` may still be read by a previous reduction
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  value = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : T(0);
  return WarpSum(value);
}

__device__ float BlockMax(float value, float* shared) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  value = WarpMax(value);
  __syncthreads();
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  value = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : -INFINITY;
  return WarpMax(value);
}

// One block per tile row.
__global__ void ChunkLogSumExpKernel(float* tile, int64_t tv, int64_t n0, int64_t v0,
                                     const int64_t* targets, int64_t ignore_index, float softcap,
                                     bool first, float* row_max, float* row_sum,
                                     float* row_target) {
  __shared__ float shared[32];
  const int64_t r = blockIdx.x;
  const int64_t i = n0 + r;
  const int64_t target = targets[i];
  if (target == ignore_index) return;  // the whole block returns
  float* row = tile + r * tv;
  float chunk_max = -INFINITY;
  for (int64_t j = threadIdx.x; j < tv; j += blockDim.x) {
    float z = row[j];
    if (softcap > 0.0f) {
      z = softcap * tanhf(z / softcap);
      row[j] = z;
    }
    chunk_max = fmaxf(chunk_max, z);
  }
  chunk_max = BlockMax(chunk_max, shared);
  float chunk_sum = 0.0f;
  for (int64_t j = threadIdx.x; j < tv; j += blockDim.x) chunk_sum += expf(row[j] - chunk_max);
  chunk_sum = BlockSum(chunk_sum, shared);  // its barriers also publish the capped row
  if (threadIdx.x == 0) {
    if (first) {
      row_max[i] = chunk_max;
      row_sum[i] = chunk_sum;
      row_target[i] = 0.0f;
    } else {
      const float old_max = row_max[i];
      const float new_max = fmaxf(old_max, chunk_max);
      row_sum[i] = row_sum[i] * expf(old_max - new_max) + chunk_sum * expf(chunk_max - new_max);
      row_max[i] = new_max;
    }
    if (target >= v0 && target < v0 + tv) row_target[i] = row[target - v0];
  }
}

// One block.
__global__ void FinishForwardKernel(int64_t n, const int64_t* targets, int64_t ignore_index,
                                    float z_loss_weight, const float* row_max, const float* row_sum,
                                    const float* row_target, float* lse, float* loss) {
  __shared__ double shared[32];
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (targets[i] == ignore_index) {
      lse[i] = 0.0f;
      continue;
    }
    const double row_lse = static_cast<double>(row_max[i]) + log(static_cast<double>(row_sum[i]));
    lse[i] = static_cast<float>(row_lse);
    sum += row_lse - row_target[i] + z_loss_weight * row_lse * row_lse;
  }
  sum = BlockSum(sum, shared);
  if (threadIdx.x == 0) *loss = static_cast<float>(sum);
}

// One block per tile row.
__global__ void ChunkGradientKernel(float* tile, uint16_t* tile_bf16, int64_t tv, int64_t n0,
                                    int64_t v0, const int64_t* targets, int64_t ignore_index,
                                    const float* lse, const float* grad_scale, float z_loss_weight,
                                    float softcap) {
  const int64_t r = blockIdx.x;
  const int64_t i = n0 + r;
  const int64_t target = targets[i];
  float* row = tile + r * tv;
  uint16_t* row_bf16 = tile_bf16 == nullptr ? nullptr : tile_bf16 + r * tv;
  const bool ignored = target == ignore_index;
  const float row_lse = ignored ? 0.0f : lse[i];
  const float scale = *grad_scale;
  const float factor = scale * (1.0f + 2.0f * z_loss_weight * row_lse);
  for (int64_t j = threadIdx.x; j < tv; j += blockDim.x) {
    float gradient = 0.0f;
    if (!ignored) {
      float z = row[j];
      float slope = 1.0f;  // dz/dlogit
      if (softcap > 0.0f) {
        const float t = tanhf(z / softcap);
        z = softcap * t;
        slope = 1.0f - t * t;
      }
      gradient = factor * expf(z - row_lse) * slope;
      if (v0 + j == target) gradient -= scale * slope;
    }
    if (row_bf16 != nullptr) {
      row_bf16[j] = __bfloat16_as_ushort(__float2bfloat16_rn(gradient));
    } else {
      row[j] = gradient;
    }
  }
}

__global__ void FloatToBFloat16Kernel(const float* src, uint16_t* dst, int64_t count) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < count;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[k] = __bfloat16_as_ushort(__float2bfloat16_rn(src[k]));
  }
}

}  // namespace

cudaError_t LaunchChunkLogSumExp(float* tile, int64_t tn, int64_t tv, int64_t n0, int64_t v0,
                                 const int64_t* targets, int64_t ignore_index, float softcap,
                                 bool first, float* row_max, float* row_sum, float* row_target,
                                 cudaStream_t stream) {
  ChunkLogSumExpKernel<<<static_cast<unsigned>(tn), kRowThreads, 0, stream>>>(
      tile, tv, n0, v0, targets, ignore_index, softcap, first, row_max, row_sum, row_target);
  return cudaGetLastError();
}

cudaError_t LaunchFinishForward(int64_t n, const int64_t* targets, int64_t ignore_index,
                                float z_loss_weight, const float* row_max, const float* row_sum,
                                const float* row_target, float* lse, float* loss,
                                cudaStream_t stream) {
  FinishForwardKernel<<<1, kFinishThreads, 0, stream>>>(n, targets, ignore_index, z_loss_weight,
                                                        row_max, row_sum, row_target, lse, loss);
  return cudaGetLastError();
}

cudaError_t LaunchChunkGradient(float* tile, uint16_t* tile_bf16, int64_t tn, int64_t tv,
                                int64_t n0, int64_t v0, const int64_t* targets,
                                int64_t ignore_index, const float* lse, const float* grad_scale,
                                float z_loss_weight, float softcap, cudaStream_t stream) {
  ChunkGradientKernel<<<static_cast<unsigned>(tn), kRowThreads, 0, stream>>>(
      tile, tile_bf16, tv, n0, v0, targets, ignore_index, lse, grad_scale, z_loss_weight, softcap);
  return cudaGetLastError();
}

cudaError_t LaunchFloatToBFloat16(const float* src, uint16_t* dst, int64_t count,
                                  cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const int64_t blocks = (count + kRowThreads - 1) / kRowThreads;
  FloatToBFloat16Kernel<<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), kRowThreads, 0,
                          stream>>>(src, dst, count);
  return cudaGetLastError();
}

}  // namespace lathe::kernels::cuda::internal
