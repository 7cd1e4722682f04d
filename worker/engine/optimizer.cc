#include "worker/engine/optimizer.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/ops/nf4_linear.h"

namespace lathe {
namespace {

// AdamW's update of `param` from float32 moments, as torch.optim.AdamW's single-tensor path
// (weight decay is applied before, by the caller).
void AdamWUpdate(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                 at::Tensor& exp_avg_sq, const AdamWOptions& o, int64_t step, double lr) {
  const double bias_correction1 = 1.0 - std::pow(o.beta1, step);
  const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(o.beta2, step));
  exp_avg.mul_(o.beta1).add_(grad, 1.0 - o.beta1);
  exp_avg_sq.mul_(o.beta2).addcmul_(grad, grad, 1.0 - o.beta2);
  at::Tensor denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(o.eps);
  param.addcdiv_(exp_avg, denom, -lr / bias_correction1);
}

class AdamW final : public Optimizer {
 public:
  AdamW(std::vector<NamedParameter> params, const AdamWOptions& options, bool paged)
      : Optimizer(std::move(params), paged), options_(options) {
    for (size_t i = 0; i < this->params().size(); ++i) {
      const NamedParameter& p = this->params()[i];
      AddState(i, "exp_avg." + p.name, at::zeros_like(p.tensor));
      AddState(i, "exp_avg_sq." + p.name, at::zeros_like(p.tensor));
    }
  }

 private:
  void Update(size_t i, at::Tensor& param, const at::Tensor& grad, double lr) override {
    DecoupledDecay(i, param, lr, options_.weight_decay);
    AdamWUpdate(param, grad, state(i)[0], state(i)[1], options_, steps(), lr);
  }

  const AdamWOptions options_;
};

// Block-wise quantization of `x` ([blocks * kBlock8bit] float32) to the nearest value of
// the map whose midpoints are `mids` (a value on a midpoint takes the lower code), each
// block scaled by its largest magnitude.
void Quantize(const at::Tensor& x, const at::Tensor& mids, at::Tensor& codes, at::Tensor& absmax) {
  at::Tensor blocks = x.view({-1, kBlock8bit});
  absmax.copy_(blocks.abs().amax(1));
  at::Tensor scale = at::where(absmax.eq(0), at::ones_like(absmax), absmax);
  codes.copy_(at::searchsorted(mids, blocks.div(scale.unsqueeze(1)).view({-1})).to(at::kByte));
}

at::Tensor Dequantize(const at::Tensor& map, const at::Tensor& codes, const at::Tensor& absmax) {
  return map.index_select(0, codes.to(at::kLong))
      .view({-1, kBlock8bit})
      .mul_(absmax.unsqueeze(1))
      .view({-1});
}

class AdamW8bit final : public Optimizer {
 public:
  AdamW8bit(std::vector<NamedParameter> params, const AdamWOptions& options, bool paged)
      : Optimizer(std::move(params), paged), options_(options) {
    const at::Device device =
        this->params().empty() ? at::Device(at::kCPU) : this->params()[0].tensor.device();
    for (bool is_signed : {true, false}) {
      at::Tensor map = kernels::DynamicQuantizationMap(is_signed).to(device);
      mids_[is_signed] = (map.narrow(0, 0, 255) + map.narrow(0, 1, 255)) / 2;
      maps_[is_signed] = std::move(map);
    }
    for (size_t i = 0; i < this->params().size(); ++i) {
      const NamedParameter& p = this->params()[i];
      const int64_t n = p.tensor.numel();
      if (n < kMin8bitElements || KeepsFloat32Moments(p.name)) {
        AddState(i, "exp_avg." + p.name, at::zeros_like(p.tensor));
        AddState(i, "exp_avg_sq." + p.name, at::zeros_like(p.tensor));
        continue;
      }
      const int64_t blocks = (n + kBlock8bit - 1) / kBlock8bit;
      const at::TensorOptions f32 = p.tensor.options().dtype(at::kFloat);
      // The first moment on the signed map, the second on the unsigned one.
      for (auto [moment, is_signed] :
           {std::pair{"exp_avg.", true}, std::pair{"exp_avg_sq.", false}}) {
        at::Tensor codes = at::empty({blocks * kBlock8bit}, f32.dtype(at::kByte));
        at::Tensor absmax = at::empty({blocks}, f32);
        Quantize(at::zeros({blocks * kBlock8bit}, f32), mids_[is_signed], codes, absmax);
        AddState(i, absl::StrCat(moment, p.name, ".codes"), std::move(codes));
        AddState(i, absl::StrCat(moment, p.name, ".absmax"), std::move(absmax));
      }
    }
  }

 private:
  void Update(size_t i, at::Tensor& param, const at::Tensor& grad, double lr) override {
    std::vector<at::Tensor>& s = state(i);
    DecoupledDecay(i, param, lr, options_.weight_decay);
    if (s.size() == 2) {
      AdamWUpdate(param, grad, s[0], s[1], options_, steps(), lr);
      return;
    }
    at::Tensor &m_codes = s[0], &m_absmax = s[1], &v_codes = s[2], &v_absmax = s[3];
    const int64_t n = param.numel();
    at::Tensor m = Dequantize(maps_[true], m_codes, m_absmax);
    at::Tensor v = Dequantize(maps_[false], v_codes, v_absmax);
    {  // (scoped: the padded gradient and the denominator go before the quantization)
      at::Tensor g = at::zeros({m_codes.numel()}, grad.options());
      g.narrow(0, 0, n).copy_(grad.reshape({-1}));
      const double bias_correction1 = 1.0 - std::pow(options_.beta1, steps());
      const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(options_.beta2, steps()));
      m.mul_(options_.beta1).add_(g, 1.0 - options_.beta1);
      v.mul_(options_.beta2).addcmul_(g, g, 1.0 - options_.beta2);
      at::Tensor denom = (v.narrow(0, 0, n).sqrt() / bias_correction2_sqrt).add_(options_.eps);
      param.view({-1}).addcdiv_(m.narrow(0, 0, n), denom, -lr / bias_correction1);
    }
    Quantize(m, mids_[true], m_codes, m_absmax);
    Quantize(v, mids_[false], v_codes, v_absmax);
  }

  const AdamWOptions options_;
  at::Tensor maps_[2], mids_[2];  // by is_signed
};

struct AdafactorOptions {
  double beta1 = 0.0;
  double decay_rate = -0.8;
  double clip_threshold = 1.0;
  double weight_decay = 0.0;
};

class Adafactor final : public Optimizer {
 public:
  Adafactor(std::vector<NamedParameter> params, const AdafactorOptions& options, bool paged)
      : Optimizer(std::move(params), paged), options_(options) {
    for (size_t i = 0; i < this->params().size(); ++i) {
      const NamedParameter& p = this->params()[i];
      const at::Tensor& t = p.tensor;
      if (t.dim() >= 2) {  // factored over the last two dimensions
        std::vector<int64_t> row(t.sizes().begin(), t.sizes().end() - 1);
        std::vector<int64_t> col(t.sizes().begin(), t.sizes().end() - 2);
        col.push_back(t.size(-1));
        AddState(i, "exp_avg_sq_row." + p.name, at::zeros(row, t.options()));
        AddState(i, "exp_avg_sq_col." + p.name, at::zeros(col, t.options()));
      } else {
        AddState(i, "exp_avg_sq." + p.name, at::zeros_like(t));
      }
      if (options_.beta1 > 0) AddState(i, "exp_avg." + p.name, at::zeros_like(t));
    }
  }

 private:
  void Update(size_t i, at::Tensor& param, const at::Tensor& grad, double lr) override {
    std::vector<at::Tensor>& s = state(i);
    const double rho = 1.0 - std::pow(static_cast<double>(steps()), options_.decay_rate);
    at::Tensor squared = grad.mul(grad).add_(1e-30);
    at::Tensor update;
    if (grad.dim() >= 2) {
      at::Tensor &row = s[0], &col = s[1];
      row.mul_(rho).add_(squared.mean(-1), 1.0 - rho);
      col.mul_(rho).add_(squared.mean(-2), 1.0 - rho);
      at::Tensor r = row.div(row.mean(-1, /*keepdim=*/true)).rsqrt_().unsqueeze(-1);
      at::Tensor c = col.rsqrt().unsqueeze(-2);
      update = r.mul(c).mul_(grad);
    } else {
      s[0].mul_(rho).add_(squared, 1.0 - rho);
      update = s[0].rsqrt().mul_(grad);
    }
    update.div_(at::linalg_vector_norm(update, 2)
                    .div(std::sqrt(static_cast<double>(update.numel())))
                    .div_(options_.clip_threshold)
                    .clamp_(1.0));
    if (options_.beta1 > 0) {
      at::Tensor& exp_avg = s.back();
      exp_avg.mul_(options_.beta1).add_(update, 1.0 - options_.beta1);
      update = exp_avg;
    }
    DecoupledDecay(i, param, lr, options_.weight_decay);
    param.add_(update, -lr);
  }

  const AdafactorOptions options_;
};

struct SgdOptions {
  double momentum = 0.0;
  bool nesterov = false;
  double weight_decay = 0.0;
};

class Sgd final : public Optimizer {
 public:
  Sgd(std::vector<NamedParameter> params, const SgdOptions& options, bool paged)
      : Optimizer(std::move(params), paged), options_(options) {
    if (options_.momentum == 0.0) return;
    for (size_t i = 0; i < this->params().size(); ++i) {
      const NamedParameter& p = this->params()[i];
      AddState(i, "momentum_buffer." + p.name, at::zeros_like(p.tensor));
    }
  }

 private:
  void Update(size_t i, at::Tensor& param, const at::Tensor& grad, double lr) override {
    at::Tensor d = grad;
    if (params()[i].weight_decay && options_.weight_decay != 0.0) {
      d = grad.add(param, options_.weight_decay);  // torch's coupled L2
    }
    if (options_.momentum != 0.0) {
      at::Tensor& buffer = state(i)[0];
      if (steps() == 1) {
        buffer.copy_(d);
      } else {
        buffer.mul_(options_.momentum).add_(d);
      }
      d = options_.nesterov ? d.add(buffer, options_.momentum) : buffer;
    }
    param.add_(d, -lr);
  }

  const SgdOptions options_;
};

}  // namespace

bool KeepsFloat32Moments(absl::string_view name) {
  return absl::EndsWith(name, "embed_tokens.weight");
}

Optimizer::Optimizer(std::vector<NamedParameter> params, bool paged)
    : params_(std::move(params)),
      paged_(paged),
      state_(params_.size()),
      state_names_(params_.size()) {
  for (const NamedParameter& p : params_) {
    TORCH_CHECK(p.tensor.is_contiguous(), "trainable tensor ", p.name, " is not contiguous");
  }
}

void Optimizer::AddState(size_t param, std::string name, at::Tensor tensor) {
  state_names_[param].push_back(std::move(name));
  if (paged_ && tensor.is_cuda()) {
    at::Tensor host =
        at::empty(tensor.sizes(), tensor.options().device(at::kCPU).pinned_memory(true));
    tensor = host.copy_(tensor);
  }
  state_[param].push_back(std::move(tensor));
}

void Optimizer::DecoupledDecay(size_t i, at::Tensor& param, double lr, double weight_decay) const {
  if (params_[i].weight_decay && weight_decay != 0.0) param.mul_(1.0 - lr * weight_decay);
}

void Optimizer::Step(double lr) {
  at::NoGradGuard no_grad;
  ++steps_;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor param = params_[i].tensor;
    const at::Tensor grad = param.grad();
    if (!grad.defined()) continue;
    if (!paged_) {
      Update(i, param, grad, lr);
      continue;
    }
    // Page in, update, page out: only this parameter's state is on its device meanwhile.
    std::vector<at::Tensor> host = std::move(state_[i]);
    state_[i].clear();
    for (const at::Tensor& t : host) {
      state_[i].push_back(at::empty_like(t, t.options().device(param.device()).pinned_memory(false))
                              .copy_(t, /*non_blocking=*/true));
    }
    Update(i, param, grad, lr);
    for (size_t k = 0; k < host.size(); ++k) host[k].copy_(state_[i][k]);
    state_[i] = std::move(host);
  }
}

int64_t Optimizer::StateBytes() const {
  int64_t bytes = 0;
  for (const std::vector<at::Tensor>& tensors : state_) {
    for (const at::Tensor& t : tensors) bytes += static_cast<int64_t>(t.nbytes());
  }
  return bytes;
}

void Optimizer::AddStateTo(TensorsToWrite* out) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    for (size_t k = 0; k < state_[i].size(); ++k) out->Add(state_names_[i][k], state_[i][k]);
  }
}

absl::Status Optimizer::RestoreState(const std::shared_ptr<const SafetensorsFile>& file,
                                     int64_t steps) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    for (size_t k = 0; k < state_[i].size(); ++k) {
      const std::string& name = state_names_[i][k];
      at::Tensor& target = state_[i][k];
      const TensorView* view = file->Find(name);
      if (view == nullptr ||
          view->shape != std::vector<int64_t>(target.sizes().begin(), target.sizes().end())) {
        return absl::DataLossError(
            absl::StrCat(file->path(), ": tensor \"", name, "\" is missing or has another shape"));
      }
      absl::StatusOr<at::Tensor> loaded = TensorFromFile({view, file}, target.scalar_type(), false);
      if (!loaded.ok()) {
        return absl::DataLossError(
            absl::StrCat(file->path(), ": tensor \"", name, "\": ", loaded.status().message()));
      }
      target.copy_(*loaded);
    }
  }
  steps_ = steps;
  return absl::OkStatus();
}

void Optimizer::ZeroGrad() {
  for (NamedParameter& p : params_) p.tensor.mutable_grad() = at::Tensor();
}

double Optimizer::GradNorm() const {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  for (const NamedParameter& p : params_) {
    if (p.tensor.grad().defined()) norms.push_back(p.tensor.grad().norm(2));
  }
  if (norms.empty()) return 0.0;
  return at::stack(norms).norm(2).item<double>();
}

void Optimizer::ScaleGrads(double factor) {
  at::NoGradGuard no_grad;
  for (NamedParameter& p : params_) {
    if (p.tensor.grad().defined()) p.tensor.mutable_grad().mul_(factor);
  }
}

std::unique_ptr<Optimizer> MakeOptimizer(std::vector<NamedParameter> params,
                                         const TrainSpec& train) {
  const AdamWOptions adam{train.adam_beta1, train.adam_beta2, train.adam_eps, train.weight_decay};
  const bool paged = train.paged_optimizer;
  switch (train.optimizer) {
    case OptimizerKind::kAdamW:
      return std::make_unique<AdamW>(std::move(params), adam, paged);
    case OptimizerKind::kAdamW8bit:
      return std::make_unique<AdamW8bit>(std::move(params), adam, paged);
    case OptimizerKind::kAdafactor:
      return std::make_unique<Adafactor>(
          std::move(params),
          AdafactorOptions{train.adafactor_beta1, train.adafactor_decay_rate,
                           train.adafactor_clip_threshold, train.weight_decay},
          paged);
    case OptimizerKind::kSgd:
      return std::make_unique<Sgd>(
          std::move(params), SgdOptions{train.sgd_momentum, train.sgd_nesterov, train.weight_decay},
          paged);
  }
  return nullptr;
}

}  // namespace lathe
