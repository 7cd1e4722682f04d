#include "kernels/ops/rope.h"

#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/rope.h"
#include "kernels/ops/unfused.h"
#include "tests/kernels/kernel_test_util.h"

namespace lathe {
namespace {

using testing::FreshSeed;
using testing::Randn;
using testing::RelErr;
using testing::Tolerance;

struct RopeCase {
  int64_t batch, heads, seq, head_dim;
  at::ScalarType type;
  // x as the attention sees it: the projection's [batch, seq, heads, head_dim] output
  // transposed to [batch, heads, seq, head_dim] (true), or a contiguous
  // [batch, heads, seq, head_dim] tensor.
  bool transposed_view;
  // Random tables (the two halves differ) instead of RoPE's cos/sin: the kernels must compute
  // exactly x * cos + rotate_half(x) * sin and its transpose for any tables.
  bool random_tables;
};

std::string Name(const RopeCase& c) {
  return "b" + std::to_string(c.batch) + "h" + std::to_string(c.heads) + "s" +
         std::to_string(c.seq) + "d" + std::to_string(c.head_dim) + "_" + c10::toString(c.type) +
         (c.transposed_view ? "_bshd" : "_bhsd") + (c.random_tables ? "_random_tables" : "");
}

// cos and sin [seq, head_dim] (float32) as CausalLm::RopeTables builds them.
std::pair<at::Tensor, at::Tensor> RopeTables(int64_t seq, int64_t head_dim) {
  at::Tensor exponents = at::arange(0, head_dim, 2, at::kLong).to(at::kFloat) / double(head_dim);
  at::Tensor inv_freq = 1.0 / at::pow(10000.0, exponents);
  at::Tensor freqs = at::outer(at::arange(seq, at::kFloat), inv_freq);
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos(), emb.sin()};
}

class RopeTest : public ::testing::TestWithParam<RopeCase> {};

TEST_P(RopeTest, ForwardAndGradientMatchTheUnfusedCompositionInFloat64) {
  const RopeCase& c = GetParam();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  at::Generator gen = testing::Generator(seed);
  at::Tensor x;
  if (c.transposed_view) {
    x = Randn({c.batch, c.seq, c.heads, c.head_dim}, c.type, gen).transpose(1, 2);
  } else {
    x = Randn({c.batch, c.heads, c.seq, c.head_dim}, c.type, gen);
  }
  x.requires_grad_(true);
  auto [cos, sin] = RopeTables(c.seq, c.head_dim);
  if (c.random_tables) {
    cos = at::randn({c.seq, c.head_dim}, gen, at::kFloat);
    sin = at::randn({c.seq, c.head_dim}, gen, at::kFloat);
  }

  at::Tensor y = kernels::Rope(x, cos, sin);
  EXPECT_EQ(y.strides(), x.strides()) << "the output keeps x's layout";
  const at::Tensor dy = Randn(y.sizes(), c.type, gen);
  y.backward(dy);

  // The reference sees the tables as the op does: rounded to x's dtype.
  at::Tensor x64 = x.detach().to(at::kDouble).requires_grad_(true);
  at::Tensor y64 =
      kernels::unfused::Rope(x64, cos.to(c.type).to(at::kDouble), sin.to(c.type).to(at::kDouble));
  y64.backward(dy.to(at::kDouble));

  const double tol = Tolerance(c.type);
  EXPECT_LT(RelErr(y, y64), tol);
  EXPECT_LT(RelErr(x.grad(), x64.grad()), tol);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RopeTest,
    ::testing::Values(RopeCase{1, 1, 1, 2, at::kFloat, false, false},  // a single token
                      RopeCase{2, 3, 5, 6, at::kFloat, false, false},  // head_dim 6: not 2^k
                      RopeCase{2, 3, 5, 6, at::kFloat, true, false},
                      RopeCase{2, 3, 5, 6, at::kFloat, true, true},
                      RopeCase{1, 4, 33, 96, at::kFloat, true, false},
                      RopeCase{2, 16, 64, 64, at::kFloat, true, true},  // threads split rows
                      RopeCase{2, 3, 5, 6, at::kBFloat16, true, false},
                      RopeCase{1, 4, 33, 96, at::kBFloat16, false, true},
                      RopeCase{2, 3, 5, 6, at::kHalf, true, true}),
    [](const ::testing::TestParamInfo<RopeCase>& case_info) { return Name(case_info.param); });

TEST(RopeOpTest, ApplyRopeRotatesQueriesAndKeysAlike) {
  at::Generator gen = testing::Generator(FreshSeed());
  at::Tensor q = Randn({1, 4, 7, 8}, at::kFloat, gen);
  at::Tensor k = Randn({1, 2, 7, 8}, at::kFloat, gen);  // fewer key heads (GQA)
  auto [cos, sin] = RopeTables(7, 8);
  auto [rq, rk] = kernels::ApplyRope(q, k, cos, sin);
  EXPECT_LT(RelErr(rq, kernels::unfused::Rope(q, cos, sin)), 1e-6);
  EXPECT_LT(RelErr(rk, kernels::unfused::Rope(k, cos, sin)), 1e-6);
}

TEST(RopeOpTest, BackwardIsTheInverseRotation) {
  // With RoPE's tables the map is a rotation: backward(forward(x)) == x.
  at::Generator gen = testing::Generator(FreshSeed());
  at::Tensor x = Randn({2, 3, 11, 10}, at::kFloat, gen).requires_grad_(true);
  auto [cos, sin] = RopeTables(11, 10);
  at::Tensor y = kernels::Rope(x, cos, sin);
  at::Tensor grad = torch::autograd::grad({y}, {x}, {y.detach()})[0];
  EXPECT_LT(RelErr(grad, x.detach()), 1e-6);
}

TEST(RopeOpTest, RejectsAnOddHeadDimAndMismatchedTables) {
  EXPECT_THROW(kernels::Rope(at::ones({1, 1, 2, 5}), at::ones({2, 5}), at::ones({2, 5})),
               c10::Error);
  EXPECT_THROW(kernels::Rope(at::ones({1, 1, 2, 4}), at::ones({3, 4}), at::ones({3, 4})),
               c10::Error);
}

template <typename T>
class RopeKernelTest : public ::testing::Test {};
TYPED_TEST_SUITE(RopeKernelTest, testing::KernelElementTypes, testing::KernelElementTypeNames);

TYPED_TEST(RopeKernelTest, WritesEveryElement) {
  using T = TypeParam;
  // A [batch, seq, heads, head_dim] buffer read as [batch, heads, seq, head_dim].
  kernels::RopeLayout layout;
  layout.batch = 2;
  layout.heads = 3;
  layout.seq = 4;
  layout.head_dim = 6;
  layout.seq_stride = layout.heads * layout.head_dim;
  layout.head_stride = layout.head_dim;
  layout.batch_stride = layout.seq * layout.seq_stride;
  const int64_t n = layout.rows() * layout.head_dim;
  std::mt19937_64 rng(FreshSeed());
  const std::vector<T> x = testing::RandomVector<T>(n, rng);
  const std::vector<T> cos = testing::RandomVector<T>(layout.seq * layout.head_dim, rng);
  const std::vector<T> sin = testing::RandomVector<T>(layout.seq * layout.head_dim, rng);
  std::vector<T> y = testing::Poisoned<T>(n);
  std::vector<T> dx = testing::Poisoned<T>(n);
  const int64_t mid = layout.rows() / 3;
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, mid}, {mid, layout.rows()}}) {
    kernels::cpu::RopeForward(x.data(), cos.data(), sin.data(), layout, begin, end, y.data());
    kernels::cpu::RopeBackward(x.data(), cos.data(), sin.data(), layout, begin, end, dx.data());
  }
  EXPECT_EQ(testing::FirstNonFinite(y), -1);
  EXPECT_EQ(testing::FirstNonFinite(dx), -1);
}

}  // namespace
}  // namespace lathe
