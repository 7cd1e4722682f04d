// The CUDA kernels of kernels/cuda/linear_cross_entropy.h, one launcher each; the chunk loop
// and the cuBLAS products are in linear_cross_entropy.cc. Internal to lathe_kernels_cuda.
//
// A "tile" is one chunk of logits: [tn, tv] floats, row-major, row r holding token n0 + r and
// columns vocabulary entries v0 .. v0 + tv - 1. Each launcher enqueues on `stream` and returns
// the launch's error.
//
// Thread-safety: reentrant.
#ifndef LATHE_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_KERNELS_H_
#define LATHE_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace lathe::kernels::cuda::internal {

// Soft-caps the tile in place (softcap > 0) and folds each non-ignored row's maximum, sum of
// exponentials and (when the target lies in this chunk) target logit into the running
// row_max/row_sum/row_target of its token; `first` starts them instead (v0 == 0).
cudaError_t LaunchChunkLogSumExp(float* tile, int64_t tn, int64_t tv, int64_t n0, int64_t v0,
                                 const int64_t* targets, int64_t ignore_index, float softcap,
                                 bool first, float* row_max, float* row_sum, float* row_target,
                                 cudaStream_t stream);

// lse[i] = row_max[i] + log(row_sum[i]) (0 for ignored tokens) and *loss = the sum over
// non-ignored tokens of lse - row_target + z_loss_weight * lse^2, accumulated in double.
cudaError_t LaunchFinishForward(int64_t n, const int64_t* targets, int64_t ignore_index,
                                float z_loss_weight, const float* row_max, const float* row_sum,
                                const float* row_target, float* lse, float* loss,
                                cudaStream_t stream);

// Replaces the tile's raw logits by *grad_scale times the loss gradient with respect to them
// (zero rows for ignored tokens): in place, or, when tile_bf16 is not null, rounded into
// tile_bf16 ([tn, tv] bfloat16 bits) leaving the tile as it was.
cudaError_t LaunchChunkGradient(float* tile, uint16_t* tile_bf16, int64_t tn, int64_t tv,
                                int64_t n0, int64_t v0, const int64_t* targets,
                                int64_t ignore_index, const float* lse, const float* grad_scale,
                                float z_loss_weight, float softcap, cudaStream_t stream);

// dst[k] = src[k] rounded to bfloat16 (nearest even), for k in [0, count).
cudaError_t LaunchFloatToBFloat16(const float* src, uint16_t* dst, int64_t count,
                                  cudaStream_t stream);

}  // namespace lathe::kernels::cuda::internal

#endif  // LATHE_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_KERNELS_H_
