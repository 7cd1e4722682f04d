// Fused linear cross-entropy on the CPU (docs/kernels.md, "Linear cross-entropy"): the loss of
// hidden [N, H] x weight [V, H]^T against targets, and its gradients with respect to hidden and
// weight, computed one [tokens, vocab] chunk of logits at a time with an online log-sum-exp.
// The [N, V] logits and their gradient never exist; the extra memory is the workspace, whose
// size the *WorkspaceBytes functions report and ChooseLinearCrossEntropyChunks bounds.
//
// Raw pointers, no libtorch. Chunk products go to oneDNN (kernels/cpu/matmul.h,
// multi-threaded by oneDNN itself); the per-row work (soft-cap, max, exp, sums, softmax gradient,
// bfloat16 conversion) runs through the caller's ParallelFor, so ops/ can use libtorch's thread
// pool.
//
// All arrays are dense and row-major; hidden, weight, grad_hidden and grad_weight have the
// problem's dtype; workspace must be aligned to 64 bytes and is overwritten.
//
// bfloat16 (hidden and weight) is widened to float32 copies, a chunk's rows at a time, for
// float32 products. Float32 hidden with a bfloat16 weight (frozen: no weight gradient), where
// the CPU multiplies bfloat16 natively (NativeBFloat16Products(), kernels/cpu/matmul.h), runs
// its products in bfloat16 with float32 sums, as CUDA autocast does: each token chunk's hidden
// rows and each gradient tile are rounded to bfloat16, the weight goes in as it is, the
// gradient comes out float32. Elsewhere (or with LATHE_CPU_BF16=0) it widens each vocabulary
// chunk's weight rows to float32 and multiplies in float32. The rest (soft-cap, log-sum-exp,
// loss, z-loss) is float32 with double sums either way; the workspace sizes are the same
// either way.
//
// Thread-safety: functions are reentrant; concurrent calls need distinct outputs and
// workspaces.
#ifndef LATHE_KERNELS_CPU_LINEAR_CROSS_ENTROPY_H_
#define LATHE_KERNELS_CPU_LINEAR_CROSS_ENTROPY_H_

#include <cstdint>
#include <functional>

#include "kernels/linear_cross_entropy_problem.h"

namespace lathe::kernels::cpu {

// Runs body(begin, end) over disjoint ranges that together cover [0, n), possibly
// concurrently, and returns when all have finished.
using ParallelFor =
    std::function<void(int64_t n, const std::function<void(int64_t begin, int64_t end)>& body)>;

// A ParallelFor that runs body(0, n) on the calling thread.
void SerialFor(int64_t n, const std::function<void(int64_t begin, int64_t end)>& body);

// Workspace bytes that LinearCrossEntropyForward needs with these chunks, with or without the
// hidden gradient.
int64_t LinearCrossEntropyForwardWorkspaceBytes(const LinearCrossEntropyProblem& problem,
                                                const LinearCrossEntropyChunks& chunks,
                                                bool grad_hidden);

// Workspace bytes that LinearCrossEntropyBackward needs with these chunks when it computes the
// gradients selected by grad_hidden and grad_weight.
int64_t LinearCrossEntropyBackwardWorkspaceBytes(const LinearCrossEntropyProblem& problem,
                                                 const LinearCrossEntropyChunks& chunks,
                                                 bool grad_hidden, bool grad_weight);

// Writes lse[i], the log-sum-exp of token i's (soft-capped) logits, for every token (0 for a
// token whose target is ignore_index) and returns the loss summed over the other tokens,
// accumulated in double (0 when every token is ignored).
//
// When grad_hidden is not null, also writes grad_scale times the gradient of the summed loss
// with respect to hidden into it (every element; zero rows for ignored tokens), in the same
// pass: each chunk's exponentials, taken against the token's running maximum, are multiplied
// into the weight rows and summed as flash attention sums its output, rescaled whenever the
// running maximum grows and normalised at the end. That costs one more chunk product, and
// saves recomputing the logits in LinearCrossEntropyBackward (which then needs to compute
// only the weight gradient, if any).
// REQUIRES: each target is ignore_index or in [0, vocab); chunk sizes >= 1; workspace holds
// LinearCrossEntropyForwardWorkspaceBytes(problem, chunks, grad_hidden != nullptr) bytes.
double LinearCrossEntropyForward(const LinearCrossEntropyProblem& problem,
                                 const LinearCrossEntropyChunks& chunks, const void* hidden,
                                 const int64_t* targets, const void* weight, float grad_scale,
                                 float* lse, void* grad_hidden, void* workspace,
                                 const ParallelFor& parallel_for);

// Writes grad_scale times the gradient of the summed loss with respect to hidden (into
// grad_hidden, [N, H]) and weight (into grad_weight, [V, H]); either may be null to skip it.
// Every element of a non-null output is written (rows of ignored tokens get zeros).
// `lse` is what LinearCrossEntropyForward wrote for the same inputs (with any chunk sizes).
// REQUIRES: as LinearCrossEntropyForward; grad_weight is null for float32 hidden with a
// bfloat16 weight; workspace holds LinearCrossEntropyBackwardWorkspaceBytes(problem, chunks,
// grad_hidden != nullptr, grad_weight != nullptr) bytes.
void LinearCrossEntropyBackward(const LinearCrossEntropyProblem& problem,
                                const LinearCrossEntropyChunks& chunks, const void* hidden,
                                const int64_t* targets, const void* weight, const float* lse,
                                float grad_scale, void* grad_hidden, void* grad_weight,
                                void* workspace, const ParallelFor& parallel_for);

// Forward and backward in one pass, for when the backward is sure to follow and the weight
// trains: one chunk of tokens over the whole vocabulary at a time, so that each token's
// log-sum-exp is final before its gradient row is formed. Three chunk products per chunk (the
// unfused composition's arithmetic) where LinearCrossEntropyForward with the hidden gradient
// followed by LinearCrossEntropyBackward for the weight gradient takes four. Writes lse as
// LinearCrossEntropyForward does and grad_hidden, grad_weight as LinearCrossEntropyBackward
// does (either may be null); returns the summed loss.
// REQUIRES: problem.dtype is kFloat32; token_chunk >= 1; workspace holds
// LinearCrossEntropySinglePassWorkspaceBytes(problem, token_chunk) bytes; targets as
// LinearCrossEntropyForward.
int64_t LinearCrossEntropySinglePassWorkspaceBytes(const LinearCrossEntropyProblem& problem,
                                                   int64_t token_chunk);
// The token chunk of LinearCrossEntropySinglePass (the whole vocabulary per chunk) whose
// workspace fits `budget_bytes`, or 0 when fewer than min(tokens, 128) tokens fit: smaller
// chunks make its products slow (the weight is packed, and its gradient read and written,
// once per chunk).
int64_t LinearCrossEntropySinglePassTokenChunk(const LinearCrossEntropyProblem& problem,
                                               int64_t budget_bytes);
double LinearCrossEntropySinglePass(const LinearCrossEntropyProblem& problem, int64_t token_chunk,
                                    const void* hidden, const int64_t* targets, const void* weight,
                                    float grad_scale, float* lse, void* grad_hidden,
                                    void* grad_weight, void* workspace,
                                    const ParallelFor& parallel_for);

}  // namespace lathe::kernels::cpu

#endif  // LATHE_KERNELS_CPU_LINEAR_CROSS_ENTROPY_H_
