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
// where libtorch 1.13's bfloat16 product accumulates in bfloat16 (2% error at 96 terms, 5% at
// 1024) and runs ~50x slower than float32 (docs/training.md, "Precision").
at::ScalarType MathType(const at::Tensor& x) {
  const at::ScalarType type = x.scalar_type();
  const bool half = type == at::kBFloat16 || type == at::kHalf;
  return half && x.device().is_cpu() ? at::kFloat : type;
}

// Whether the base product x W^T (and dy W) runs bfloat16 x bfloat16 with float32
// accumulation: a frozen bfloat16 W with float32 x (x2: [tokens, in]) on a CPU that
// multiplies bfloat16 natively, in a product large enough for the kernel
// (kernels/ops/matmul.h). x (dy) is rounded to bfloat16 for that product, as CUDA autocast
// does; otherwise W is widened to float32.
bool NativeBFloat16Base(const at::Tensor& x2, const at::Tensor& weight) {
  return x2.device().is_cpu() && x2.scalar_type() == at::kFloat &&
         weight.scalar_type() == at::kBFloat16 && !weight.requires_grad() &&
         NativeBFloat16Product(x2.size(0), weight.size(0), weight.size(1));
}

// Gradient `g` in the dtype of the tensor it belongs to.
at::Tensor GradFor(const at::Tensor& g, const at::Tensor& of) { return As(g, of.scalar_type()); }

class LoraLinearFunction : public torch::autograd::Function<LoraLinearFunction> {
 public:
  // The optional tensors are absent (not undefined tensors: libtorch 1.13's custom functions
  // reject undefined tensor inputs).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias_in,
                            const c10::optional<at::Tensor>& lora_a_in,
                            const c10::optional<at::Tensor>& lora_b_in, double scale,
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
    const at::ScalarType math = MathType(x);
    const at::Tensor x2 = x.reshape({-1, in});  // a view of x when x is contiguous
    const at::Tensor xm = As(x2, math);         // a temporary when math != type
    const bool native = NativeBFloat16Base(x2, weight);
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
      const at::Tensor xd =
          dropout_p > 0 ? ApplyDropoutMask(xm, dropout_p, static_cast<uint64_t>(seed)) : xm;
      xa = Matmul(xd, As(lora_a, math).t());
      MatmulOut(y, xa, As(lora_b, math).t(), /*alpha=*/scale, /*beta=*/1.0);
    }
    if (math != type) result.view({-1, out}).copy_(y);
    ctx->save_for_backward({x2, weight, bias, lora_a, lora_b, xa});
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
    const at::ScalarType type = x2.scalar_type();
    const at::ScalarType math = MathType(x2);
    const at::Tensor dy = As(grads[0], math).reshape({-1, weight.size(0)});
    const bool a_grad = ctx->saved_data["a_grad"].toBool();
    const bool weight_grad = ctx->saved_data["weight_grad"].toBool();
    at::Tensor xm;  // x in the math type, when a gradient needs it
    if (weight_grad || (lora_a.defined() && a_grad)) xm = As(x2, math);

    at::Tensor dx, dweight, dbias, da, db;
    if (ctx->saved_data["x_grad"].toBool()) {
      if (NativeBFloat16Base(dy, weight)) {
        dx = at::empty({dy.size(0), weight.size(1)}, dy.options());
        MatmulOut(dx, dy.to(at::kBFloat16), weight);
      } else {
        dx = Matmul(dy, As(weight, math));
      }
    }
    if (weight_grad) dweight = GradFor(Matmul(dy.t(), xm), weight);
    if (ctx->saved_data["bias_grad"].toBool()) dbias = GradFor(dy.sum(0), bias);
    if (lora_a.defined()) {
      const at::Tensor a = As(lora_a, math);
      const at::Tensor dxa = Matmul(dy, As(lora_b, math)).mul_(scale);  // d(x A^T): [tokens, r]
      if (ctx->saved_data["b_grad"].toBool()) db = GradFor(Matmul(dy.t(), xa).mul_(scale), lora_b);
      if (a_grad) {
        const at::Tensor xd = dropout_p > 0 ? ApplyDropoutMask(xm, dropout_p, seed) : xm;
        da = GradFor(Matmul(dxa.t(), xd), lora_a);
      }
      if (dx.defined()) {
        if (dropout_p > 0) {
          dx.add_(ApplyDropoutMask(Matmul(dxa, a), dropout_p, seed));
        } else {
          MatmulOut(dx, dxa, a, 1.0, 1.0);
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
    return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
  };
  return LoraLinearFunction::apply(x, weight, present(bias), present(lora_a), present(lora_b),
                                   scale, dropout_p, static_cast<int64_t>(seed));
}

at::Tensor LoraLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      const at::Tensor& lora_a, const at::Tensor& lora_b, double scale,
                      double dropout_p, bool training, c10::optional<at::Generator> generator) {
  const bool dropout = training && dropout_p > 0 && lora_a.defined();
  return LoraLinearWithSeed(x, weight, bias, lora_a, lora_b, scale, dropout ? dropout_p : 0.0,
                            dropout ? DrawDropoutSeed(std::move(generator)) : 0);
}

}  // namespace lathe::kernels
