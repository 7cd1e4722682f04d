// The fused linear cross-entropy (kernels/ops, kernels/cpu) against the unfused libtorch
// composition computed in float64 on the same random inputs: the loss and every gradient.
#include "kernels/ops/linear_cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/linear_cross_entropy.h"
#include "kernels/cpu/matmul.h"
#include "kernels/linear_cross_entropy_problem.h"
#include "kernels/ops/torch_compat.h"
#include "tests/kernels/kernel_test_util.h"

namespace lathe::kernels {
namespace {

using ::testing::HasSubstr;
using testing::RelErr;
using testing::Tolerance;

struct Inputs {
  at::Tensor hidden;   // [N, H], float32 or bfloat16
  at::Tensor weight;   // [V, H]
  at::Tensor targets;  // [N] int64
};

// Logits of standard deviation about 3, so that the softmax is far from uniform; every
// `ignore_every`-th target (from the first) is ignore_index (0: none).
Inputs RandomInputs(int64_t tokens, int64_t hidden_size, int64_t vocab, at::ScalarType dtype,
                    int64_t ignore_every, int64_t ignore_index = -100, uint64_t seed = 1) {
  at::manual_seed(seed);
  Inputs in;
  in.hidden = at::randn({tokens, hidden_size}).to(dtype);
  in.weight = (at::randn({vocab, hidden_size}) * (3.0 / std::sqrt(hidden_size))).to(dtype);
  in.targets = at::randint(vocab, {tokens}, at::kLong);
  if (ignore_every > 0) {
    for (int64_t i = 0; i < tokens; i += ignore_every) in.targets[i] = ignore_index;
  }
  return in;
}

struct Result {
  double loss = 0.0;
  at::Tensor grad_hidden;  // undefined when not requested
  at::Tensor grad_weight;
};

// The unfused composition in float64 (from the inputs' exact values).
Result Reference(const Inputs& in, const LinearCrossEntropyOptions& options, bool grad_hidden,
                 bool grad_weight) {
  at::Tensor hidden = in.hidden.to(at::kDouble).detach().requires_grad_(grad_hidden);
  at::Tensor weight = in.weight.to(at::kDouble).detach().requires_grad_(grad_weight);
  at::Tensor logits = at::matmul(hidden, weight.t());
  if (options.softcap > 0) logits = options.softcap * at::tanh(logits / options.softcap);
  const at::Tensor valid = in.targets.ne(options.ignore_index);
  at::Tensor loss =
      at::cross_entropy_loss(logits, in.targets, {}, at::Reduction::Sum, options.ignore_index);
  loss = loss +
         options.z_loss_weight * (at::logsumexp(logits, {1}).pow(2) * valid.to(at::kDouble)).sum();
  if (options.reduction == LinearCrossEntropyReduction::kMean) {
    loss = loss / std::max<int64_t>(valid.sum().item<int64_t>(), 1);
  }
  if (grad_hidden || grad_weight) loss.backward();
  Result result;
  result.loss = loss.item<double>();
  if (grad_hidden) result.grad_hidden = hidden.grad();
  if (grad_weight) result.grad_weight = weight.grad();
  return result;
}

// The gradients are those of loss * grad_output (backward scales what it computed).
Result Fused(const Inputs& in, const LinearCrossEntropyOptions& options, bool grad_hidden,
             bool grad_weight, double grad_output = 1.0) {
  at::Tensor hidden = in.hidden.detach().requires_grad_(grad_hidden);
  at::Tensor weight = in.weight.detach().requires_grad_(grad_weight);
  at::Tensor loss = LinearCrossEntropy(hidden, weight, in.targets, options);
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  EXPECT_EQ(loss.dim(), 0);
  if (grad_hidden || grad_weight) (loss * grad_output).backward();
  Result result;
  result.loss = loss.item<double>();
  if (grad_hidden) result.grad_hidden = hidden.grad();
  if (grad_weight) result.grad_weight = weight.grad();
  return result;
}

// Checks the op, with the hidden gradient computed in forward and in backward, against the
// float64 reference.
void ExpectMatchesReference(const Inputs& in, LinearCrossEntropyOptions options,
                            bool grad_hidden = true, bool grad_weight = true,
                            double grad_output = 1.0) {
  // The loss's log-sum-exp and the hidden gradient sum over the vocabulary, the weight
  // gradient over the tokens.
  const at::ScalarType type = in.hidden.scalar_type();
  const int64_t tokens = in.hidden.size(0), vocab = in.weight.size(0);
  Result expected = Reference(in, options, grad_hidden, grad_weight);
  if (grad_hidden) expected.grad_hidden *= grad_output;
  if (grad_weight) expected.grad_weight *= grad_output;
  for (const bool in_forward : {true, false}) {
    SCOPED_TRACE(in_forward ? "hidden gradient in forward" : "hidden gradient in backward");
    options.gradient_in_forward = in_forward;
    const Result actual = Fused(in, options, grad_hidden, grad_weight, grad_output);
    EXPECT_LT(RelErr(actual.loss, expected.loss), Tolerance(type, vocab))
        << "loss " << actual.loss << " vs " << expected.loss;
    ASSERT_EQ(actual.grad_hidden.defined(), grad_hidden);
    ASSERT_EQ(actual.grad_weight.defined(), grad_weight);
    if (grad_hidden) {
      EXPECT_EQ(actual.grad_hidden.scalar_type(), in.hidden.scalar_type());
      EXPECT_LT(RelErr(actual.grad_hidden, expected.grad_hidden), Tolerance(type, vocab));
    }
    if (grad_weight) {
      EXPECT_EQ(actual.grad_weight.scalar_type(), in.weight.scalar_type());
      EXPECT_LT(RelErr(actual.grad_weight, expected.grad_weight), Tolerance(type, tokens));
    }
  }
}

LinearCrossEntropyOptions Chunked(int64_t tokens, int64_t vocab) {
  LinearCrossEntropyOptions options;
  options.token_chunk = tokens;
  options.vocab_chunk = vocab;
  return options;
}

TEST(LinearCrossEntropyTest, MatchesReferenceWithOddVocabAndHidden) {
  ExpectMatchesReference(RandomInputs(37, 65, 32003, at::kFloat, 5), {});
}

TEST(LinearCrossEntropyTest, BackwardScalesByTheIncomingGradient) {
  const Inputs in = RandomInputs(37, 65, 3001, at::kFloat, 5);
  ExpectMatchesReference(in, {}, true, true, /*grad_output=*/-2.5);
  LinearCrossEntropyOptions mean = Chunked(8, 1000);
  mean.reduction = LinearCrossEntropyReduction::kMean;
  ExpectMatchesReference(in, mean, true, false, /*grad_output=*/0.25);
}

// Token chunks with the whole vocabulary: both gradients in forward, in one pass (float32,
// weight trains).
TEST(LinearCrossEntropyTest, SinglePassWithTokenChunksThatDoNotDivide) {
  const Inputs in = RandomInputs(37, 65, 3001, at::kFloat, 5);
  ExpectMatchesReference(in, Chunked(7, 0));
  ExpectMatchesReference(in, Chunked(1, 0));
  // The default budget holds 131 tokens of a 32003 vocabulary: three chunks.
  ExpectMatchesReference(RandomInputs(300, 33, 32003, at::kFloat, 5), {});
}

TEST(LinearCrossEntropyTest, SinglePassSoftCapZLossMeanAndFrozenHidden) {
  const Inputs in = RandomInputs(37, 65, 3001, at::kFloat, 5);
  LinearCrossEntropyOptions options = Chunked(10, 0);
  options.softcap = 4.0;
  ExpectMatchesReference(in, options);
  options.z_loss_weight = 1e-2;
  ExpectMatchesReference(in, options);
  options.reduction = LinearCrossEntropyReduction::kMean;
  ExpectMatchesReference(in, options, true, true, /*grad_output=*/3.0);
  ExpectMatchesReference(in, options, /*grad_hidden=*/false, /*grad_weight=*/true);
}

TEST(LinearCrossEntropyTest, MatchesReferenceWithChunksThatDoNotDivide) {
  const Inputs in = RandomInputs(37, 65, 32003, at::kFloat, 5);
  ExpectMatchesReference(in, Chunked(7, 1000));
  ExpectMatchesReference(in, Chunked(1, 32002));
  ExpectMatchesReference(in, Chunked(36, 3));
}

TEST(LinearCrossEntropyTest, MatchesReferenceWithChunksFromASmallBudget) {
  const Inputs in = RandomInputs(300, 65, 5003, at::kFloat, 3);
  LinearCrossEntropyOptions options;
  options.memory_budget_bytes = 200 << 10;
  ExpectMatchesReference(in, options);
}

TEST(LinearCrossEntropyTest, MeanReduction) {
  LinearCrossEntropyOptions options = Chunked(16, 777);
  options.reduction = LinearCrossEntropyReduction::kMean;
  ExpectMatchesReference(RandomInputs(50, 65, 3001, at::kFloat, 4), options);
}

TEST(LinearCrossEntropyTest, SoftCap) {
  LinearCrossEntropyOptions options = Chunked(9, 1000);
  options.softcap = 4.0;
  ExpectMatchesReference(RandomInputs(37, 65, 32003, at::kFloat, 5), options);
}

TEST(LinearCrossEntropyTest, ZLoss) {
  LinearCrossEntropyOptions options = Chunked(9, 1000);
  options.z_loss_weight = 1e-2;
  ExpectMatchesReference(RandomInputs(37, 65, 32003, at::kFloat, 5), options);
}

TEST(LinearCrossEntropyTest, SoftCapZLossAndMeanTogether) {
  LinearCrossEntropyOptions options = Chunked(5, 333);
  options.softcap = 10.0;
  options.z_loss_weight = 1e-3;
  options.reduction = LinearCrossEntropyReduction::kMean;
  ExpectMatchesReference(RandomInputs(23, 48, 2000, at::kFloat, 6), options);
}

TEST(LinearCrossEntropyTest, SingleToken) {
  ExpectMatchesReference(RandomInputs(1, 65, 32003, at::kFloat, 0), {});
  ExpectMatchesReference(RandomInputs(1, 65, 32003, at::kFloat, 0), Chunked(1, 4096));
}

TEST(LinearCrossEntropyTest, OtherIgnoreIndex) {
  LinearCrossEntropyOptions options = Chunked(8, 500);
  options.ignore_index = 7;  // a valid vocabulary entry, treated as ignored
  ExpectMatchesReference(RandomInputs(40, 32, 1000, at::kFloat, 3, 7), options);
}

TEST(LinearCrossEntropyTest, AllTokensIgnoredGiveZeroLossAndZeroGradients) {
  for (LinearCrossEntropyReduction reduction :
       {LinearCrossEntropyReduction::kSum, LinearCrossEntropyReduction::kMean}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      for (const bool in_forward : {true, false}) {
        LinearCrossEntropyOptions options = Chunked(4, 300);
        options.reduction = reduction;
        options.gradient_in_forward = in_forward;
        const Result result = Fused(RandomInputs(10, 16, 1000, dtype, 1), options, true, true);
        EXPECT_EQ(result.loss, 0.0);
        EXPECT_TRUE(result.grad_hidden.eq(0).all().item<bool>());
        EXPECT_TRUE(result.grad_weight.eq(0).all().item<bool>());
      }
    }
  }
}

TEST(LinearCrossEntropyTest, FrozenWeightGetsNoGradient) {
  ExpectMatchesReference(RandomInputs(37, 65, 3001, at::kFloat, 5), Chunked(10, 1000),
                         /*grad_hidden=*/true, /*grad_weight=*/false);
}

TEST(LinearCrossEntropyTest, FrozenHiddenGetsNoGradient) {
  ExpectMatchesReference(RandomInputs(37, 65, 3001, at::kFloat, 5), Chunked(10, 1000),
                         /*grad_hidden=*/false, /*grad_weight=*/true);
}

TEST(LinearCrossEntropyTest, BFloat16) {
  const Inputs in = RandomInputs(37, 65, 32003, at::kBFloat16, 5);
  ExpectMatchesReference(in, {});                // one vocabulary chunk
  ExpectMatchesReference(in, Chunked(7, 1000));  // several
  LinearCrossEntropyOptions options = Chunked(7, 1000);
  options.softcap = 4.0;
  options.z_loss_weight = 1e-3;
  ExpectMatchesReference(in, options);
  ExpectMatchesReference(in, Chunked(7, 1000), /*grad_hidden=*/true, /*grad_weight=*/false);
}

TEST(LinearCrossEntropyTest, NonContiguousInputs) {
  const Inputs in = RandomInputs(30, 40, 500, at::kFloat, 4);
  Inputs strided;
  strided.hidden = in.hidden.t().contiguous().t();  // column-major view of the same values
  strided.weight = in.weight.t().contiguous().t();
  strided.targets = in.targets;
  ASSERT_FALSE(strided.hidden.is_contiguous());
  ExpectMatchesReference(strided, Chunked(7, 99));
}

TEST(LinearCrossEntropyTest, ForwardWithoutGradient) {
  const Inputs in = RandomInputs(37, 65, 3001, at::kFloat, 5);
  const at::NoGradGuard no_grad;
  const double loss = LinearCrossEntropy(in.hidden, in.weight, in.targets).item<double>();
  EXPECT_LT(RelErr(loss, Reference(in, {}, false, false).loss), Tolerance(at::kFloat, 3001));
}

TEST(LinearCrossEntropyTest, RejectsBadInputs) {
  const Inputs in = RandomInputs(4, 8, 10, at::kFloat, 0);
  auto message = [](auto&& call) {
    try {
      call();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  at::Tensor bad_targets = in.targets.clone();
  bad_targets[1] = 10;
  EXPECT_THAT(message([&] { LinearCrossEntropy(in.hidden, in.weight, bad_targets); }),
              HasSubstr("every target must be -100 (ignored) or in [0, 10)"));
  EXPECT_THAT(
      message([&] { LinearCrossEntropy(in.hidden.to(at::kBFloat16), in.weight, in.targets); }),
      HasSubstr("must both be float32 or both bfloat16 (or float32 hidden with a bfloat16 "
                "weight), got BFloat16 and Float"));
  EXPECT_THAT(message([&] {
                LinearCrossEntropy(in.hidden, in.weight.to(at::kBFloat16).requires_grad_(),
                                   in.targets);
              }),
              HasSubstr("a bfloat16 weight with float32 hidden must not require grad"));
  EXPECT_THAT(
      message([&] { LinearCrossEntropy(in.hidden, in.weight.narrow(1, 0, 7), in.targets); }),
      HasSubstr("weight must be [vocab, 8]"));
  EXPECT_THAT(
      message([&] { LinearCrossEntropy(in.hidden, in.weight, in.targets.narrow(0, 0, 3)); }),
      HasSubstr("targets must be [4]"));
  LinearCrossEntropyOptions options;
  options.softcap = -1.0;
  EXPECT_THAT(message([&] { LinearCrossEntropy(in.hidden, in.weight, in.targets, options); }),
              HasSubstr("softcap must be >= 0"));
}

TEST(LinearCrossEntropyChunksTest, WorkspaceFitsTheBudget) {
  LinearCrossEntropyProblem problem;
  problem.tokens = 2048;
  problem.hidden_size = 1024;
  problem.vocab = 32000;
  for (LinearCrossEntropyDtype dtype :
       {LinearCrossEntropyDtype::kFloat32, LinearCrossEntropyDtype::kBFloat16}) {
    problem.dtype = dtype;
    // bfloat16 adds float32 copies of the rows and gradient sums: 16 MiB is too little.
    for (int64_t budget : {int64_t{16} << 20, int64_t{64} << 20, int64_t{1} << 30}) {
      if (dtype == LinearCrossEntropyDtype::kBFloat16 && budget == int64_t{16} << 20) continue;
      auto bytes = [&](const LinearCrossEntropyChunks& c) {
        return cpu::LinearCrossEntropyBackwardWorkspaceBytes(problem, c, true, true);
      };
      const LinearCrossEntropyChunks chunks =
          ChooseLinearCrossEntropyChunks(problem, budget, bytes);
      EXPECT_LE(bytes(chunks), budget) << budget;
      EXPECT_GE(chunks.vocab, 1024) << budget;
      EXPECT_GE(chunks.tokens, 64) << budget;
      EXPECT_LE(chunks.tokens, problem.tokens);
      EXPECT_LE(chunks.vocab, problem.vocab);
    }
  }
}

TEST(LinearCrossEntropyChunksTest, EverythingFitsInOneChunk) {
  LinearCrossEntropyProblem problem;
  problem.tokens = 2048;
  problem.hidden_size = 1024;
  problem.vocab = 32000;
  problem.dtype = LinearCrossEntropyDtype::kBFloat16;
  const LinearCrossEntropyChunks all = ChooseLinearCrossEntropyChunks(
      problem, int64_t{1} << 40, [&](const LinearCrossEntropyChunks& c) {
        return cpu::LinearCrossEntropyBackwardWorkspaceBytes(problem, c, true, true);
      });
  EXPECT_EQ(all.tokens, problem.tokens);
  EXPECT_EQ(all.vocab, problem.vocab);
}

TEST(LinearCrossEntropyChunksTest, TooSmallABudgetGivesTheSmallestSensibleChunks) {
  LinearCrossEntropyProblem problem;
  problem.tokens = 2048;
  problem.hidden_size = 1024;
  problem.vocab = 32000;
  const LinearCrossEntropyChunks chunks =
      ChooseLinearCrossEntropyChunks(problem, 100 << 10, [&](const LinearCrossEntropyChunks& c) {
        return cpu::LinearCrossEntropyForwardWorkspaceBytes(problem, c, false);
      });
  EXPECT_EQ(chunks.tokens, 64);
  EXPECT_EQ(chunks.vocab, 1024);
}

// The raw kernel writes every element of its outputs: they start as NaN.
class RawKernelTest : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(RawKernelTest, WritesEveryOutputElement) {
  const at::ScalarType dtype = GetParam();
  // Tokens 3..5 (the second token chunk) are all ignored: that chunk is skipped.
  Inputs in = RandomInputs(10, 24, 700, dtype, 4);
  for (int64_t i = 3; i < 6; ++i) in.targets[i] = -100;
  LinearCrossEntropyOptions options;
  options.softcap = 6.0;
  options.z_loss_weight = 1e-3;
  const Result expected = Reference(in, options, true, true);

  LinearCrossEntropyProblem problem;
  problem.tokens = 10;
  problem.hidden_size = 24;
  problem.vocab = 700;
  problem.dtype = dtype == at::kBFloat16 ? LinearCrossEntropyDtype::kBFloat16
                                         : LinearCrossEntropyDtype::kFloat32;
  problem.softcap = 6.0f;
  problem.z_loss_weight = 1e-3f;
  // Several vocabulary chunks, then one (bfloat16 finishes the hidden gradient per chunk).
  for (const LinearCrossEntropyChunks chunks :
       {LinearCrossEntropyChunks{3, 300}, LinearCrossEntropyChunks{3, 700}}) {
    SCOPED_TRACE(chunks.vocab);
    // Sums over the vocabulary (700: the loss, the hidden gradient) and the tokens (10).
    const double tolerance = Tolerance(dtype, 700);
    const int64_t workspace_bytes =
        std::max(cpu::LinearCrossEntropyForwardWorkspaceBytes(problem, chunks, true),
                 cpu::LinearCrossEntropyBackwardWorkspaceBytes(problem, chunks, true, true));
    at::Tensor workspace = at::full({workspace_bytes / 4}, NAN, at::kFloat);

    // Forward, the loss only, then with the hidden gradient.
    at::Tensor lse = at::full({10}, NAN, at::kFloat);
    double loss = cpu::LinearCrossEntropyForward(
        problem, chunks, in.hidden.data_ptr(), in.targets.data_ptr<int64_t>(), in.weight.data_ptr(),
        1.0f, lse.data_ptr<float>(), nullptr, workspace.data_ptr(), cpu::SerialFor);
    EXPECT_LT(RelErr(loss, expected.loss), Tolerance(at::kFloat, 700));
    EXPECT_TRUE(lse.isfinite().all().item<bool>());
    at::Tensor forward_grad_hidden = at::full_like(in.hidden, NAN);
    lse.fill_(NAN);
    workspace.fill_(NAN);
    loss = cpu::LinearCrossEntropyForward(
        problem, chunks, in.hidden.data_ptr(), in.targets.data_ptr<int64_t>(), in.weight.data_ptr(),
        1.0f, lse.data_ptr<float>(), forward_grad_hidden.data_ptr(), workspace.data_ptr(),
        cpu::SerialFor);
    EXPECT_LT(RelErr(loss, expected.loss), Tolerance(at::kFloat, 700));
    EXPECT_TRUE(lse.isfinite().all().item<bool>());
    EXPECT_TRUE(forward_grad_hidden.isfinite().all().item<bool>());
    EXPECT_LT(RelErr(forward_grad_hidden, expected.grad_hidden), tolerance);
    EXPECT_TRUE(forward_grad_hidden.narrow(0, 3, 3).eq(0).all().item<bool>());

    // Backward, both gradients.
    at::Tensor grad_hidden = at::full_like(in.hidden, NAN);
    at::Tensor grad_weight = at::full_like(in.weight, NAN);
    workspace.fill_(NAN);
    cpu::LinearCrossEntropyBackward(problem, chunks, in.hidden.data_ptr(),
                                    in.targets.data_ptr<int64_t>(), in.weight.data_ptr(),
                                    lse.data_ptr<float>(), 1.0f, grad_hidden.data_ptr(),
                                    grad_weight.data_ptr(), workspace.data_ptr(), cpu::SerialFor);
    EXPECT_TRUE(grad_hidden.isfinite().all().item<bool>());
    EXPECT_TRUE(grad_weight.isfinite().all().item<bool>());
    EXPECT_LT(RelErr(grad_hidden, expected.grad_hidden), tolerance);
    EXPECT_LT(RelErr(grad_weight, expected.grad_weight), Tolerance(dtype, 10));
    EXPECT_TRUE(grad_hidden.narrow(0, 3, 3).eq(0).all().item<bool>());
  }
}

TEST(RawSinglePassKernelTest, WritesEveryOutputElement) {
  Inputs in = RandomInputs(10, 24, 700, at::kFloat, 4);
  for (int64_t i = 3; i < 6; ++i) in.targets[i] = -100;  // the second chunk: skipped
  LinearCrossEntropyProblem problem;
  problem.tokens = 10;
  problem.hidden_size = 24;
  problem.vocab = 700;
  problem.z_loss_weight = 1e-3f;
  for (const float softcap : {0.0f, 6.0f}) {
    SCOPED_TRACE(softcap);
    problem.softcap = softcap;
    LinearCrossEntropyOptions options;
    options.softcap = softcap;
    options.z_loss_weight = 1e-3;
    const Result expected = Reference(in, options, true, true);
    at::Tensor workspace = at::full(
        {cpu::LinearCrossEntropySinglePassWorkspaceBytes(problem, 3) / 4}, NAN, at::kFloat);
    at::Tensor lse = at::full({10}, NAN, at::kFloat);
    at::Tensor grad_hidden = at::full_like(in.hidden, NAN);
    at::Tensor grad_weight = at::full_like(in.weight, NAN);
    const double loss = cpu::LinearCrossEntropySinglePass(
        problem, 3, in.hidden.data_ptr(), in.targets.data_ptr<int64_t>(), in.weight.data_ptr(),
        1.0f, lse.data_ptr<float>(), grad_hidden.data_ptr(), grad_weight.data_ptr(),
        workspace.data_ptr(), cpu::SerialFor);
    EXPECT_LT(RelErr(loss, expected.loss), Tolerance(at::kFloat, 700));
    EXPECT_TRUE(lse.isfinite().all().item<bool>());
    EXPECT_LT(RelErr(grad_hidden, expected.grad_hidden), Tolerance(at::kFloat, 700));
    EXPECT_LT(RelErr(grad_weight, expected.grad_weight), Tolerance(at::kFloat, 10));
    EXPECT_TRUE(grad_hidden.narrow(0, 3, 3).eq(0).all().item<bool>());
  }
}

// Float32 hidden with a frozen bfloat16 weight. Where the CPU multiplies bfloat16 natively the
// products see bf16(hidden) and bf16(gradient tile); with LATHE_CPU_BF16=0
// (kernels_bf16_fallback_test) or on other CPUs, hidden and the widened weight as they are.

// The inputs with the weight rounded to bfloat16.
Inputs WithBFloat16Weight(Inputs in) {
  in.weight = in.weight.to(at::kBFloat16);
  return in;
}

// The reference's inputs: hidden as the products see it (the weight is exact either way).
Inputs AsMultiplied(Inputs in) {
  if (cpu::NativeBFloat16Products()) in.hidden = in.hidden.to(at::kBFloat16).to(at::kFloat);
  return in;
}

// The hidden gradient's tolerance. Rounding the gradient tile to bfloat16 (relative error up
// to 2^-9 per element) gave normwise relative errors up to 2.6e-3 in these tests (backward
// with soft-cap, z-loss and mean; up to 3e-4 where forward forms the gradient, which subtracts
// the target's weight row outside the products); bfloat16's 1e-2 is about 4x that. Without
// the rounding: up to 3.9e-6, under float32's 1e-5; the sum over the vocabulary adds its own.
double BFloat16WeightGradientTolerance(int64_t vocab) {
  return cpu::NativeBFloat16Products() ? Tolerance(at::kBFloat16, vocab)
                                       : Tolerance(at::kFloat, vocab);
}

// The op, its hidden gradient in forward and in backward, against the float64 reference of
// what the products multiply.
void ExpectBFloat16WeightMatchesReference(const Inputs& in, LinearCrossEntropyOptions options,
                                          double grad_output = 1.0) {
  ASSERT_EQ(in.hidden.scalar_type(), at::kFloat);
  ASSERT_EQ(in.weight.scalar_type(), at::kBFloat16);
  Result expected = Reference(AsMultiplied(in), options, true, false);
  expected.grad_hidden *= grad_output;
  for (const bool in_forward : {true, false}) {
    SCOPED_TRACE(in_forward ? "hidden gradient in forward" : "hidden gradient in backward");
    options.gradient_in_forward = in_forward;
    const Result actual = Fused(in, options, true, false, grad_output);
    const int64_t vocab = in.weight.size(0);
    EXPECT_LT(RelErr(actual.loss, expected.loss), Tolerance(at::kFloat, vocab))
        << "loss " << actual.loss << " vs " << expected.loss;
    ASSERT_TRUE(actual.grad_hidden.defined());
    EXPECT_EQ(actual.grad_hidden.scalar_type(), at::kFloat);
    EXPECT_LT(RelErr(actual.grad_hidden, expected.grad_hidden),
              BFloat16WeightGradientTolerance(vocab));
  }
}

TEST(LinearCrossEntropyBFloat16WeightTest, MatchesReferenceWithChunksThatDoNotDivide) {
  const Inputs in = WithBFloat16Weight(RandomInputs(37, 65, 32003, at::kFloat, 5));
  for (const LinearCrossEntropyOptions& options :
       {LinearCrossEntropyOptions{}, Chunked(7, 1000), Chunked(1, 32002), Chunked(36, 3)}) {
    SCOPED_TRACE(std::to_string(options.token_chunk) + " x " + std::to_string(options.vocab_chunk));
    ExpectBFloat16WeightMatchesReference(in, options);
  }
}

TEST(LinearCrossEntropyBFloat16WeightTest, SoftCapZLossAndMean) {
  const Inputs in = WithBFloat16Weight(RandomInputs(37, 65, 32003, at::kFloat, 5));
  LinearCrossEntropyOptions options = Chunked(9, 1000);
  options.softcap = 4.0;
  ExpectBFloat16WeightMatchesReference(in, options);
  options.softcap = 0.0;
  options.z_loss_weight = 1e-2;
  ExpectBFloat16WeightMatchesReference(in, options);
  options = Chunked(5, 333);
  options.softcap = 10.0;
  options.z_loss_weight = 1e-3;
  options.reduction = LinearCrossEntropyReduction::kMean;
  ExpectBFloat16WeightMatchesReference(in, options, /*grad_output=*/-2.5);
}

TEST(LinearCrossEntropyBFloat16WeightTest, OtherIgnoreIndexAndSingleToken) {
  LinearCrossEntropyOptions options = Chunked(8, 500);
  options.ignore_index = 7;
  ExpectBFloat16WeightMatchesReference(
      WithBFloat16Weight(RandomInputs(40, 32, 1000, at::kFloat, 3, 7)), options);
  ExpectBFloat16WeightMatchesReference(
      WithBFloat16Weight(RandomInputs(1, 65, 32003, at::kFloat, 0)), {});
}

TEST(LinearCrossEntropyBFloat16WeightTest, ForwardWithoutGradient) {
  const Inputs in = WithBFloat16Weight(RandomInputs(37, 65, 3001, at::kFloat, 5));
  const at::NoGradGuard no_grad;
  const double loss = LinearCrossEntropy(in.hidden, in.weight, in.targets).item<double>();
  EXPECT_LT(RelErr(loss, Reference(AsMultiplied(in), {}, false, false).loss),
            Tolerance(at::kFloat, 3001));
}

// The raw kernel writes every element of its outputs (they start as NaN) and stays within the
// workspace it reports (the guard after it keeps its value).
TEST(LinearCrossEntropyBFloat16WeightTest, RawKernelWritesEveryOutputWithinItsWorkspace) {
  // Tokens 3..5 (the second token chunk) are all ignored: that chunk is skipped.
  Inputs in = WithBFloat16Weight(RandomInputs(10, 24, 700, at::kFloat, 4));
  for (int64_t i = 3; i < 6; ++i) in.targets[i] = -100;
  LinearCrossEntropyOptions options;
  options.softcap = 6.0;
  options.z_loss_weight = 1e-3;
  const Result expected = Reference(AsMultiplied(in), options, true, false);

  LinearCrossEntropyProblem problem;
  problem.tokens = 10;
  problem.hidden_size = 24;
  problem.vocab = 700;
  problem.dtype = LinearCrossEntropyDtype::kFloat32HiddenBFloat16Weight;
  problem.softcap = 6.0f;
  problem.z_loss_weight = 1e-3f;
  constexpr int64_t kGuardFloats = 64;
  for (const LinearCrossEntropyChunks chunks :
       {LinearCrossEntropyChunks{3, 300}, LinearCrossEntropyChunks{3, 700},
        LinearCrossEntropyChunks{10, 7}}) {
    SCOPED_TRACE(std::to_string(chunks.tokens) + " x " + std::to_string(chunks.vocab));
    const int64_t forward_bytes =
        cpu::LinearCrossEntropyForwardWorkspaceBytes(problem, chunks, true);
    const int64_t backward_bytes =
        cpu::LinearCrossEntropyBackwardWorkspaceBytes(problem, chunks, true, false);
    at::Tensor workspace =
        at::full({std::max(forward_bytes, backward_bytes) / 4 + kGuardFloats}, NAN, at::kFloat);
    constexpr float kGuard = -7.0f;
    auto guard = [&](int64_t bytes) {
      return workspace.narrow(0, bytes / 4, workspace.numel() - bytes / 4);
    };
    auto poison = [&](int64_t bytes) {
      workspace.fill_(NAN);
      guard(bytes).fill_(kGuard);
    };
    auto guard_intact = [&](int64_t bytes) { return guard(bytes).eq(kGuard).all().item<bool>(); };

    // Forward, the loss only, then with the hidden gradient.
    at::Tensor lse = at::full({10}, NAN, at::kFloat);
    poison(cpu::LinearCrossEntropyForwardWorkspaceBytes(problem, chunks, false));
    double loss = cpu::LinearCrossEntropyForward(
        problem, chunks, in.hidden.data_ptr(), in.targets.data_ptr<int64_t>(), in.weight.data_ptr(),
        1.0f, lse.data_ptr<float>(), nullptr, workspace.data_ptr(), cpu::SerialFor);
    EXPECT_TRUE(guard_intact(cpu::LinearCrossEntropyForwardWorkspaceBytes(problem, chunks, false)));
    EXPECT_LT(RelErr(loss, expected.loss), Tolerance(at::kFloat, 700));
    EXPECT_TRUE(lse.isfinite().all().item<bool>());
    at::Tensor forward_grad_hidden = at::full_like(in.hidden, NAN);
    lse.fill_(NAN);
    poison(forward_bytes);
    loss = cpu::LinearCrossEntropyForward(
        problem, chunks, in.hidden.data_ptr(), in.targets.data_ptr<int64_t>(), in.weight.data_ptr(),
        1.0f, lse.data_ptr<float>(), forward_grad_hidden.data_ptr(), workspace.data_ptr(),
        cpu::SerialFor);
    EXPECT_TRUE(guard_intact(forward_bytes));
    EXPECT_LT(RelErr(loss, expected.loss), Tolerance(at::kFloat, 700));
    EXPECT_TRUE(lse.isfinite().all().item<bool>());
    EXPECT_LT(RelErr(forward_grad_hidden, expected.grad_hidden),
              BFloat16WeightGradientTolerance(700));
    EXPECT_TRUE(forward_grad_hidden.narrow(0, 3, 3).eq(0).all().item<bool>());

    // Backward, the hidden gradient.
    at::Tensor grad_hidden = at::full_like(in.hidden, NAN);
    poison(backward_bytes);
    cpu::LinearCrossEntropyBackward(problem, chunks, in.hidden.data_ptr(),
                                    in.targets.data_ptr<int64_t>(), in.weight.data_ptr(),
                                    lse.data_ptr<float>(), 1.0f, grad_hidden.data_ptr(), nullptr,
                                    workspace.data_ptr(), cpu::SerialFor);
    EXPECT_TRUE(guard_intact(backward_bytes));
    EXPECT_LT(RelErr(grad_hidden, expected.grad_hidden), BFloat16WeightGradientTolerance(700));
    EXPECT_TRUE(grad_hidden.narrow(0, 3, 3).eq(0).all().item<bool>());
  }
}

// The workspace holds either way's stages (native products: hidden rows and the gradient tile
// in bfloat16; otherwise the weight rows in float32), so it is larger than float32's by the
// larger of the two, and the default budget still gives full-speed chunks.
TEST(LinearCrossEntropyBFloat16WeightTest, WorkspaceFitsTheBudget) {
  LinearCrossEntropyProblem problem;
  problem.tokens = 2048;
  problem.hidden_size = 1024;
  problem.vocab = 32000;
  LinearCrossEntropyProblem float32 = problem;
  problem.dtype = LinearCrossEntropyDtype::kFloat32HiddenBFloat16Weight;
  const LinearCrossEntropyChunks chunks{512, 2048};
  const int64_t tn = 512, tv = 2048, h = 1024;
  EXPECT_EQ(cpu::LinearCrossEntropyForwardWorkspaceBytes(problem, chunks, true),
            cpu::LinearCrossEntropyForwardWorkspaceBytes(float32, chunks, true) +
                std::max(2 * tn * h + 2 * tn * tv, 4 * tv * h));
  EXPECT_EQ(cpu::LinearCrossEntropyBackwardWorkspaceBytes(problem, chunks, true, false),
            cpu::LinearCrossEntropyBackwardWorkspaceBytes(float32, chunks, true, false) +
                std::max(2 * tn * h + 2 * tn * tv, 4 * tv * h));
  EXPECT_EQ(cpu::LinearCrossEntropyForwardWorkspaceBytes(problem, chunks, false),
            cpu::LinearCrossEntropyForwardWorkspaceBytes(float32, chunks, false) +
                std::max(2 * tn * h, 4 * tv * h));
  const int64_t budget = kDefaultLinearCrossEntropyBudgetBytes;
  for (const bool forward : {true, false}) {
    auto bytes = [&](const LinearCrossEntropyChunks& c) {
      return forward ? cpu::LinearCrossEntropyForwardWorkspaceBytes(problem, c, true)
                     : cpu::LinearCrossEntropyBackwardWorkspaceBytes(problem, c, true, false);
    };
    const LinearCrossEntropyChunks chosen = ChooseLinearCrossEntropyChunks(problem, budget, bytes);
    EXPECT_LE(bytes(chosen), budget) << forward;
    EXPECT_GE(chosen.vocab, 1024) << forward;
    EXPECT_GE(chosen.tokens, 64) << forward;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, RawKernelTest, ::testing::Values(at::kFloat, at::kBFloat16),
                         [](const ::testing::TestParamInfo<at::ScalarType>& param_info) {
                           return std::string(param_info.param == at::kFloat ? "Float32"
                                                                             : "BFloat16");
                         });

}  // namespace
}  // namespace lathe::kernels
