#include "kernels/ops/rms_norm.h"

#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/ops/unfused.h"
#include "tests/kernels/kernel_test_util.h"

namespace lathe {
namespace {

using testing::FreshSeed;
using testing::Randn;
using testing::RelErr;
using testing::Tolerance;

struct RmsNormCase {
  std::vector<int64_t> shape;  // x's; the last dimension is hidden
  at::ScalarType x_type;
  at::ScalarType weight_type;
  bool weight_trainable;
};

std::string Name(const RmsNormCase& c) {
  std::string name;
  for (int64_t d : c.shape) name += std::to_string(d) + "x";
  return name + std::string(c10::toString(c.x_type)) + "_w" + c10::toString(c.weight_type) +
         (c.weight_trainable ? "_trainable" : "_frozen");
}

class RmsNormTest : public ::testing::TestWithParam<RmsNormCase> {};

TEST_P(RmsNormTest, ForwardAndGradientsMatchTheUnfusedCompositionInFloat64) {
  const RmsNormCase& c = GetParam();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  at::Generator gen = testing::Generator(seed);
  const int64_t hidden = c.shape.back();
  const double eps = 1e-6;
  at::Tensor x = Randn(c.shape, c.x_type, gen, 2.0).requires_grad_(true);
  at::Tensor weight = (1.0 + 0.2 * at::randn({hidden}, gen, at::kDouble)).to(c.weight_type);
  weight.set_requires_grad(c.weight_trainable);

  at::Tensor y = kernels::RmsNorm(x, weight, eps);
  const at::Tensor dy = Randn(c.shape, c.x_type, gen);
  y.backward(dy);

  at::Tensor x64 = x.detach().to(at::kDouble).requires_grad_(true);
  at::Tensor w64 = weight.detach().to(at::kDouble).requires_grad_(true);
  at::Tensor y64 = kernels::unfused::RmsNorm(x64, w64, eps);
  y64.backward(dy.to(at::kDouble));

  const double tol = Tolerance(c.x_type);
  EXPECT_EQ(y.scalar_type(), c.x_type);
  EXPECT_LT(RelErr(y, y64), tol);
  EXPECT_LT(RelErr(x.grad(), x64.grad()), tol);
  if (c.weight_trainable) {
    ASSERT_TRUE(weight.grad().defined());
    EXPECT_EQ(weight.grad().scalar_type(), c.weight_type);
    EXPECT_LT(RelErr(weight.grad(), w64.grad()), tol);
  } else {
    EXPECT_FALSE(weight.grad().defined());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RmsNormTest,
    ::testing::Values(
        RmsNormCase{{1, 65}, at::kFloat, at::kFloat, true},  // a single token, odd hidden
        RmsNormCase{{7, 65}, at::kFloat, at::kFloat, true},
        RmsNormCase{{2, 9, 1024}, at::kFloat, at::kFloat, true},  // many rows: threads split them
        RmsNormCase{{300, 96}, at::kFloat, at::kFloat, true},
        RmsNormCase{{5, 64}, at::kFloat, at::kBFloat16, false},  // CPU bf16: frozen bf16 norm
        RmsNormCase{{3, 2}, at::kFloat, at::kFloat, true},
        RmsNormCase{{1, 65}, at::kBFloat16, at::kFloat, true},
        RmsNormCase{{2, 9, 1024}, at::kBFloat16, at::kFloat, true},
        RmsNormCase{{7, 65}, at::kBFloat16, at::kBFloat16, false},
        RmsNormCase{{7, 65}, at::kHalf, at::kFloat, true}),
    [](const ::testing::TestParamInfo<RmsNormCase>& case_info) { return Name(case_info.param); });

TEST(RmsNormOpTest, NonContiguousInputIsHandled) {
  at::Generator gen = testing::Generator(FreshSeed());
  at::Tensor base = Randn({65, 8}, at::kFloat, gen);
  at::Tensor x = base.t().requires_grad_(false);  // [8, 65], not contiguous
  at::Tensor weight = Randn({65}, at::kFloat, gen);
  EXPECT_LT(RelErr(kernels::RmsNorm(x, weight, 1e-5), kernels::unfused::RmsNorm(x, weight, 1e-5)),
            1e-5);
}

TEST(RmsNormOpTest, RejectsAWeightOfTheWrongSize) {
  at::Tensor x = at::ones({2, 8});
  EXPECT_THROW(kernels::RmsNorm(x, at::ones({7}), 1e-6), c10::Error);
}

// Every element of every output is written: the buffers start as NaN, and the rows are
// processed in two ranges as two threads would.
template <typename T>
class RmsNormKernelTest : public ::testing::Test {};
TYPED_TEST_SUITE(RmsNormKernelTest, testing::KernelElementTypes, testing::KernelElementTypeNames);

TYPED_TEST(RmsNormKernelTest, WritesEveryElement) {
  using T = TypeParam;
  const int64_t rows = 5, hidden = 67;
  std::mt19937_64 rng(FreshSeed());
  const std::vector<T> x = testing::RandomVector<T>(rows * hidden, rng);
  const std::vector<T> dy = testing::RandomVector<T>(rows * hidden, rng);
  const std::vector<float> weight = testing::RandomVector<float>(hidden, rng);
  std::vector<T> y = testing::Poisoned<T>(rows * hidden);
  std::vector<float> rstd = testing::Poisoned<float>(rows);
  kernels::cpu::RmsNormForward(x.data(), weight.data(), hidden, 1e-6f, 0, 2, y.data(), rstd.data());
  kernels::cpu::RmsNormForward(x.data(), weight.data(), hidden, 1e-6f, 2, rows, y.data(),
                               rstd.data());
  EXPECT_EQ(testing::FirstNonFinite(y), -1);
  EXPECT_EQ(testing::FirstNonFinite(rstd), -1);

  std::vector<T> dx = testing::Poisoned<T>(rows * hidden);
  std::vector<float> dw = testing::Poisoned<float>(2 * hidden);
  kernels::cpu::RmsNormBackward(dy.data(), x.data(), weight.data(), rstd.data(), hidden, 0, 3,
                                dx.data(), dw.data());
  kernels::cpu::RmsNormBackward(dy.data(), x.data(), weight.data(), rstd.data(), hidden, 3, rows,
                                dx.data(), dw.data() + hidden);
  EXPECT_EQ(testing::FirstNonFinite(dx), -1);
  EXPECT_EQ(testing::FirstNonFinite(dw), -1);
}

}  // namespace
}  // namespace lathe
