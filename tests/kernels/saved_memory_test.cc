// What each fused op keeps for backward, in exact bytes, measured with the engine's tracking
// allocator: the bytes still held after the forward, beyond the output, are the op's saved
// state (the inputs are the caller's and not counted).
#include <cstdint>

#include "gtest/gtest.h"
#include "kernels/cpu/matmul.h"
#include "kernels/ops/lora_linear.h"
#include "kernels/ops/matmul.h"
#include "kernels/ops/rms_norm.h"
#include "kernels/ops/rope.h"
#include "kernels/ops/swiglu.h"
#include "worker/engine/memory_tracker.h"

namespace lathe {
namespace {

class SavedMemoryTest : public ::testing::Test {
 protected:
  // Bytes held after f() returns its output, beyond the output itself.
  template <typename F>
  int64_t SavedBytes(F f) {
    const int64_t before = tracker_->Snapshot().total.current_bytes;
    at::Tensor y = f();
    return tracker_->Snapshot().total.current_bytes - before - y.numel() * y.element_size();
  }

  MemoryTracker* tracker_ = MemoryTracker::Install();
};

TEST_F(SavedMemoryTest, RmsNormKeepsOnlyTheRowStatistics) {
  at::Tensor x = at::randn({48, 256}).requires_grad_(true);
  at::Tensor w = at::ones({256}).requires_grad_(true);
  EXPECT_EQ(SavedBytes([&] { return kernels::RmsNorm(x, w, 1e-6); }), 48 * 4);
}

TEST_F(SavedMemoryTest, RopeKeepsNothingNew) {
  at::Tensor q = at::randn({2, 8, 4, 16}).transpose(1, 2).requires_grad_(true);
  at::Tensor cos = at::randn({8, 16}), sin = at::randn({8, 16});
  EXPECT_EQ(SavedBytes([&] { return kernels::Rope(q, cos, sin); }), 0);
}

TEST_F(SavedMemoryTest, SwiGluKeepsNothingNew) {
  at::Tensor gate = at::randn({32, 96}).requires_grad_(true);
  at::Tensor up = at::randn({32, 96}).requires_grad_(true);
  EXPECT_EQ(SavedBytes([&] { return kernels::SwiGlu(gate, up); }), 0);
}

TEST_F(SavedMemoryTest, LoraLinearWithDropoutKeepsOnlyTheRankRProduct) {
  const int64_t tokens = 64, in = 128, out = 96, rank = 4;
  at::Tensor x = at::randn({tokens, in}).requires_grad_(true);
  at::Tensor w = at::randn({out, in}).to(at::kBFloat16);  // frozen, widened as used
  at::Tensor a = at::randn({rank, in}).requires_grad_(true);
  at::Tensor b = at::randn({out, rank}).requires_grad_(true);
  EXPECT_EQ(SavedBytes([&] { return kernels::LoraLinear(x, w, {}, a, b, 2.0, 0.1, true); }),
            tokens * rank * 4);
}

// A bf16 job's node on a CPU that multiplies bfloat16, without dropout: x A^T's gradient reads
// x rounded, so the node keeps that bfloat16 copy (half of x) instead of x itself.
TEST_F(SavedMemoryTest, LoraLinearInBFloat16KeepsXRounded) {
  if (!kernels::cpu::NativeBFloat16Products()) GTEST_SKIP() << "no native bfloat16 products";
  const int64_t tokens = 256, in = 128, out = 96, rank = 16;  // every product above 64^3
  at::Tensor x = at::randn({tokens, in}).requires_grad_(true);
  at::Tensor w = at::randn({out, in}).to(at::kBFloat16);
  at::Tensor a = at::randn({rank, in}).requires_grad_(true);
  at::Tensor b = at::randn({out, rank}).requires_grad_(true);
  EXPECT_EQ(SavedBytes([&] { return kernels::LoraLinear(x, w, {}, a, b, 2.0, 0.0, true); }),
            tokens * rank * 4 + tokens * in * 2);
}

// Attention's bf16 products keep bfloat16 copies of their operands, but not of one kept alive
// anyway (keep_a: the softmax's output).
TEST_F(SavedMemoryTest, BatchedMatmulInBFloat16KeepsRoundedCopies) {
  if (!kernels::cpu::NativeBFloat16Products()) GTEST_SKIP() << "no native bfloat16 products";
  at::Tensor p = at::rand({2, 64, 64}).requires_grad_(true);
  at::Tensor v = at::randn({2, 64, 64}).requires_grad_(true);
  const int64_t rounded = 2 * 64 * 64 * 2;
  EXPECT_EQ(SavedBytes([&] { return kernels::BatchedMatmul(p, v, true); }), 2 * rounded);
  EXPECT_EQ(SavedBytes([&] { return kernels::BatchedMatmul(p, v, true, true); }), rounded);
}

}  // namespace
}  // namespace lathe
