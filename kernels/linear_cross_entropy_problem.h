// The description of one fused linear cross-entropy (docs/kernels.md, "Linear cross-entropy")
// shared by the CPU and CUDA kernels, and the choice of chunk sizes from a memory budget.
//
//   logits = hidden [N, H] x weight [V, H]^T          (never materialised whole)
//   z      = softcap * tanh(logits / softcap)          (when softcap > 0, else z = logits)
//   lse_i  = log sum_j exp(z_ij)
//   loss   = sum over tokens i whose target is not ignore_index of
//            lse_i - z_i,target_i + z_loss_weight * lse_i^2
//
// Header-only and free of libtorch and CUDA types, so ops/ and tests include it anywhere.
//
// Thread-safety: plain data and pure functions.
#ifndef LATHE_KERNELS_LINEAR_CROSS_ENTROPY_PROBLEM_H_
#define LATHE_KERNELS_LINEAR_CROSS_ENTROPY_PROBLEM_H_

#include <algorithm>
#include <cstdint>
#include <functional>

namespace lathe::kernels {

// Element types of hidden, weight and of their gradients. bfloat16 is stored as its 16 bits
// (the layout of c10::BFloat16 and __nv_bfloat16); every kernel sums in float32.
enum class LinearCrossEntropyDtype {
  kFloat32,   // hidden and weight float32
  kBFloat16,  // hidden and weight bfloat16
  // hidden (and its gradient) float32, weight bfloat16 and frozen (no weight gradient): a
  // bfloat16 job's float32 activations on the CPU against its frozen LM head. CPU only.
  kFloat32HiddenBFloat16Weight,
};

// Bytes of one element of hidden and of weight alike.
// REQUIRES: dtype is kFloat32 or kBFloat16.
inline int64_t ElementBytes(LinearCrossEntropyDtype dtype) {
  return dtype == LinearCrossEntropyDtype::kFloat32 ? 4 : 2;
}

struct LinearCrossEntropyProblem {
  int64_t tokens = 0;       // N: rows of hidden, entries of targets
  int64_t hidden_size = 0;  // H
  int64_t vocab = 0;        // V: rows of weight
  LinearCrossEntropyDtype dtype = LinearCrossEntropyDtype::kFloat32;
  // Tokens whose target equals this contribute nothing to the loss or the gradients.
  int64_t ignore_index = -100;
  // > 0: logits are soft-capped to (-softcap, softcap) as in Gemma 2. 0: no cap.
  float softcap = 0.0f;
  // Weight of the z-loss term z_loss_weight * lse^2 added per non-ignored token; 0: none.
  float z_loss_weight = 0.0f;
};

// Tokens and vocabulary entries per chunk: a chunk's logits are a [tokens, vocab] tile.
struct LinearCrossEntropyChunks {
  int64_t tokens = 1;
  int64_t vocab = 1;
};

// The default memory budget: with 2048 tokens per chunk it allows vocabulary chunks of about
// 2000 entries (fp32), enough for the chunk products to run at full matrix-multiply speed.
inline constexpr int64_t kDefaultLinearCrossEntropyBudgetBytes = int64_t{16} << 20;

// Chooses chunk sizes for `problem` whose workspace (as reported by `workspace_bytes`, which
// must grow with the token chunk, and with the vocabulary chunk below the whole vocabulary)
// fits in `budget_bytes`: the most tokens per chunk (halving from all of them, down to 64)
// that still leave a vocabulary chunk of at least 1024 entries, and then the most vocabulary
// entries that fit (the whole vocabulary, or a multiple of 64). Smaller chunks would make the
// chunk products slow, so when nothing that large fits, returns {64, 1024} (capped at the
// problem's sizes), which exceeds the budget.
inline LinearCrossEntropyChunks ChooseLinearCrossEntropyChunks(
    const LinearCrossEntropyProblem& problem, int64_t budget_bytes,
    const std::function<int64_t(const LinearCrossEntropyChunks&)>& workspace_bytes) {
  const int64_t tokens = std::max<int64_t>(problem.tokens, 1);
  const int64_t vocab = std::max<int64_t>(problem.vocab, 1);
  const int64_t min_tokens = std::min<int64_t>(tokens, 64);
  const int64_t min_vocab = std::min<int64_t>(vocab, 1024);
  for (int64_t chunk_tokens = tokens; chunk_tokens >= min_tokens;
       chunk_tokens = chunk_tokens == min_tokens ? 0 : std::max(min_tokens, chunk_tokens / 2)) {
    // The whole vocabulary may need less than a part of it (no cross-chunk accumulators).
    if (workspace_bytes({chunk_tokens, vocab}) <= budget_bytes) return {chunk_tokens, vocab};
    // Otherwise the largest part that fits (binary search; monotone below `vocab`).
    int64_t low = 0;
    int64_t high = vocab - 1;
    while (low < high) {
      const int64_t mid = (low + high + 1) / 2;
      if (workspace_bytes({chunk_tokens, mid}) <= budget_bytes) {
        low = mid;
      } else {
        high = mid - 1;
      }
    }
    if (low >= min_vocab) return {chunk_tokens, low < 64 ? low : low / 64 * 64};
  }
  return {min_tokens, min_vocab};
}

}  // namespace lathe::kernels

#endif  // LATHE_KERNELS_LINEAR_CROSS_ENTROPY_PROBLEM_H_
