#include "kernels/ops/swiglu.h"

#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/swiglu.h"
#include "kernels/ops/unfused.h"
#include "tests/kernels/kernel_test_util.h"

namespace lathe {
namespace {

using testing::FreshSeed;
using testing::Randn;
using testing::RelErr;
using testing::Tolerance;

struct SwiGluCase {
  std::vector<int64_t> shape;
  at::ScalarType type;
  // gate and up as the two halves of one [..., 2 * inter] tensor: not contiguous.
  bool halves_of_one_tensor;
};

std::string Name(const SwiGluCase& c) {
  std::string name;
  for (int64_t d : c.shape) name += std::to_string(d) + "x";
  return name + std::string(c10::toString(c.type)) + (c.halves_of_one_tensor ? "_halves" : "");
}

using GluOp = at::Tensor (*)(const at::Tensor& gate, const at::Tensor& up);

// The fused op against its unfused composition in float64, within the dtype's tolerance, for
// gates into the activation's tails (scale 3).
void ExpectMatchesUnfusedInFloat64(const SwiGluCase& c, GluOp fused, GluOp unfused) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  at::Generator gen = testing::Generator(seed);
  at::Tensor gate, up;
  if (c.halves_of_one_tensor) {
    std::vector<int64_t> both = c.shape;
    both.back() *= 2;
    std::vector<at::Tensor> halves = Randn(both, c.type, gen, 3.0).chunk(2, -1);
    gate = halves[0].requires_grad_(true);
    up = halves[1].requires_grad_(true);
  } else {
    gate = Randn(c.shape, c.type, gen, 3.0).requires_grad_(true);
    up = Randn(c.shape, c.type, gen).requires_grad_(true);
  }
  at::Tensor y = fused(gate, up);
  const at::Tensor dy = Randn(c.shape, c.type, gen);
  y.backward(dy);

  at::Tensor gate64 = gate.detach().to(at::kDouble).requires_grad_(true);
  at::Tensor up64 = up.detach().to(at::kDouble).requires_grad_(true);
  at::Tensor y64 = unfused(gate64, up64);
  y64.backward(dy.to(at::kDouble));

  const double tol = Tolerance(c.type);
  EXPECT_LT(RelErr(y, y64), tol);
  EXPECT_LT(RelErr(gate.grad(), gate64.grad()), tol);
  EXPECT_LT(RelErr(up.grad(), up64.grad()), tol);
}

// Gates far into the activation's tails give finite outputs and gradients, as float64 does.
void ExpectExtremeGatesStayFinite(const at::Tensor& gates, GluOp fused, GluOp unfused) {
  at::Tensor gate = gates.clone().requires_grad_(true);
  at::Tensor up = at::ones_like(gate).requires_grad_(true);
  at::Tensor y = fused(gate, up);
  y.backward(at::ones_like(y));
  at::Tensor gate64 = gate.detach().to(at::kDouble).requires_grad_(true);
  at::Tensor up64 = up.detach().to(at::kDouble).requires_grad_(true);
  at::Tensor y64 = unfused(gate64, up64);
  y64.backward(at::ones_like(y64));
  EXPECT_TRUE(at::isfinite(y).all().item<bool>()) << y;
  EXPECT_TRUE(at::isfinite(gate.grad()).all().item<bool>()) << gate.grad();
  EXPECT_LT(RelErr(y, y64), 1e-6);
  EXPECT_LT(RelErr(gate.grad(), gate64.grad()), 1e-6);
  EXPECT_LT(RelErr(up.grad(), up64.grad()), 1e-6);
}

class SwiGluTest : public ::testing::TestWithParam<SwiGluCase> {};

TEST_P(SwiGluTest, ForwardAndGradientsMatchTheUnfusedCompositionInFloat64) {
  ExpectMatchesUnfusedInFloat64(GetParam(), kernels::SwiGlu, kernels::unfused::SwiGlu);
}

// Gemma's GeGLU: the fused op against at::gelu(gate, "tanh") * up in float64, within the
// dtype's tolerance (the same cases as SwiGLU's), gates into the tanh's tails.
TEST_P(SwiGluTest, GeGluForwardAndGradientsMatchTheUnfusedCompositionInFloat64) {
  ExpectMatchesUnfusedInFloat64(GetParam(), kernels::GeGlu, kernels::unfused::GeGlu);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SwiGluTest,
    ::testing::Values(SwiGluCase{{1, 1}, at::kFloat, false}, SwiGluCase{{1, 65}, at::kFloat, false},
                      SwiGluCase{{7, 65}, at::kFloat, true},
                      SwiGluCase{{2, 33, 352}, at::kFloat, false},  // threads split rows
                      SwiGluCase{{7, 65}, at::kBFloat16, false},
                      SwiGluCase{{2, 33, 352}, at::kBFloat16, true},
                      SwiGluCase{{7, 65}, at::kHalf, false}),
    [](const ::testing::TestParamInfo<SwiGluCase>& case_info) { return Name(case_info.param); });

TEST(SwiGluOpTest, ExtremeGatesStayFinite) {
  ExpectExtremeGatesStayFinite(
      at::tensor({-1e4f, -100.0f, -88.5f, -20.0f, 0.0f, 20.0f, 88.5f, 100.0f, 1e4f}),
      kernels::SwiGlu, kernels::unfused::SwiGlu);
}

TEST(SwiGluOpTest, GeGluExtremeGatesStayFinite) {
  ExpectExtremeGatesStayFinite(at::tensor({-1e4f, -100.0f, -88.5f, -20.0f, -3.0f, 0.0f, 1e-3f, 3.0f,
                                           20.0f, 88.5f, 100.0f, 1e4f}),
                               kernels::GeGlu, kernels::unfused::GeGlu);
}

TEST(SwiGluOpTest, RejectsMismatchedShapes) {
  EXPECT_THROW(kernels::SwiGlu(at::ones({2, 3}), at::ones({2, 4})), c10::Error);
}

template <typename T>
class SwiGluKernelTest : public ::testing::Test {};
TYPED_TEST_SUITE(SwiGluKernelTest, testing::KernelElementTypes, testing::KernelElementTypeNames);

// The kernel pair writes every element of its outputs, over row ranges that split the rows.
template <typename T, typename Forward, typename Backward>
void ExpectWritesEveryElement(Forward forward, Backward backward) {
  const int64_t rows = 3, cols = 37;
  std::mt19937_64 rng(FreshSeed());
  const std::vector<T> gate = testing::RandomVector<T>(rows * cols, rng, 4.0f);
  const std::vector<T> up = testing::RandomVector<T>(rows * cols, rng);
  const std::vector<T> dy = testing::RandomVector<T>(rows * cols, rng);
  std::vector<T> y = testing::Poisoned<T>(rows * cols);
  std::vector<T> dgate = testing::Poisoned<T>(rows * cols);
  std::vector<T> dup = testing::Poisoned<T>(rows * cols);
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, 1}, {1, rows}}) {
    forward(gate.data(), up.data(), cols, begin, end, y.data());
    backward(dy.data(), gate.data(), up.data(), cols, begin, end, dgate.data(), dup.data());
  }
  EXPECT_EQ(testing::FirstNonFinite(y), -1);
  EXPECT_EQ(testing::FirstNonFinite(dgate), -1);
  EXPECT_EQ(testing::FirstNonFinite(dup), -1);
}

TYPED_TEST(SwiGluKernelTest, WritesEveryElement) {
  using T = TypeParam;
  ExpectWritesEveryElement<T>(kernels::cpu::SwiGluForward<T>, kernels::cpu::SwiGluBackward<T>);
}

TYPED_TEST(SwiGluKernelTest, GeGluWritesEveryElement) {
  using T = TypeParam;
  ExpectWritesEveryElement<T>(kernels::cpu::GeGluForward<T>, kernels::cpu::GeGluBackward<T>);
}

}  // namespace
}  // namespace lathe
