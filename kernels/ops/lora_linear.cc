#include "kernels/ops/lora_linear.h"

#include <utility>
#include <vector>

#include "kernels/ops/dropout.h"
#include "kernels/ops/matmul.h"

namespace lathe::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// t in `type`: t itself when it has it, else a converted temporary.
at::Tensor As(const at::Tensor& t, at::ScalarType type) {
  return t.scalar_type() == type ? t : t.to(type);
}

// The dtype of the matrix products for x: x's own, except float32 for 16-bit x on the CPU,
// where libtorch 1.13's bfloat16 product, when this was decided, accumulated in bfloat16 (2%
// error at 96 terms, 5% at 1024) and ran ~50x slower than float32 (docs/training.md,
// "Precision").
at::ScalarType MathType(const at::TensorOptions& x) {
  const at::ScalarType type = x.dtype().toScalarType();
  const bool half = type == at::kBFloat16 || type == at::kHalf;
  return half && x.device().is_cpu() ? at::kFloat : type;
}

// Whether the node belongs to a bf16 job on the CPU: a frozen bfloat16 W with float32 x.
// Its products then run bfloat16 x bfloat16 with float32 accumulation wherever the CPU
// multiplies bfloat16 natively and the product is large enough for the kernel
// (NativeBFloat16Product, kernels/ops/matmul.h), their operands rounded to bfloat16 as CUDA
// autocast rounds them; otherwise in float32, W widened.
bool BFloat16Job(const at::Tensor& x2, const at::Tensor& weight) {
  return x2.device().is_cpu() && x2.scalar_type() == at::kFloat &&
         weight.scalar_type() == at::kBFloat16 && !weight.requires_grad();
}

// out = alpha a b + beta out: bfloat16 x bfloat16 (a and b rounded, unless they already are)
// when `native`, else in out's dtype (b converted, as a widened W).
void ProductOut(at::Tensor out, const at::Tensor& a, const at::Tensor& b, bool native,
                double alpha = 1.0, double beta = 0.0) {
  const at::ScalarType type = native ? at::kBFloat16 : out.scalar_type();
  MatmulOut(std::move(out), As(a, type), As(b, type), alpha, beta);
}

// a b as a new tensor: as ProductOut, float32 when `native`, else a's dtype.
at::Tensor Product(const at::Tensor& a, const at::Tensor& b, bool native) {
  if (!native) return Matmul(a, As(b, a.scalar_type()));
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options().dtype(at::kFloat));
  ProductOut(out, a, b, native);
  return out;
}

// Gradient `g` in the dtype of the tensor it belongs to.
at::Tensor GradFor(const at::Tensor& g, const at::Tensor& of) { return As(g, of.scalar_type()); }

class LoraLinearFunction : public torch::autograd::Function<LoraLinearFunction> {
 public:
  // The optional tensors are absent (not undefined tensors: libtorch's custom functions
  // reject undefined tensor inputs).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias_in,
                            const std::optional<at::Tensor>& lora_a_in,
                            const std::optional<at::Tensor>& lora_b_in, double scale,
                            double dropout_p, int64_t seed) {
    const at::Tensor bias = bias_in.value_or(at::Tensor());
    const at::Tensor lora_a = lora_a_in.value_or(at::Tensor());
    const at::Tensor lora_b = lora_b_in.value_or(at::Tensor());
    TORCH_CHECK(weight.dim() == 2, "LoraLinear: weight must be [out, in], not ", weight.sizes());
    const int64_t out = weight.size(0), in = weight.size(1);
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "LoraLinear: x of shape ", x.sizes(),
                " for weight ", weight.sizes());
    TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == out),
                "LoraLinear: bias of shape ", bias.sizes(), " for weight ", weight.sizes());
    const bool lora = lora_a.defined();
    TORCH_CHECK(lora == lora_b.defined(), "LoraLinear: lora_a and lora_b go together");
    if (lora) {
      TORCH_CHECK(lora_a.dim() == 2 && lora_a.size(1) == in && lora_b.dim() == 2 &&
                      lora_b.size(0) == out && lora_b.size(1) == lora_a.size(0),
                  "LoraLinear: lora_a ", lora_a.sizes(), " and lora_b ", lora_b.sizes(),
                  " for weight ", weight.sizes());
    }
    TORCH_CHECK(dropout_p >= 0 && dropout_p < 1, "LoraLinear: dropout ", dropout_p,
                " is not in [0, 1)");
    const at::ScalarType type = x.scalar_type();
    const at::ScalarType math = MathType(x.options());
    const at::Tensor x2 = x.reshape({-1, in});  // a view of x when x is contiguous
    const at::Tensor xm = As(x2, math);         // a temporary when math != type
    const bool bf16 = BFloat16Job(x2, weight);
    const bool native = bf16 && NativeBFloat16Product(x2.size(0), out, in);
    // The adapter's two products, x A^T and (x A^T) B^T.
    const bool native_a = lora && bf16 && NativeBFloat16Product(x2.size(0), lora_a.size(0), in);
    const bool native_b = lora && bf16 && NativeBFloat16Product(x2.size(0), out, lora_a.size(0));
    // The base product's operands: x and W in the math type, or both bfloat16.
    const at::Tensor xw = native ? x2.to(at::kBFloat16) : xm;
    const at::Tensor w = native ? weight : As(weight, math);
    std::vector<int64_t> out_sizes = x.sizes().vec();
    out_sizes.back() = out;
    at::Tensor result = at::empty(out_sizes, x.options());
    at::Tensor y = math == type ? result.view({-1, out})
                                : at::empty({x2.size(0), out}, x.options().dtype(math));
    if (bias.defined()) {
      y.copy_(As(bias, math).expand_as(y));
      MatmulOut(y, xw, w.t(), 1.0, 1.0);
    } else {
      MatmulOut(y, xw, w.t());
    }
    at::Tensor xa;  // dropout(x) A^T: [tokens, r], in the math type
    if (lora) {
      // (x rounded for the base product is x rounded for this one too)
      const at::Tensor xd = dropout_p > 0
                                ? ApplyDropoutMask(xm, dropout_p, static_cast<uint64_t>(seed))
                                : (native && native_a ? xw : xm);
      xa = Product(xd, As(lora_a, math).t(), native_a);
      ProductOut(y, xa, As(lora_b, math).t(), native_b, /*alpha=*/scale, /*beta=*/1.0);
    }
    if (math != type) result.view({-1, out}).copy_(y);
    // What backward needs of x: nothing when no gradient reads it (a frozen W without a
    // trainable adapter); x rounded to bfloat16 when only the native x A^T gradient does (half
    // the bytes, and the caller's float32 x may be freed); else x itself.
    const bool needs_x = weight.requires_grad() || (lora && lora_a.requires_grad());
    const bool keep_rounded =
        needs_x && !weight.requires_grad() && native && native_a && dropout_p == 0;
    ctx->save_for_backward(
        {needs_x ? (keep_rounded ? xw : x2) : at::Tensor(), weight, bias, lora_a, lora_b, xa});
    ctx->saved_data["type"] = static_cast<int64_t>(type);
    ctx->saved_data["bf16"] = bf16;
    // Which inputs get a gradient (needs_input_grad counts only the present tensors).
    ctx->saved_data["x_grad"] = x.requires_grad();
    ctx->saved_data["weight_grad"] = weight.requires_grad();
    ctx->saved_data["bias_grad"] = bias.defined() && bias.requires_grad();
    ctx->saved_data["a_grad"] = lora && lora_a.requires_grad();
    ctx->saved_data["b_grad"] = lora && lora_b.requires_grad();
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["seed"] = seed;
    return result;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x2 = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& bias = saved[2];
    const at::Tensor& lora_a = saved[3];
    const at::Tensor& lora_b = saved[4];
    const at::Tensor& xa = saved[5];
    const double scale = ctx->saved_data["scale"].toDouble();
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    const auto seed = static_cast<uint64_t>(ctx->saved_data["seed"].toInt());
    const auto type = static_cast<at::ScalarType>(ctx->saved_data["type"].toInt());
    const at::ScalarType math = MathType(grads[0].options().dtype(type));
    const bool bf16 = ctx->saved_data["bf16"].toBool();
    const at::Tensor dy = As(grads[0], math).reshape({-1, weight.size(0)});
    const bool a_grad = ctx->saved_data["a_grad"].toBool();
    const bool weight_grad = ctx->saved_data["weight_grad"].toBool();
    // x in the math type (or as forward kept it rounded: a bf16 job's x is float32), when a
    // gradient needs it.
    at::Tensor xm;
    if (weight_grad || (lora_a.defined() && a_grad)) {
      xm = bf16 && x2.scalar_type() == at::kBFloat16 ? x2 : As(x2, math);
    }

    const int64_t tokens = dy.size(0), out = weight.size(0), in = weight.size(1);
    at::Tensor dx, dweight, dbias, da, db;
    if (ctx->saved_data["x_grad"].toBool()) {
      dx = at::empty({tokens, in}, dy.options());
      // dy W: bfloat16 x bfloat16 (dy rounded) natively, else W widened.
      ProductOut(dx, dy, weight, bf16 && NativeBFloat16Product(tokens, in, out));
    }
    if (weight_grad) dweight = GradFor(Matmul(dy.t(), xm), weight);
    if (ctx->saved_data["bias_grad"].toBool()) dbias = GradFor(dy.sum(0), bias);
    if (lora_a.defined()) {
      const at::Tensor a = As(lora_a, math);
      const int64_t rank = lora_a.size(0);
      // Each backward product has its forward product's multiply-adds, so runs as it did.
      const bool native_a = bf16 && NativeBFloat16Product(tokens, rank, in);
      const bool native_b = bf16 && NativeBFloat16Product(tokens, out, rank);
      // bf16: the adapter's incoming gradient s dy rounded, as autograd hands it to
      // s ((x A^T) B^T); float32: the products scaled instead (the same to rounding).
      const at::Tensor dys = native_b ? (dy * scale).to(at::kBFloat16) : dy;
      at::Tensor dxa = Product(dys, As(lora_b, math), native_b);  // d(x A^T): [tokens, r]
      if (!native_b) dxa.mul_(scale);
      if (ctx->saved_data["b_grad"].toBool()) {
        at::Tensor dlb = Product(dys.t(), xa, native_b);
        if (!native_b) dlb.mul_(scale);
        db = GradFor(dlb, lora_b);
      }
      if (a_grad) {
        const at::Tensor xd = dropout_p > 0 ? ApplyDropoutMask(xm, dropout_p, seed) : xm;
        da = GradFor(Product(dxa.t(), xd, native_a), lora_a);
      }
      if (dx.defined()) {
        if (dropout_p > 0) {
          dx.add_(ApplyDropoutMask(Product(dxa, a, native_a), dropout_p, seed));
        } else {
          ProductOut(dx, dxa, a, native_a, 1.0, 1.0);
        }
      }
    }
    if (dx.defined()) dx = As(dx, type).view(ctx->saved_data["x_sizes"].toIntVector());
    return {dx, dweight, dbias, da, db, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor LoraLinearWithSeed(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                              const at::Tensor& lora_a, const at::Tensor& lora_b, double scale,
                              double dropout_p, uint64_t seed) {
  auto present = [](const at::Tensor& t) {
    return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
  };
  return LoraLinearFunction::apply(x, weight, present(bias), present(lora_a), present(lora_b),
                                   scale, dropout_p, static_cast<int64_t>(seed));
}

at::Tensor LoraLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      const at::Tensor& lora_a, const at::Tensor& lora_b, double scale,
                      double dropout_p, bool training, std::optional<at::Generator> generator) {
  const bool dropout = training && dropout_p > 0 && lora_a.defined();
  return LoraLinearWithSeed(x, weight, bias, lora_a, lora_b, scale, dropout ? dropout_p : 0.0,
                            dropout ? DrawDropoutSeed(std::move(generator)) : 0);
}

}  // namespace lathe::kernels
