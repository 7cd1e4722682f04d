// NF4 (kernels/cpu/nf4.h, kernels/ops/nf4_linear.h): the layout and levels, the quantization
// error, and the tiled linear layer against dequantize-then-matmul, forward and backward. The
// bit-for-bit comparison with an independent float64 implementation is test_reference.py's
// Nf4QuantizeTest.
#include "kernels/ops/nf4_linear.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/nf4.h"

namespace lathe::kernels {
namespace {

TEST(Nf4Test, LevelsAreSixteenFromMinusOneToOneWithZero) {
  for (int k = 0; k + 1 < 16; ++k) EXPECT_LT(cpu::kNf4Levels[k], cpu::kNf4Levels[k + 1]);
  EXPECT_EQ(cpu::kNf4Levels[0], -1.0);
  EXPECT_EQ(cpu::kNf4Levels[7], 0.0);
  EXPECT_EQ(cpu::kNf4Levels[15], 1.0);
}

TEST(Nf4Test, QuantizesToHalfAByteAndRoundTripsWithinTheLevelGaps) {
  at::manual_seed(0);
  // 7 x 9 = 63 elements: one partial block; 200 x 320: 1000 blocks, four second-level groups.
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{7, 9}, {200, 320}}) {
    const at::Tensor w = at::randn({rows, cols});
    const Nf4Weight q = QuantizeNf4(w, at::kCPU);
    const int64_t n = rows * cols, blocks = (n + 63) / 64;
    EXPECT_EQ(q.codes.numel(), blocks * 32);
    EXPECT_EQ(q.absmax_codes.numel(), blocks);
    EXPECT_EQ(q.absmax2.numel(), (blocks + 255) / 256);
    const at::Tensor back = DequantizeNf4(q, 0, n).view({rows, cols});
    // Within half the widest level gap (0.30) of the block's largest magnitude, plus the
    // double quantization's error of that maximum (a fraction of a percent).
    const at::Tensor absmax = w.reshape({-1}).abs().max();
    EXPECT_LT((back - w).abs().max().item<float>(), 0.16 * absmax.item<float>());
    // A range dequantizes as the same elements of the whole.
    EXPECT_TRUE(at::equal(DequantizeNf4(q, 5, n - 3), back.reshape({-1}).narrow(0, 5, n - 8)));
    if (n > 64 * 256) {
      EXPECT_LT(q.nbytes(), n * 4 / 7);  // about half a byte per weight
    }
  }
}

TEST(Nf4Test, AllZeroBlocksStayZero) {
  const Nf4Weight q = QuantizeNf4(at::zeros({4, 64}), at::kCPU);
  EXPECT_EQ(DequantizeNf4(q, 0, 256).abs().max().item<float>(), 0.0f);
}

TEST(Nf4LinearTest, MatchesDequantizeThenMatmulForwardAndBackward) {
  at::manual_seed(1);
  // cols 96 (blocks straddle rows); 3000 rows: several tiles.
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{3000, 96}, {40, 64}}) {
    const Nf4Weight q = QuantizeNf4(at::randn({rows, cols}) * 0.05, at::kCPU);
    const at::Tensor dense = DequantizeNf4(q, 0, rows * cols).view({rows, cols});
    const at::Tensor x = at::randn({2, 5, cols}).requires_grad_(true);
    const at::Tensor x_ref = x.detach().clone().requires_grad_(true);
    const at::Tensor y = Nf4Linear(x, q);
    const at::Tensor y_ref = at::matmul(x_ref, dense.t());
    EXPECT_EQ(y.sizes(), y_ref.sizes());
    EXPECT_TRUE(at::allclose(y, y_ref, 1e-5, 1e-6));
    const at::Tensor g = at::randn(y.sizes());
    y.backward(g);
    y_ref.backward(g);
    // Summed tile by tile over 3000 rows, in another order than one product: normwise
    // (measured 4.4e-7 with oneDNN's products).
    EXPECT_LE((x.grad() - x_ref.grad()).abs().max().item<float>(),
              2e-6 * x_ref.grad().abs().max().item<float>());
  }
}

}  // namespace
}  // namespace lathe::kernels
