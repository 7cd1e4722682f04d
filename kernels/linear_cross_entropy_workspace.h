// The chunked sizes of a fused linear cross-entropy and the carving of its workspace, shared by
// the CPU and CUDA kernels (kernels/cpu/linear_cross_entropy.cc,
// kernels/cuda/linear_cross_entropy.cc), whose *WorkspaceBytes functions and kernels must agree
// on where each array lies. Host code only; ops/ sees only the *WorkspaceBytes functions.
//
// Thread-safety: LinearCrossEntropySizes is immutable; a LinearCrossEntropyWorkspaceLayout is
// used by one thread.
#ifndef LATHE_KERNELS_LINEAR_CROSS_ENTROPY_WORKSPACE_H_
#define LATHE_KERNELS_LINEAR_CROSS_ENTROPY_WORKSPACE_H_

#include <algorithm>
#include <cstdint>

#include "kernels/linear_cross_entropy_problem.h"

namespace lathe::kernels {

// The problem's sizes, with the chunk sizes clamped to [1, tokens] and [1, vocab].
struct LinearCrossEntropySizes {
  LinearCrossEntropySizes(const LinearCrossEntropyProblem& problem,
                          const LinearCrossEntropyChunks& chunks)
      : n(problem.tokens),
        h(problem.hidden_size),
        v(problem.vocab),
        tn(std::clamp<int64_t>(chunks.tokens, 1, std::max<int64_t>(n, 1))),
        tv(std::clamp<int64_t>(chunks.vocab, 1, std::max<int64_t>(v, 1))),
        bf16(problem.dtype == LinearCrossEntropyDtype::kBFloat16),
        bf16_weight_only(problem.dtype == LinearCrossEntropyDtype::kFloat32HiddenBFloat16Weight),
        element_bytes(ElementBytes(problem.dtype)) {}
  int64_t n, h, v, tn, tv;
  bool bf16;              // hidden and weight bfloat16
  bool bf16_weight_only;  // float32 hidden, bfloat16 weight
  int64_t element_bytes;  // of a one-dtype problem
  int64_t vocab_chunks() const { return (v + tv - 1) / tv; }
  // Row `row` of a [rows, h] matrix of a one-dtype problem's dtype.
  const void* Row(const void* base, int64_t row) const {
    return static_cast<const char*>(base) + row * h * element_bytes;
  }
};

// Carves arrays aligned to kAlignment bytes out of a workspace, in a fixed order, so that the
// size functions (which carve from a null base and read bytes()) and the kernels agree.
// REQUIRES: the workspace itself is aligned to kAlignment.
template <int64_t kAlignment>
class LinearCrossEntropyWorkspaceLayout {
  static_assert(kAlignment > 0 && (kAlignment & (kAlignment - 1)) == 0,
                "the alignment is a power of two");

 public:
  explicit LinearCrossEntropyWorkspaceLayout(void* base) : base_(static_cast<char*>(base)) {}

  // The next `count` elements of type T; nullptr with a null base.
  template <typename T>
  T* Take(int64_t count) {
    T* p = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + bytes_);
    bytes_ += (count * static_cast<int64_t>(sizeof(T)) + kAlignment - 1) / kAlignment * kAlignment;
    return p;
  }
  // The bytes taken so far.
  int64_t bytes() const { return bytes_; }

 private:
  char* base_;
  int64_t bytes_ = 0;
};

// Where a bfloat16 backward accumulates its gradients in float32 (a float32 backward
// accumulates in the outputs themselves): grad_weight holds one vocabulary chunk's rows
// [tv, H], rounded into the output after each vocabulary chunk; grad_hidden holds all rows
// [N, H], or with a single vocabulary chunk one token chunk's rows [tn, H], which that token
// chunk finishes. Null where not wanted.
struct LinearCrossEntropyGradientSums {
  float* grad_weight = nullptr;
  float* grad_hidden = nullptr;
};

// Takes the sums of the wanted gradients out of `layout`; nothing in float32.
template <int64_t kAlignment>
LinearCrossEntropyGradientSums TakeGradientSums(
    const LinearCrossEntropySizes& s, bool grad_hidden, bool grad_weight,
    LinearCrossEntropyWorkspaceLayout<kAlignment>& layout) {
  LinearCrossEntropyGradientSums sums;
  if (!s.bf16) return sums;
  if (grad_weight) sums.grad_weight = layout.template Take<float>(s.tv * s.h);
  if (grad_hidden) {
    sums.grad_hidden = layout.template Take<float>((s.vocab_chunks() > 1 ? s.n : s.tn) * s.h);
  }
  return sums;
}

}  // namespace lathe::kernels

#endif  // LATHE_KERNELS_LINEAR_CROSS_ENTROPY_WORKSPACE_H_
