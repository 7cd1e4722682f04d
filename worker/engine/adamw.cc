#include "worker/engine/adamw.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

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

void AdamW::AddStateTo(TensorsToWrite* out) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    out->Add("exp_avg." + params_[i].name, exp_avg_[i]);
    out->Add("exp_avg_sq." + params_[i].name, exp_avg_sq_[i]);
  }
}

absl::Status AdamW::RestoreState(const std::shared_ptr<const SafetensorsFile>& file,
                                 int64_t steps) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    for (auto [prefix, target] :
         {std::pair{"exp_avg.", &exp_avg_[i]}, std::pair{"exp_avg_sq.", &exp_avg_sq_[i]}}) {
      const std::string name = prefix + params_[i].name;
      const TensorView* view = file->Find(name);
      if (view == nullptr ||
          view->shape != std::vector<int64_t>(target->sizes().begin(), target->sizes().end())) {
        return absl::DataLossError(
            absl::StrCat(file->path(), ": tensor \"", name, "\" is missing or has another shape"));
      }
      LATHE_ASSIGN_OR_RETURN(at::Tensor loaded, TensorFromFile({view, file}, at::kFloat, false));
      target->copy_(loaded);
    }
  }
  steps_ = steps;
  return absl::OkStatus();
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
