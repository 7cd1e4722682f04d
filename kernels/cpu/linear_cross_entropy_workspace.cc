// The CPU linear cross-entropy's workspace sizes (kernels/cpu/linear_cross_entropy.h), apart
// from the kernel: lathe_kernels_cpu_sizes, which the planner links.
#include <algorithm>
#include <cstdint>

#include "kernels/cpu/linear_cross_entropy.h"
#include "kernels/cpu/linear_cross_entropy_layout.h"

namespace lathe::kernels::cpu {

int64_t LinearCrossEntropyForwardWorkspaceBytes(const LinearCrossEntropyProblem& problem,
                                                const LinearCrossEntropyChunks& chunks,
                                                bool grad_hidden) {
  WorkspaceLayout layout(nullptr);
  CarveForward(Sizes(problem, chunks), grad_hidden, /*native=*/false, layout);  // either: one size
  return layout.bytes();
}

int64_t LinearCrossEntropyBackwardWorkspaceBytes(const LinearCrossEntropyProblem& problem,
                                                 const LinearCrossEntropyChunks& chunks,
                                                 bool grad_hidden, bool grad_weight) {
  WorkspaceLayout layout(nullptr);
  CarveBackward(Sizes(problem, chunks), grad_hidden, grad_weight, /*native=*/false, layout);
  return layout.bytes();
}

int64_t LinearCrossEntropySinglePassWorkspaceBytes(const LinearCrossEntropyProblem& problem,
                                                   int64_t token_chunk) {
  WorkspaceLayout layout(nullptr);
  CarveSinglePass(Sizes(problem, {token_chunk, problem.vocab}), layout);
  return layout.bytes();
}

int64_t LinearCrossEntropySinglePassTokenChunk(const LinearCrossEntropyProblem& problem,
                                               int64_t budget_bytes) {
  constexpr int64_t kMinTokens = 128;
  const int64_t row_bytes = LinearCrossEntropySinglePassWorkspaceBytes(problem, 1);
  int64_t chunk = std::min(problem.tokens, budget_bytes / row_bytes);
  while (chunk > 0 && LinearCrossEntropySinglePassWorkspaceBytes(problem, chunk) > budget_bytes) {
    --chunk;
  }
  return chunk >= std::min(problem.tokens, kMinTokens) ? chunk : 0;
}

}  // namespace lathe::kernels::cpu
