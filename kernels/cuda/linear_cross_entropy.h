// Fused linear cross-entropy on CUDA: the algorithm of kernels/cpu/linear_cross_entropy.h
// (docs/kernels.md, "Linear cross-entropy") with cuBLAS for the chunk products and CUDA
// kernels for the online log-sum-exp and the softmax gradient. Built for sm_90 (+ PTX).
//
// Raw device pointers, no libtorch. Every function enqueues its work on `stream` and returns
// without waiting: results are ready when the stream reaches that point. A returned error is a
// failed launch or cuBLAS call (an error of earlier asynchronous work may surface here too).
//
// float32 inputs use float32 products (no TF32). bfloat16 inputs go straight into the
// products (bfloat16 x bfloat16 -> float32); the gradient chunk is rounded to bfloat16 for
// the two backward products, as an unfused bfloat16 backward would hold it. Float32 hidden
// with a bfloat16 weight (kFloat32HiddenBFloat16Weight) is the CPU kernel's only: the functions
// return InvalidArgument for it.
//
// Arrays are dense and row-major; workspace must be aligned to 256 bytes (cudaMalloc's and
// libtorch's caching allocator's blocks are) and is overwritten.
//
// Thread-safety: functions are reentrant. Each host thread uses its own cuBLAS handle per
// device (created on first use, never destroyed).
#ifndef LATHE_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_H_
#define LATHE_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/linear_cross_entropy_problem.h"

namespace lathe::kernels::cuda {

// Workspace bytes that LinearCrossEntropyForward needs with these chunks.
int64_t LinearCrossEntropyForwardWorkspaceBytes(const LinearCrossEntropyProblem& problem,
                                                const LinearCrossEntropyChunks& chunks);

// Workspace bytes that LinearCrossEntropyBackward needs with these chunks when it computes the
// gradients selected by grad_hidden and grad_weight.
int64_t LinearCrossEntropyBackwardWorkspaceBytes(const LinearCrossEntropyProblem& problem,
                                                 const LinearCrossEntropyChunks& chunks,
                                                 bool grad_hidden, bool grad_weight);

// Writes lse[i] for every token (0 for an ignored token) and *loss, the loss summed over the
// non-ignored tokens (0 when there are none), all on the device.
// REQUIRES: each target is ignore_index or in [0, vocab); chunk sizes >= 1; workspace holds
// LinearCrossEntropyForwardWorkspaceBytes(problem, chunks) bytes.
absl::Status LinearCrossEntropyForward(const LinearCrossEntropyProblem& problem,
                                       const LinearCrossEntropyChunks& chunks, const void* hidden,
                                       const int64_t* targets, const void* weight, float* lse,
                                       float* loss, void* workspace, cudaStream_t stream);

// Writes *grad_scale (one float on the device) times the gradient of the summed loss with
// respect to hidden (grad_hidden, [N, H]) and weight (grad_weight, [V, H]); either may be null
// to skip it. Every element of a non-null output is written.
// REQUIRES: as LinearCrossEntropyForward, with `lse` from it; workspace holds
// LinearCrossEntropyBackwardWorkspaceBytes(problem, chunks, grad_hidden != nullptr,
// grad_weight != nullptr) bytes.
absl::Status LinearCrossEntropyBackward(const LinearCrossEntropyProblem& problem,
                                        const LinearCrossEntropyChunks& chunks, const void* hidden,
                                        const int64_t* targets, const void* weight,
                                        const float* lse, const float* grad_scale,
                                        void* grad_hidden, void* grad_weight, void* workspace,
                                        cudaStream_t stream);

}  // namespace lathe::kernels::cuda

#endif  // LATHE_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_H_
