#include "kernels/ops/lora_linear.h"

#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/dropout.h"
#include "kernels/cpu/matmul.h"
#include "kernels/ops/dropout.h"
#include "kernels/ops/unfused.h"
#include "tests/kernels/kernel_test_util.h"

namespace lathe {
namespace {

using testing::FreshSeed;
using testing::Randn;
using testing::RelErr;
using testing::Tolerance;

struct LoraCase {
  std::vector<int64_t> x_shape;  // [..., in]
  int64_t out;
  int64_t rank;  // 0: no LoRA, W trainable (full fine-tuning)
  at::ScalarType x_type;
  at::ScalarType weight_type;
  bool bias;
  double dropout;
};

std::string Name(const LoraCase& c) {
  std::string name;
  for (int64_t d : c.x_shape) name += std::to_string(d) + "x";
  name += "out" + std::to_string(c.out) + "_r" + std::to_string(c.rank) + "_" +
          c10::toString(c.x_type) + "_w" + c10::toString(c.weight_type);
  if (c.bias) name += "_bias";
  if (c.dropout > 0) name += "_dropout" + std::to_string(int(c.dropout * 100));
  return name;
}

class LoraLinearTest : public ::testing::TestWithParam<LoraCase> {};

TEST_P(LoraLinearTest, ForwardAndGradientsMatchTheUnfusedCompositionInFloat64) {
  const LoraCase& c = GetParam();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  at::Generator gen = testing::Generator(seed);
  const int64_t in = c.x_shape.back();
  const bool lora = c.rank > 0;
  const double scale = 2.0;

  at::Tensor x = Randn(c.x_shape, c.x_type, gen).requires_grad_(true);
  at::Tensor weight = Randn({c.out, in}, c.weight_type, gen, 0.2).requires_grad_(!lora);
  at::Tensor bias;
  if (c.bias) bias = Randn({c.out}, c.weight_type, gen).requires_grad_(!lora);
  at::Tensor a, b;  // float32 masters; B random (not zero as at init) so every gradient flows
  if (lora) {
    a = Randn({c.rank, in}, at::kFloat, gen, 0.2).requires_grad_(true);
    b = Randn({c.out, c.rank}, at::kFloat, gen, 0.2).requires_grad_(true);
  }
  const uint64_t mask_seed = FreshSeed();

  at::Tensor y = kernels::LoraLinearWithSeed(x, weight, bias, a, b, scale, c.dropout, mask_seed);
  std::vector<int64_t> y_shape = c.x_shape;
  y_shape.back() = c.out;
  ASSERT_EQ(y.sizes(), at::IntArrayRef(y_shape));
  EXPECT_EQ(y.scalar_type(), c.x_type);
  const at::Tensor dy = Randn(y_shape, c.x_type, gen);
  y.backward(dy);

  // The unfused composition in float64 with the same mask (the op's mask of mask_seed,
  // scaled by 1 / (1 - p)).
  at::Tensor mask;
  if (c.dropout > 0) {
    mask = kernels::ApplyDropoutMask(at::ones(c.x_shape), c.dropout, mask_seed).to(at::kDouble);
  }
  auto leaf64 = [](const at::Tensor& t) {
    return t.defined() ? t.detach().to(at::kDouble).requires_grad_(true) : at::Tensor();
  };
  at::Tensor x64 = leaf64(x), w64 = leaf64(weight), b64 = leaf64(bias), a64 = leaf64(a),
             bb64 = leaf64(b);
  at::Tensor y64 = kernels::unfused::LoraLinear(x64, w64, b64, a64, bb64, scale, c.dropout,
                                                /*training=*/true, mask);
  y64.backward(dy.to(at::kDouble));

  const double tol = Tolerance(c.x_type);
  // A CPU that multiplies bfloat16 rounds x and dy to bfloat16 for the base product of a
  // bfloat16 W (NativeBFloat16BaseProducts below checks that exactly).
  const bool native = c.x_type == at::kFloat && c.weight_type == at::kBFloat16 &&
                      kernels::cpu::NativeBFloat16Products();
  const double base_tol = native ? Tolerance(at::kBFloat16) : tol;
  EXPECT_LT(RelErr(y, y64), base_tol);
  EXPECT_LT(RelErr(x.grad(), x64.grad()), base_tol);
  if (lora) {
    EXPECT_EQ(a.grad().scalar_type(), at::kFloat);
    EXPECT_LT(RelErr(a.grad(), a64.grad()), tol);
    EXPECT_LT(RelErr(b.grad(), bb64.grad()), tol);
    EXPECT_FALSE(weight.grad().defined());
  } else {
    EXPECT_EQ(weight.grad().scalar_type(), c.weight_type);
    EXPECT_LT(RelErr(weight.grad(), w64.grad()), tol);
    if (c.bias) {
      EXPECT_LT(RelErr(bias.grad(), b64.grad()), tol);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LoraLinearTest,
    ::testing::Values(
        LoraCase{{1, 65}, 33, 3, at::kFloat, at::kFloat, false, 0.0},  // a single token
        LoraCase{{7, 65}, 33, 3, at::kFloat, at::kFloat, true, 0.0},
        LoraCase{{7, 65}, 33, 3, at::kFloat, at::kFloat, true, 0.3},
        LoraCase{{2, 5, 64}, 96, 16, at::kFloat, at::kFloat, false, 0.1},
        LoraCase{{2, 5, 64}, 96, 16, at::kFloat, at::kBFloat16, true, 0.1},  // CPU bf16
        LoraCase{{7, 65}, 33, 3, at::kFloat, at::kHalf, false, 0.0},         // CPU fp16
        LoraCase{{1, 65}, 33, 3, at::kBFloat16, at::kBFloat16, true, 0.3},   // CUDA-style bf16
        LoraCase{{2, 5, 64}, 96, 16, at::kBFloat16, at::kBFloat16, false, 0.0},
        LoraCase{{7, 65}, 33, 0, at::kFloat, at::kFloat, true, 0.0},  // full fine-tuning
        LoraCase{{1, 65}, 33, 0, at::kFloat, at::kFloat, false, 0.0},
        LoraCase{{7, 65}, 33, 0, at::kBFloat16, at::kFloat, true, 0.0}),
    [](const ::testing::TestParamInfo<LoraCase>& case_info) { return Name(case_info.param); });

// On a CPU that multiplies bfloat16, a frozen bfloat16 W with float32 x: y = bf16(x) W^T + b
// + s x A^T B^T and dx = bf16(dy) W + s (dy B) A, with float32 sums (checked in float64 from
// the bf16-rounded operands); with LATHE_CPU_BF16=0 or on other CPUs W is widened instead
// (the test above).
TEST(LoraLinearOpTest, NativeBFloat16BaseProducts) {
  if (!kernels::cpu::NativeBFloat16Products()) {
    GTEST_SKIP() << "no native bfloat16 products here: " << kernels::cpu::MatmulBackend();
  }
  at::Generator gen = testing::Generator(3);
  const int64_t tokens = 96, in = 80, out = 72, rank = 4;  // above the kernel's 64^3
  const double scale = 2.0;
  const at::Tensor x = Randn({tokens, in}, at::kFloat, gen).requires_grad_(true);
  const at::Tensor weight = Randn({out, in}, at::kBFloat16, gen, 0.2);
  const at::Tensor bias = Randn({out}, at::kBFloat16, gen);
  const at::Tensor a = Randn({rank, in}, at::kFloat, gen, 0.2).requires_grad_(true);
  const at::Tensor b = Randn({out, rank}, at::kFloat, gen, 0.2).requires_grad_(true);
  const at::Tensor y = kernels::LoraLinearWithSeed(x, weight, bias, a, b, scale, 0.0, 1);
  const at::Tensor dy = Randn({tokens, out}, at::kFloat, gen);
  y.backward(dy);

  auto d = [](const at::Tensor& t) { return t.detach().to(at::kDouble); };
  auto bf16 = [&](const at::Tensor& t) { return d(t.to(at::kBFloat16)); };
  const at::Tensor want_y = at::matmul(bf16(x), d(weight).t()) + d(bias) +
                            at::matmul(at::matmul(d(x), d(a).t()), d(b).t()) * scale;
  const at::Tensor want_dx =
      at::matmul(bf16(dy), d(weight)) + at::matmul(at::matmul(d(dy), d(b)), d(a)) * scale;
  EXPECT_LT(RelErr(y, want_y), 1e-5);
  EXPECT_LT(RelErr(x.grad(), want_dx), 1e-5);
}

// The same job with an adapter large enough for the kernel: its products run bfloat16 too,
// each operand rounded as autograd would hand it to a rounding product (x, A, x A^T, B, and in
// backward s dy, d(x A^T)), float32 sums. Checked in float64 from the rounded operands; the
// intermediates (x A^T, d(x A^T)) are rounded from float64 here and from float32 there, which
// can move an element near a rounding boundary by one bfloat16 step (hence 1e-4, not 1e-5).
TEST(LoraLinearOpTest, NativeBFloat16AdapterProducts) {
  if (!kernels::cpu::NativeBFloat16Products()) {
    GTEST_SKIP() << "no native bfloat16 products here: " << kernels::cpu::MatmulBackend();
  }
  at::Generator gen = testing::Generator(4);
  // x A^T: 256 x 16 x 128 and (x A^T) B^T: 256 x 96 x 16 multiply-adds, both above 64^3.
  const int64_t tokens = 256, in = 128, out = 96, rank = 16;
  const double scale = 2.0;
  const at::Tensor x = Randn({tokens, in}, at::kFloat, gen).requires_grad_(true);
  const at::Tensor weight = Randn({out, in}, at::kBFloat16, gen, 0.2);
  const at::Tensor a = Randn({rank, in}, at::kFloat, gen, 0.2).requires_grad_(true);
  const at::Tensor b = Randn({out, rank}, at::kFloat, gen, 0.2).requires_grad_(true);
  const at::Tensor y = kernels::LoraLinearWithSeed(x, weight, {}, a, b, scale, 0.0, 1);
  const at::Tensor dy = Randn({tokens, out}, at::kFloat, gen);
  y.backward(dy);

  auto d = [](const at::Tensor& t) { return t.detach().to(at::kDouble); };
  auto r = [](const at::Tensor& t) {  // rounded to bfloat16 (through float32), in float64
    return t.detach().to(at::kFloat).to(at::kBFloat16).to(at::kDouble);
  };
  const at::Tensor xa = at::matmul(r(x), r(a).t());
  const at::Tensor want_y = at::matmul(r(x), d(weight).t()) + at::matmul(r(xa), r(b).t()) * scale;
  const at::Tensor dys = r(d(dy) * scale);
  const at::Tensor dxa = at::matmul(dys, r(b));
  const at::Tensor want_db = at::matmul(dys.t(), r(xa));
  const at::Tensor want_da = at::matmul(r(dxa).t(), r(x));
  const at::Tensor want_dx = at::matmul(r(dy), d(weight)) + at::matmul(r(dxa), r(a));
  EXPECT_LT(RelErr(y, want_y), 1e-4);
  EXPECT_LT(RelErr(x.grad(), want_dx), 1e-4);
  EXPECT_LT(RelErr(a.grad(), want_da), 1e-4);
  EXPECT_LT(RelErr(b.grad(), want_db), 1e-4);
  // And they are rounded: float32 products of the unrounded values are further away.
  const at::Tensor exact_db = at::matmul(d(dy).t() * scale, at::matmul(d(x), d(a).t()));
  EXPECT_GT(RelErr(b.grad(), exact_db), 1e-3);
}

TEST(LoraLinearOpTest, TrainingDrawsOneMaskPerCallAndEvalNone) {
  at::Generator data = testing::Generator(FreshSeed());
  at::Tensor x = Randn({9, 40}, at::kFloat, data);
  at::Tensor w = Randn({24, 40}, at::kFloat, data);
  at::Tensor a = Randn({4, 40}, at::kFloat, data);
  at::Tensor b = Randn({24, 4}, at::kFloat, data);
  const uint64_t seed = FreshSeed();
  at::Generator g1 = testing::Generator(seed), g2 = testing::Generator(seed);
  at::Tensor y1 = kernels::LoraLinear(x, w, {}, a, b, 1.0, 0.5, true, g1);
  at::Tensor y2 = kernels::LoraLinear(x, w, {}, a, b, 1.0, 0.5, true, g2);
  EXPECT_TRUE(at::equal(y1, y2)) << "same generator state, same mask";
  at::Tensor y3 = kernels::LoraLinear(x, w, {}, a, b, 1.0, 0.5, true, g1);
  EXPECT_FALSE(at::equal(y1, y3)) << "the next call draws another mask";
  at::Tensor eval = kernels::LoraLinear(x, w, {}, a, b, 1.0, 0.5, /*training=*/false, g1);
  EXPECT_TRUE(at::allclose(eval, kernels::LoraLinearWithSeed(x, w, {}, a, b, 1.0, 0.0, 0)));
  // The seed is the generator's next 64-bit number.
  at::Generator g3 = testing::Generator(seed);
  EXPECT_TRUE(at::equal(
      y1, kernels::LoraLinearWithSeed(x, w, {}, a, b, 1.0, 0.5, kernels::DrawDropoutSeed(g3))));
}

TEST(LoraLinearOpTest, RejectsMismatchedShapes) {
  at::Tensor x = at::ones({2, 8});
  EXPECT_THROW(kernels::LoraLinearWithSeed(x, at::ones({4, 7}), {}, {}, {}, 1.0, 0.0, 0),
               c10::Error);
  EXPECT_THROW(kernels::LoraLinearWithSeed(x, at::ones({4, 8}), {}, at::ones({2, 8}),
                                           at::ones({4, 3}), 1.0, 0.0, 0),
               c10::Error);
  EXPECT_THROW(
      kernels::LoraLinearWithSeed(x, at::ones({4, 8}), {}, at::ones({2, 8}), {}, 1.0, 0.0, 0),
      c10::Error);
}

TEST(DropoutMaskTest, KeepsAboutOneMinusPScaledAndDependsOnTheSeed) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  for (double p : {0.1, 0.5, 0.9}) {
    at::Tensor mask = kernels::ApplyDropoutMask(at::ones({500, 401}), p, seed);
    const double kept = mask.ne(0).to(at::kDouble).mean().item<double>();
    // 200500 Bernoulli draws: 5 standard deviations is under 0.006.
    EXPECT_NEAR(kept, 1 - p, 0.006) << "p " << p;
    at::Tensor values = std::get<0>(at::_unique(mask));
    ASSERT_EQ(values.numel(), 2);
    EXPECT_FLOAT_EQ(values[1].item<float>(), static_cast<float>(1 / (1 - p)));
    // Rows and columns are not correlated: every row and every column keeps some.
    EXPECT_TRUE(mask.ne(0).any(0).all().item<bool>());
    EXPECT_TRUE(mask.ne(0).any(1).all().item<bool>());
    EXPECT_TRUE(at::equal(mask, kernels::ApplyDropoutMask(at::ones({500, 401}), p, seed)));
    EXPECT_FALSE(at::equal(mask, kernels::ApplyDropoutMask(at::ones({500, 401}), p, seed + 1)));
  }
  at::Tensor none = kernels::ApplyDropoutMask(at::ones({3, 5}), 0.0, seed);
  EXPECT_TRUE(at::equal(none, at::ones({3, 5})));
}

template <typename T>
class DropoutKernelTest : public ::testing::Test {};
TYPED_TEST_SUITE(DropoutKernelTest, testing::KernelElementTypes, testing::KernelElementTypeNames);

TYPED_TEST(DropoutKernelTest, WritesEveryElement) {
  using T = TypeParam;
  const int64_t rows = 4, cols = 29;
  std::mt19937_64 rng(FreshSeed());
  const std::vector<T> x = testing::RandomVector<T>(rows * cols, rng);
  std::vector<T> y = testing::Poisoned<T>(rows * cols);
  kernels::cpu::Dropout(x.data(), 42, 0.4, cols, 0, 1, y.data());
  kernels::cpu::Dropout(x.data(), 42, 0.4, cols, 1, rows, y.data());
  EXPECT_EQ(testing::FirstNonFinite(y), -1);
}

}  // namespace
}  // namespace lathe
