#include "kernels/ops/unfused.h"

namespace lathe::kernels::unfused {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// causal_lm.cc's FrozenLinear: y = x W^T for a frozen W of another dtype than x, converting W
// for the product and again in backward, saving only W.
class FrozenLinear : public torch::autograd::Function<FrozenLinear> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    ctx->save_for_backward({weight});
    return at::linear(x, weight.to(x.scalar_type()));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad = grads[0];
    const at::Tensor weight = ctx->get_saved_variables()[0];
    return {at::matmul(grad, weight.to(grad.scalar_type())), at::Tensor()};
  }
};

at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {}) {
  const at::ScalarType type = x.scalar_type();
  at::Tensor y;
  if (weight.scalar_type() == type) {
    y = at::linear(x, weight);
  } else if (weight.requires_grad()) {
    y = at::linear(x, weight.to(type));
  } else {
    y = FrozenLinear::apply(x, weight);
  }
  return bias.defined() ? y + bias.to(type) : y;
}

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

}  // namespace

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor xf = x.to(at::promote_types(x.scalar_type(), at::kFloat));
  const at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return normed.to(x.scalar_type()) * weight.to(x.scalar_type());
}

at::Tensor GemmaRmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor xf = x.to(at::promote_types(x.scalar_type(), at::kFloat));
  const at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (normed * (1.0 + weight.to(xf.scalar_type()))).to(x.scalar_type());
}

at::Tensor Rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x * cos + RotateHalf(x) * sin;
}

at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up) { return at::silu(gate) * up; }

at::Tensor GeGlu(const at::Tensor& gate, const at::Tensor& up) {
  return at::gelu(gate, "tanh") * up;
}

at::Tensor LoraLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      const at::Tensor& lora_a, const at::Tensor& lora_b, double scale,
                      double dropout_p, bool training, const at::Tensor& dropout_mask) {
  at::Tensor y = Linear(x, weight, bias);
  if (!lora_a.defined()) return y;
  at::Tensor lora_in = x;
  if (dropout_mask.defined()) {
    lora_in = x * dropout_mask;
  } else if (training && dropout_p > 0) {
    lora_in = at::dropout(x, dropout_p, /*train=*/true);
  }
  return y + Linear(Linear(lora_in, lora_a), lora_b) * scale;
}

}  // namespace lathe::kernels::unfused
