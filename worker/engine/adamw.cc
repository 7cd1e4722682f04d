#include "worker/engine/adamw.h"

#include <cmath>

namespace lathe {

AdamW::AdamW(std::vector<NamedParameter> params, const AdamWOptions& options)
    : params_(std::move(params)), options_(options) {
  for (const NamedParameter& p : params_) {
    exp_avg_.push_back(at::zeros_like(p.tensor));
    exp_avg_sq_.push_back(at::zeros_like(p.tensor));
  }
}

void AdamW::Step(double lr) {
  at::NoGradGuard no_grad;
  ++steps_;
  const double bias_correction1 = 1.0 - std::pow(options_.beta1, steps_);
  const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(options_.beta2, steps_));
  const double step_size = lr / bias_correction1;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor param = params_[i].tensor;
    const at::Tensor& grad = param.grad();
    if (!grad.defined()) continue;
    if (params_[i].weight_decay && options_.weight_decay != 0.0) {
      param.mul_(1.0 - lr * options_.weight_decay);
    }
    exp_avg_[i].mul_(options_.beta1).add_(grad, 1.0 - options_.beta1);
    exp_avg_sq_[i].mul_(options_.beta2).addcmul_(grad, grad, 1.0 - options_.beta2);
    at::Tensor denom = (exp_avg_sq_[i].sqrt() / bias_correction2_sqrt).add_(options_.eps);
    param.addcdiv_(exp_avg_[i], denom, -step_size);
  }
}

void AdamW::ZeroGrad() {
  for (NamedParameter& p : params_) p.tensor.mutable_grad() = at::Tensor();
}

double AdamW::GradNorm() const {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  for (const NamedParameter& p : params_) {
    if (p.tensor.grad().defined()) norms.push_back(p.tensor.grad().norm(2));
  }
  if (norms.empty()) return 0.0;
  return at::stack(norms).norm(2).item<double>();
}

void AdamW::ScaleGrads(double factor) {
  at::NoGradGuard no_grad;
  for (NamedParameter& p : params_) {
    if (p.tensor.grad().defined()) p.tensor.mutable_grad().mul_(factor);
  }
}

}  // namespace lathe
