// Fused linear cross-entropy as a differentiable ATen op (docs/kernels.md, "Linear
// cross-entropy"): the cross-entropy of the logits hidden x weight^T against targets, without
// ever holding the [tokens, vocab] logits or their gradient. It computes what
//
//   at::Tensor logits = at::matmul(hidden, weight.t()).to(at::kFloat);
//   if (softcap > 0) logits = softcap * at::tanh(logits / softcap);
//   at::cross_entropy_loss(logits, targets, {}, reduction, ignore_index)
//     + z_loss_weight * (reduce over non-ignored tokens of) at::logsumexp(logits, 1).pow(2)
//
// computes, with scratch memory bounded by options.memory_budget_bytes: beyond it only the
// scalar result, lse ([tokens] floats) and the gradients themselves.
//
// The returned 0-dim float32 tensor is differentiable with respect to hidden and weight (when
// they require grad; a frozen weight, as with LoRA, costs no weight gradient). Forward saves
// hidden, weight, targets and lse, never logits; backward recomputes the logits chunk by
// chunk for whatever gradient forward has not computed already (options.gradient_in_forward).
// Backward is not itself differentiable (no double backward).
//
// Runs on the CPU kernel (kernels/cpu) for CPU tensors, and on the CUDA kernel (kernels/cuda)
// for CUDA tensors when this libtorch has CUDA (built with LATHE_TORCH_CUDA).
//
// Errors (a bad shape, dtype, device, target or option) throw c10::Error, like ATen ops.
//
// Thread-safety: as ATen ops; concurrent calls on distinct tensors are safe.
#ifndef LATHE_KERNELS_OPS_LINEAR_CROSS_ENTROPY_H_
#define LATHE_KERNELS_OPS_LINEAR_CROSS_ENTROPY_H_

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kernels/linear_cross_entropy_problem.h"

namespace lathe::kernels {

enum class LinearCrossEntropyReduction {
  // The sum over non-ignored tokens (what the engine uses: it divides by the step's target
  // count itself).
  kSum,
  // The sum divided by the number of non-ignored tokens; 0 (not NaN, as in at::cross_entropy)
  // when there are none.
  kMean,
};

struct LinearCrossEntropyOptions {
  int64_t ignore_index = -100;
  LinearCrossEntropyReduction reduction = LinearCrossEntropyReduction::kSum;
  // > 0: Gemma 2's logit soft-cap, logits = softcap * tanh(logits / softcap). 0: none.
  double softcap = 0.0;
  // z-loss: z_loss_weight * lse^2 added per non-ignored token (and reduced like the loss).
  double z_loss_weight = 0.0;
  // Bound on each pass's workspace (the logits chunk, and for bfloat16 the copies of the
  // chunk's rows and gradient sums), from which the chunk sizes are chosen. A budget too
  // small for chunks of 64 tokens by 1024 vocabulary entries is exceeded rather than obeyed.
  int64_t memory_budget_bytes = kDefaultLinearCrossEntropyBudgetBytes;
  // > 0: use these chunk sizes instead of choosing them from the budget (tests, tuning).
  int64_t token_chunk = 0;
  int64_t vocab_chunk = 0;
  // When the backward will follow (grad mode is on and hidden or weight requires grad),
  // compute gradients during the forward pass instead of recomputing the logits for them in
  // backward, which then only scales them by its incoming gradient:
  //  - the weight trains, float32, and at least 128 tokens of the whole vocabulary fit the
  //    budget (16 MiB: vocabularies up to 32768): both gradients in a single pass over the
  //    logits, three chunk products (the unfused composition's arithmetic);
  //  - otherwise the hidden gradient, with one more chunk product in forward: two in all
  //    with a frozen weight (LoRA; as unfused), four when the weight trains (backward
  //    recomputes the logits for the weight gradient).
  // CPU only for now. false: forward computes the loss only, backward everything (four chunk
  // products, three with a frozen weight).
  bool gradient_in_forward = true;
};

// Returns the loss (a 0-dim float32 tensor on hidden's device).
// REQUIRES (checked): hidden [N, H] and weight [V, H] on one device, both float32, both
// bfloat16, or (CPU only) float32 hidden with a bfloat16 weight that does not require grad (a
// bfloat16 job's frozen LM head: the chunk products round the hidden rows to bfloat16 where the
// CPU multiplies bfloat16 natively, and widen the weight rows chunk by chunk where it does not);
// targets [N] of integers, each ignore_index or in [0, V); softcap >= 0;
// memory_budget_bytes > 0.
at::Tensor LinearCrossEntropy(const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& targets,
                              const LinearCrossEntropyOptions& options = {});

}  // namespace lathe::kernels

#endif  // LATHE_KERNELS_OPS_LINEAR_CROSS_ENTROPY_H_
