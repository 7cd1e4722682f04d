// The fused ops of kernels/ops on CUDA tensors (label gpu): the path a CUDA training step takes
// through them (worker/engine/causal_lm.cc with fused kernels: RMSNorm, RoPE, SwiGLU, LoRA
// linear, the linear cross-entropy), each against the unfused composition
// (kernels/ops/unfused.h, or the cross-entropy of the full logits) computed in float64 on the
// CPU from the same inputs: forward and every gradient. kernels_cuda_test checks the raw CUDA
// kernels against the CPU kernels; this checks what the ops put around them (the dtype
// conversions, the strides, the saved tensors, the backward) and LoRA linear, which has no
// kernel of its own (its products are libtorch's, its dropout the CUDA kernel's mask). NF4 on
// CUDA is kernels_nf4_cuda_test's. Skips unless libtorch has CUDA and sees a device.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/ops/dropout.h"
#include "kernels/ops/linear_cross_entropy.h"
#include "kernels/ops/lora_linear.h"
#include "kernels/ops/rms_norm.h"
#include "kernels/ops/rope.h"
#include "kernels/ops/swiglu.h"
#include "kernels/ops/unfused.h"
#include "tests/kernels/kernel_test_util.h"

namespace lathe {
namespace {

using testing::FreshSeed;
using testing::Randn;
using testing::RelErr;
using testing::Tolerance;

const at::Device kCuda(at::kCUDA, 0);

class OpsCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "libtorch without CUDA, or no CUDA device";
    seed_ = FreshSeed();
  }
  uint64_t seed_ = 0;
};

// A CUDA copy of a CPU tensor, as a leaf that requires grad when asked.
at::Tensor OnCuda(const at::Tensor& t, bool requires_grad) {
  return t.detach().to(kCuda).requires_grad_(requires_grad);
}

// A float64 CPU copy of a tensor, as a leaf that requires grad when asked (undefined stays so).
at::Tensor Float64(const at::Tensor& t, bool requires_grad) {
  if (!t.defined()) return {};
  return t.detach().cpu().to(at::kDouble).requires_grad_(requires_grad);
}

// Every element of a CUDA result finite, on CUDA, in `type`, and within `tol` of the reference
// (normwise, RelErr).
void ExpectClose(const at::Tensor& got, const at::Tensor& want, at::ScalarType type, double tol,
                 const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << ": undefined";
  EXPECT_TRUE(got.is_cuda()) << what;
  EXPECT_EQ(got.scalar_type(), type) << what;
  const at::Tensor host = got.detach().cpu();
  EXPECT_TRUE(at::isfinite(host.to(at::kFloat)).all().item<bool>()) << what << ": not finite";
  EXPECT_LT(RelErr(host, want), tol) << what;
}

TEST_F(OpsCudaTest, RmsNormMatchesTheUnfusedComposition) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  at::Generator gen = testing::Generator(seed_);
  struct Case {
    std::vector<int64_t> shape;
    at::ScalarType x_type, weight_type;
    bool weight_trainable;
  };
  // bf16 x and a frozen bf16 weight: a bf16 LoRA job's norms on CUDA; a trainable float32
  // weight as full fine-tuning's masters; 4096 x 2048 rows: Llama 3.2 1B's hidden size.
  for (const Case& c : {Case{{7, 65}, at::kFloat, at::kFloat, true},
                        Case{{2, 9, 1024}, at::kBFloat16, at::kBFloat16, false},
                        Case{{2, 9, 1024}, at::kBFloat16, at::kFloat, true},
                        Case{{2, 2048, 2048}, at::kBFloat16, at::kBFloat16, false},
                        Case{{3, 65}, at::kHalf, at::kFloat, true}}) {
    SCOPED_TRACE(::testing::Message()
                 << at::IntArrayRef(c.shape) << " " << c.x_type << " weight " << c.weight_type);
    const double eps = 1e-5;
    const int64_t hidden = c.shape.back();
    const at::Tensor x0 = Randn(c.shape, c.x_type, gen, 2.0);
    const at::Tensor w0 = (1.0 + 0.2 * at::randn({hidden}, gen, at::kDouble)).to(c.weight_type);
    const at::Tensor dy0 = Randn(c.shape, c.x_type, gen);

    at::Tensor x = OnCuda(x0, true), w = OnCuda(w0, c.weight_trainable);
    at::Tensor y = kernels::RmsNorm(x, w, eps);
    y.backward(dy0.to(kCuda));

    at::Tensor x64 = Float64(x0, true), w64 = Float64(w0, true);
    at::Tensor y64 = kernels::unfused::RmsNorm(x64, w64, eps);
    y64.backward(dy0.to(at::kDouble));

    const double tol = Tolerance(c.x_type);
    ExpectClose(y, y64, c.x_type, tol, "y");
    ExpectClose(x.grad(), x64.grad(), c.x_type, tol, "dx");
    if (c.weight_trainable) {
      ExpectClose(w.grad(), w64.grad(), c.weight_type, Tolerance(c.x_type, x0.numel() / hidden),
                  "dweight");
    } else {
      EXPECT_FALSE(w.grad().defined());
    }
  }
}

// cos and sin [seq, head_dim] as CausalLm's RoPE tables (float32, base 500000).
std::pair<at::Tensor, at::Tensor> RopeTables(int64_t seq, int64_t head_dim) {
  at::Tensor exponents = at::arange(0, head_dim, 2, at::kLong).to(at::kFloat) / double(head_dim);
  at::Tensor inv_freq = 1.0 / at::pow(500000.0, exponents);
  at::Tensor freqs = at::outer(at::arange(seq, at::kFloat), inv_freq);
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos(), emb.sin()};
}

TEST_F(OpsCudaTest, RopeMatchesTheUnfusedComposition) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  at::Generator gen = testing::Generator(seed_);
  struct Case {
    int64_t batch, heads, seq, head_dim;
    at::ScalarType type;
  };
  for (const Case& c : {Case{1, 1, 1, 2, at::kFloat}, Case{2, 3, 5, 6, at::kFloat},
                        Case{2, 32, 256, 64, at::kBFloat16}, Case{1, 8, 2048, 64, at::kBFloat16},
                        Case{2, 3, 5, 6, at::kHalf}}) {
    SCOPED_TRACE(::testing::Message() << "b" << c.batch << " h" << c.heads << " s" << c.seq << " d"
                                      << c.head_dim << " " << c.type);
    // As the attention sees it: the projection's [batch, seq, heads, head_dim] output
    // transposed to [batch, heads, seq, head_dim], read in place.
    const at::Tensor x0 = Randn({c.batch, c.seq, c.heads, c.head_dim}, c.type, gen);
    auto [cos, sin] = RopeTables(c.seq, c.head_dim);
    at::Tensor x = OnCuda(x0, true);
    at::Tensor y = kernels::Rope(x.transpose(1, 2), cos.to(kCuda), sin.to(kCuda));
    EXPECT_EQ(y.strides(), x.transpose(1, 2).strides()) << "the output keeps x's layout";
    const at::Tensor dy0 = Randn(y.sizes(), c.type, gen);
    y.backward(dy0.to(kCuda));

    // The reference sees the tables as the op does: rounded to x's dtype.
    at::Tensor x64 = Float64(x0, true);
    at::Tensor y64 = kernels::unfused::Rope(x64.transpose(1, 2), cos.to(c.type).to(at::kDouble),
                                            sin.to(c.type).to(at::kDouble));
    y64.backward(dy0.to(at::kDouble));
    const double tol = Tolerance(c.type);
    ExpectClose(y, y64, c.type, tol, "y");
    ExpectClose(x.grad(), x64.grad(), c.type, tol, "dx");
  }
}

TEST_F(OpsCudaTest, SwiGluMatchesTheUnfusedComposition) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  at::Generator gen = testing::Generator(seed_);
  for (auto [shape, type] : {std::pair<std::vector<int64_t>, at::ScalarType>{{1, 1}, at::kFloat},
                             {{7, 65}, at::kFloat},
                             {{2, 512, 8192}, at::kBFloat16},
                             {{7, 65}, at::kHalf}}) {
    SCOPED_TRACE(::testing::Message() << at::IntArrayRef(shape) << " " << type);
    const at::Tensor gate0 = Randn(shape, type, gen, 3.0), up0 = Randn(shape, type, gen);
    const at::Tensor dy0 = Randn(shape, type, gen);
    at::Tensor gate = OnCuda(gate0, true), up = OnCuda(up0, true);
    at::Tensor y = kernels::SwiGlu(gate, up);
    y.backward(dy0.to(kCuda));
    at::Tensor gate64 = Float64(gate0, true), up64 = Float64(up0, true);
    at::Tensor y64 = kernels::unfused::SwiGlu(gate64, up64);
    y64.backward(dy0.to(at::kDouble));
    const double tol = Tolerance(type);
    ExpectClose(y, y64, type, tol, "y");
    ExpectClose(gate.grad(), gate64.grad(), type, tol, "dgate");
    ExpectClose(up.grad(), up64.grad(), type, tol, "dup");
  }
}

TEST_F(OpsCudaTest, LoraLinearMatchesTheUnfusedComposition) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  at::Generator gen = testing::Generator(seed_);
  struct Case {
    std::vector<int64_t> x_shape;  // [..., in]
    int64_t out, rank;             // rank 0: no LoRA, W trainable (full fine-tuning)
    at::ScalarType x_type, weight_type;
    bool bias;
    double dropout;
  };
  // bf16 x, a frozen bf16 W and float32 A, B: a bf16 LoRA job's projections on CUDA.
  for (const Case& c : {Case{{7, 65}, 33, 3, at::kFloat, at::kFloat, true, 0.0},
                        Case{{2, 5, 64}, 96, 16, at::kFloat, at::kFloat, false, 0.3},
                        Case{{2, 64, 256}, 384, 16, at::kBFloat16, at::kBFloat16, false, 0.0},
                        Case{{2, 64, 256}, 384, 16, at::kBFloat16, at::kBFloat16, true, 0.1},
                        Case{{1, 65}, 33, 3, at::kBFloat16, at::kBFloat16, false, 0.3},
                        Case{{7, 65}, 33, 0, at::kFloat, at::kFloat, true, 0.0},
                        Case{{7, 65}, 33, 0, at::kBFloat16, at::kBFloat16, false, 0.0}}) {
    SCOPED_TRACE(::testing::Message() << at::IntArrayRef(c.x_shape) << " out " << c.out << " r"
                                      << c.rank << " " << c.x_type << " W " << c.weight_type
                                      << " bias " << c.bias << " dropout " << c.dropout);
    const int64_t in = c.x_shape.back();
    const bool lora = c.rank > 0;
    const double scale = 2.0;
    const at::Tensor x0 = Randn(c.x_shape, c.x_type, gen);
    const at::Tensor w0 = Randn({c.out, in}, c.weight_type, gen, 0.2);
    const at::Tensor bias0 = c.bias ? Randn({c.out}, c.weight_type, gen) : at::Tensor();
    // Float32 masters; B random (not zero as at init) so that every gradient flows.
    const at::Tensor a0 = lora ? Randn({c.rank, in}, at::kFloat, gen, 0.2) : at::Tensor();
    const at::Tensor b0 = lora ? Randn({c.out, c.rank}, at::kFloat, gen, 0.2) : at::Tensor();
    const uint64_t mask_seed = FreshSeed();

    auto cuda = [](const at::Tensor& t, bool grad) { return t.defined() ? OnCuda(t, grad) : t; };
    at::Tensor x = cuda(x0, true), w = cuda(w0, !lora), bias = cuda(bias0, !lora);
    at::Tensor a = cuda(a0, true), b = cuda(b0, true);
    at::Tensor y = kernels::LoraLinearWithSeed(x, w, bias, a, b, scale, c.dropout, mask_seed);
    std::vector<int64_t> y_shape = c.x_shape;
    y_shape.back() = c.out;
    ASSERT_EQ(y.sizes(), at::IntArrayRef(y_shape));
    const at::Tensor dy0 = Randn(y_shape, c.x_type, gen);
    y.backward(dy0.to(kCuda));

    // The same mask, drawn on the CPU (kernels_cuda_test checks that the CUDA kernel draws the
    // CPU's bit for bit), scaled by 1 / (1 - p).
    at::Tensor mask;
    if (c.dropout > 0) {
      mask = kernels::ApplyDropoutMask(at::ones(c.x_shape), c.dropout, mask_seed).to(at::kDouble);
    }
    at::Tensor x64 = Float64(x0, true), w64 = Float64(w0, true), bias64 = Float64(bias0, true),
               a64 = Float64(a0, true), b64 = Float64(b0, true);
    at::Tensor y64 = kernels::unfused::LoraLinear(x64, w64, bias64, a64, b64, scale, c.dropout,
                                                  /*training=*/true, mask);
    y64.backward(dy0.to(at::kDouble));

    // Products of bf16 operands (A and B rounded as they are used) with float32 sums over at
    // most `in` or the tokens.
    const int64_t tokens = x0.numel() / in;
    const double tol = Tolerance(c.x_type, std::max(in, tokens));
    ExpectClose(y, y64, c.x_type, tol, "y");
    ExpectClose(x.grad(), x64.grad(), c.x_type, tol, "dx");
    if (lora) {
      ExpectClose(a.grad(), a64.grad(), at::kFloat, tol, "dA");
      ExpectClose(b.grad(), b64.grad(), at::kFloat, tol, "dB");
      EXPECT_FALSE(w.grad().defined());
    } else {
      ExpectClose(w.grad(), w64.grad(), c.weight_type, tol, "dW");
      if (c.bias) ExpectClose(bias.grad(), bias64.grad(), c.weight_type, tol, "dbias");
    }
  }
}

TEST_F(OpsCudaTest, LinearCrossEntropyMatchesTheFullLogits) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  at::Generator gen = testing::Generator(seed_);
  struct Case {
    int64_t tokens, hidden, vocab;
    at::ScalarType type;
    bool weight_trainable;             // false: a LoRA job's frozen LM head
    int64_t token_chunk, vocab_chunk;  // 0: from the memory budget
  };
  for (const Case& c :
       {Case{1, 64, 97, at::kFloat, true, 0, 0}, Case{300, 96, 1000, at::kFloat, true, 64, 256},
        Case{512, 256, 5000, at::kBFloat16, false, 0, 0},
        Case{300, 96, 1000, at::kBFloat16, true, 64, 1024},
        Case{1024, 512, 32768, at::kBFloat16, false, 0, 0}}) {
    SCOPED_TRACE(::testing::Message()
                 << c.tokens << " tokens, hidden " << c.hidden << ", vocab " << c.vocab << " "
                 << c.type << " chunks " << c.token_chunk << " x " << c.vocab_chunk);
    // Logits of standard deviation about 3; every seventh target ignored.
    const at::Tensor hidden0 = Randn({c.tokens, c.hidden}, c.type, gen);
    const at::Tensor weight0 = Randn({c.vocab, c.hidden}, c.type, gen, 3.0 / std::sqrt(c.hidden));
    at::Tensor targets = at::randint(c.vocab, {c.tokens}, gen, at::kLong);
    for (int64_t i = 0; i < c.tokens; i += 7) targets[i] = -100;

    kernels::LinearCrossEntropyOptions options;
    options.token_chunk = c.token_chunk;
    options.vocab_chunk = c.vocab_chunk;
    at::Tensor hidden = OnCuda(hidden0, true), weight = OnCuda(weight0, c.weight_trainable);
    at::Tensor loss = kernels::LinearCrossEntropy(hidden, weight, targets.to(kCuda), options);
    ASSERT_TRUE(loss.is_cuda());
    ASSERT_EQ(loss.scalar_type(), at::kFloat);
    (loss * 0.5).backward();

    at::Tensor hidden64 = Float64(hidden0, true), weight64 = Float64(weight0, true);
    at::Tensor loss64 = at::cross_entropy_loss(at::matmul(hidden64, weight64.t()), targets, {},
                                               at::Reduction::Sum, -100);
    (loss64 * 0.5).backward();

    EXPECT_LT(RelErr(loss.item<double>(), loss64.item<double>()), Tolerance(c.type, c.vocab))
        << "loss " << loss.item<double>() << " vs " << loss64.item<double>();
    ExpectClose(hidden.grad(), hidden64.grad(), c.type, Tolerance(c.type, c.vocab), "dhidden");
    if (c.weight_trainable) {
      ExpectClose(weight.grad(), weight64.grad(), c.type, Tolerance(c.type, c.tokens), "dweight");
    } else {
      EXPECT_FALSE(weight.grad().defined());
    }
  }
}

}  // namespace
}  // namespace lathe
