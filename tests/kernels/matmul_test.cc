// The CPU's matrix products through oneDNN (kernels/cpu/matmul.h) against float64 products
// of the same inputs: every transpose, padded leading dimensions, alpha and beta, empty sums,
// and bfloat16 inputs where the CPU multiplies them natively.
#include "kernels/cpu/matmul.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"
#include "kernels/ops/matmul.h"
#include "tests/kernels/kernel_test_util.h"

namespace lathe::kernels::cpu {
namespace {

using testing::FreshSeed;
using testing::Generator;
using testing::Tolerance;

// A [rows, cols] matrix stored with row stride `ld` (>= cols), as `type`, its padding NaN so
// that reading it shows.
at::Tensor Strided(int64_t rows, int64_t cols, int64_t ld, at::ScalarType type,
                   at::Generator& gen) {
  at::Tensor storage = at::full({rows, ld}, std::numeric_limits<float>::quiet_NaN(), type);
  storage.narrow(1, 0, cols).copy_(at::randn({rows, cols}, gen, at::kDouble).to(type));
  return storage;
}

struct Case {
  int64_t m, n, k;
  bool trans_a, trans_b;
  float alpha, beta;
};

void ExpectMatches(const Case& c, MatmulInput input, at::Generator& gen, double tolerance) {
  SCOPED_TRACE(::testing::Message()
               << "m " << c.m << " n " << c.n << " k " << c.k << " trans " << c.trans_a << c.trans_b
               << " alpha " << c.alpha << " beta " << c.beta);
  const at::ScalarType type = input == MatmulInput::kBFloat16 ? at::kBFloat16 : at::kFloat;
  MatmulProblem p;
  p.m = c.m;
  p.n = c.n;
  p.k = c.k;
  p.trans_a = c.trans_a;
  p.trans_b = c.trans_b;
  p.input = input;
  // Stored shapes, each row padded by 3.
  const int64_t a_rows = c.trans_a ? c.k : c.m, a_cols = c.trans_a ? c.m : c.k;
  const int64_t b_rows = c.trans_b ? c.n : c.k, b_cols = c.trans_b ? c.k : c.n;
  p.lda = a_cols + 3;
  p.ldb = b_cols + 3;
  p.ldc = c.n + 3;
  const at::Tensor a = Strided(a_rows, a_cols, p.lda, type, gen);
  const at::Tensor b = Strided(b_rows, b_cols, p.ldb, type, gen);
  at::Tensor out = Strided(c.m, c.n, p.ldc, at::kFloat, gen);
  if (c.beta == 0.0f) out.narrow(1, 0, c.n).fill_(std::numeric_limits<float>::quiet_NaN());
  const at::Tensor before = out.narrow(1, 0, c.n).to(at::kDouble);

  at::Tensor ad = a.narrow(1, 0, a_cols).to(at::kDouble);
  at::Tensor bd = b.narrow(1, 0, b_cols).to(at::kDouble);
  if (c.trans_a) ad = ad.t();
  if (c.trans_b) bd = bd.t();
  at::Tensor want = at::matmul(ad, bd).mul_(c.alpha);
  if (c.beta != 0.0f) want.add_(before, c.beta);

  Matmul(p, a.data_ptr(), b.data_ptr(), out.data_ptr<float>(), c.alpha, c.beta);
  const at::Tensor got = out.narrow(1, 0, c.n).to(at::kDouble);
  ASSERT_TRUE(at::isfinite(got).all().item<bool>());
  const double scale = std::max(want.abs().max().item<double>(), 1e-30);
  EXPECT_LE((got - want).abs().max().item<double>() / scale, tolerance);
  // The padding of C is never written.
  EXPECT_TRUE(at::isnan(out.narrow(1, c.n, 3)).all().item<bool>());
}

const Case kCases[] = {
    {1, 1, 1, false, false, 1.0f, 0.0f},       {7, 13, 5, false, true, 1.0f, 0.0f},
    {64, 96, 200, true, false, 0.5f, 0.0f},    {64, 96, 200, true, true, 1.0f, 1.0f},
    {300, 17, 513, false, false, 1.0f, 0.25f}, {300, 517, 64, false, true, 2.0f, 1.0f},
    {1024, 8, 512, false, true, 1.0f, 0.0f},   {8, 512, 1024, true, false, 1.0f, 0.0f},
};

TEST(MatmulTest, Float32MatchesFloat64) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  at::Generator gen = Generator(seed);
  for (const Case& c : kCases)
    ExpectMatches(c, MatmulInput::kFloat32, gen, Tolerance(at::kFloat, c.k));
}

TEST(MatmulTest, BFloat16InputsAccumulateInFloat32) {
  if (!NativeBFloat16Products()) {
    GTEST_SKIP() << "this CPU has no AVX512-BF16 or AMX (or LATHE_CPU_BF16=0): " << MatmulBackend();
  }
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  at::Generator gen = Generator(seed);
  // The inputs are exact bfloat16 values; only the float32 sums round.
  for (const Case& c : kCases)
    ExpectMatches(c, MatmulInput::kBFloat16, gen, Tolerance(at::kFloat, c.k));
}

TEST(MatmulTest, EmptySumsAndEmptyResults) {
  MatmulProblem p{/*m=*/2, /*n=*/3, /*k=*/0, false, false, /*lda=*/1, /*ldb=*/3, /*ldc=*/3};
  float c[6] = {1, 2, 3, 4, 5, std::numeric_limits<float>::quiet_NaN()};
  Matmul(p, nullptr, nullptr, c, 1.0f, 0.5f);
  EXPECT_EQ(c[0], 0.5f);
  EXPECT_EQ(c[4], 2.5f);
  Matmul(p, nullptr, nullptr, c, 1.0f, 0.0f);
  for (float v : c) EXPECT_EQ(v, 0.0f);
  p.m = 0;
  Matmul(p, nullptr, nullptr, nullptr);  // nothing to do
}

TEST(MatmulTest, TheSameProblemGivesTheSameBits) {
  at::Generator gen = Generator(7);
  const at::Tensor a = at::randn({128, 96}, gen);
  const at::Tensor b = at::randn({96, 80}, gen);
  const MatmulProblem p{/*m=*/128, /*n=*/80, /*k=*/96, false, false, /*lda=*/96, /*ldb=*/80,
                        /*ldc=*/80};
  at::Tensor first = at::empty({128, 80});
  at::Tensor second = at::empty({128, 80});
  Matmul(p, a.data_ptr(), b.data_ptr(), first.data_ptr<float>());
  Matmul(p, a.data_ptr(), b.data_ptr(), second.data_ptr<float>());
  EXPECT_TRUE(at::equal(first, second));
  EXPECT_NE(MatmulBackend().find("onednn f32"), std::string::npos) << MatmulBackend();
}

// The op over tensors of every layout the engine hands it (contiguous, transposed views,
// column slices of wider tensors), above the size where it takes the kernel.
TEST(MatmulOpTest, EveryLayoutMatchesFloat64) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  at::Generator gen = Generator(seed);
  const int64_t m = 96, k = 80, n = 72;  // 552,960 multiply-adds: the kernel's
  auto layouts = [&](int64_t rows, int64_t cols) {
    return std::vector<at::Tensor>{
        at::randn({rows, cols}, gen),
        at::randn({cols, rows}, gen).t(),
        at::randn({rows, cols + 5}, gen).narrow(1, 2, cols),
        at::randn({cols + 3, rows}, gen).narrow(0, 1, cols).t(),
    };
  };
  for (const at::Tensor& a : layouts(m, k)) {
    for (const at::Tensor& b : layouts(k, n)) {
      for (auto [alpha, beta] : {std::pair{1.0, 0.0}, std::pair{0.5, 1.0}}) {
        at::Tensor wide = at::randn({m, n + 4}, gen);
        at::Tensor out = wide.narrow(1, 1, n);
        const at::Tensor before = out.to(at::kDouble);
        auto outside = [&] { return at::cat({wide.narrow(1, 0, 1), wide.narrow(1, n + 1, 3)}, 1); };
        const at::Tensor outside_before = outside().clone();
        kernels::MatmulOut(out, a, b, alpha, beta);
        const at::Tensor want =
            at::matmul(a.to(at::kDouble), b.to(at::kDouble)).mul_(alpha).add_(before, beta);
        EXPECT_LE((out.to(at::kDouble) - want).abs().max().item<double>(),
                  1e-5 * want.abs().max().item<double>())
            << a.strides() << " " << b.strides() << " " << alpha << " " << beta;
        // Columns outside the view are untouched.
        EXPECT_TRUE(at::equal(outside(), outside_before));
      }
    }
  }
  // Small products and other dtypes go to ATen with the same result.
  const at::Tensor a = at::randn({4, 3}, gen, at::kDouble), b = at::randn({3, 5}, gen, at::kDouble);
  EXPECT_TRUE(at::allclose(kernels::Matmul(a, b), at::mm(a, b)));
}

// Attention's products: heads' slices of the projections (strided) and a transposed key,
// forward and backward against at::matmul.
TEST(MatmulOpTest, BatchedMatmulMatchesATenForwardAndBackward) {
  at::Generator gen = Generator(11);
  const int64_t batch = 2, heads = 3, seq = 64, dim = 64;  // 64^3 per head: the kernel's
  const at::Tensor q_base = at::randn({batch, seq, heads, dim}, gen);
  const at::Tensor k_base = at::randn({batch, seq, heads, dim}, gen);
  const at::Tensor q = q_base.clone().requires_grad_(true);
  const at::Tensor k = k_base.clone().requires_grad_(true);
  const at::Tensor q_ref = q_base.clone().requires_grad_(true);
  const at::Tensor k_ref = k_base.clone().requires_grad_(true);
  const at::Tensor scores =
      kernels::BatchedMatmul(q.transpose(1, 2), k.transpose(1, 2).transpose(-2, -1));
  const at::Tensor want =
      at::matmul(q_ref.transpose(1, 2), k_ref.transpose(1, 2).transpose(-2, -1));
  ASSERT_EQ(scores.sizes(), want.sizes());
  EXPECT_LE((scores - want).abs().max().item<float>(), 1e-5 * want.abs().max().item<float>());
  const at::Tensor g = at::randn(want.sizes(), gen);
  scores.backward(g);
  want.backward(g);
  for (auto [got, ref] : {std::pair{q.grad(), q_ref.grad()}, std::pair{k.grad(), k_ref.grad()}}) {
    EXPECT_LE((got - ref).abs().max().item<float>(), 1e-5 * ref.abs().max().item<float>());
  }
}

// A bf16 job's attention on a CPU that multiplies bfloat16: a, b and the incoming gradient
// rounded to bfloat16 for the products, float32 sums; exact otherwise (or with bf16 off).
TEST(MatmulOpTest, BatchedMatmulInBFloat16RoundsItsOperands) {
  at::Generator gen = Generator(12);
  const int64_t batch = 2, heads = 3, seq = 64, dim = 64;
  const at::Tensor q = at::randn({batch, seq, heads, dim}, gen).requires_grad_(true);
  const at::Tensor k = at::randn({batch, seq, heads, dim}, gen).requires_grad_(true);
  const at::Tensor a = q.transpose(1, 2), b = k.transpose(1, 2).transpose(-2, -1);
  const at::Tensor scores = kernels::BatchedMatmul(a, b, /*bf16=*/true);
  const at::Tensor g = at::randn(scores.sizes(), gen);
  scores.backward(g);
  // Saving a as it is (keep_a) rounds it again in backward: the same gradients.
  const at::Tensor q2 = q.detach().clone().requires_grad_(true);
  const at::Tensor k2 = k.detach().clone().requires_grad_(true);
  kernels::BatchedMatmul(q2.transpose(1, 2), k2.transpose(1, 2).transpose(-2, -1), true, true)
      .backward(g);
  EXPECT_TRUE(at::equal(q.grad(), q2.grad()));
  EXPECT_TRUE(at::equal(k.grad(), k2.grad()));
  const bool native = NativeBFloat16Products();
  auto r = [native](const at::Tensor& t) {  // the operand as the products see it, in float64
    return (native ? t.detach().to(at::kBFloat16) : t.detach()).to(at::kDouble);
  };
  const at::Tensor want = at::matmul(r(a), r(b));
  const at::Tensor want_q = at::matmul(r(g), r(b).transpose(-2, -1)).transpose(1, 2);
  const at::Tensor want_k =
      at::matmul(r(a).transpose(-2, -1), r(g)).transpose(-2, -1).transpose(1, 2);
  for (auto [got, ref] :
       {std::pair{scores, want}, std::pair{q.grad(), want_q}, std::pair{k.grad(), want_k}}) {
    EXPECT_LE((got.to(at::kDouble) - ref).abs().max().item<double>(),
              1e-5 * ref.abs().max().item<double>());
  }
  if (native) {  // the rounding is there
    const at::Tensor exact = at::matmul(a.detach().to(at::kDouble), b.detach().to(at::kDouble));
    EXPECT_GT((scores.to(at::kDouble) - exact).abs().max().item<double>(),
              1e-4 * exact.abs().max().item<double>());
  }
}

}  // namespace
}  // namespace lathe::kernels::cpu
