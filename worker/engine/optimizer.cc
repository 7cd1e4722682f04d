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
// of torch 2.x, rounding for rounding: the first moment by lerp (1.13 multiplied and added),
// the second by multiply and addcmul (weight decay is applied before, by the caller).
void AdamWUpdate(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                 at::Tensor& exp_avg_sq, const AdamWOptions& o, int64_t step, double lr) {
  const double bias_correction1 = 1.0 - std::pow(o.beta1, step);
  const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(o.beta2, step));
  exp_avg.lerp_(grad, 1.0 - o.beta1);
  exp_avg_sq.mul_(o.beta2).addcmul_(grad, grad, 1.0 - o.beta2);
  at::Tensor denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(o.eps);
  param.addcdiv_(exp_avg, denom, -lr / bias_correction1);
}

class AdamW final : public Optimizer {
 public:
  AdamW(std::vector<NamedParameter> params, const AdamWOptions& options, bool paged,
        const OptimizerSharding* sharding)
      : Optimizer(std::move(params), paged, sharding), options_(options) {
    for (size_t i = 0; i < this->params().size(); ++i) {
      const NamedParameter& p = this->params()[i];
      AddState(i, "exp_avg", at::zeros_like(p.tensor));
      AddState(i, "exp_avg_sq", at::zeros_like(p.tensor));
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
  AdamW8bit(std::vector<NamedParameter> params, const AdamWOptions& options, bool paged,
            const OptimizerSharding* sharding)
      : Optimizer(std::move(params), paged, sharding), options_(options) {
    const at::Device device =
        this->params().empty() ? at::Device(at::kCPU) : this->params()[0].tensor.device();
    for (bool is_signed : {true, false}) {
      at::Tensor map = kernels::DynamicQuantizationMap(is_signed).to(device);
      mids_[is_signed] = (map.narrow(0, 0, 255) + map.narrow(0, 1, 255)) / 2;
      maps_[is_signed] = std::move(map);
    }
    for (size_t i = 0; i < this->params().size(); ++i) {
      const NamedParameter& p = this->params()[i];
      // Decided by the whole tensor, so that a rank's small piece of a large one is 8-bit too.
      if (WholeNumel(i) < kMin8bitElements || KeepsFloat32Moments(p.name)) {
        AddState(i, "exp_avg", at::zeros_like(p.tensor));
        AddState(i, "exp_avg_sq", at::zeros_like(p.tensor));
        continue;
      }
      const int64_t n = p.tensor.numel();
      const int64_t blocks = (n + kBlock8bit - 1) / kBlock8bit;
      const at::TensorOptions f32 = p.tensor.options().dtype(at::kFloat);
      // The first moment on the signed map, the second on the unsigned one.
      for (auto [moment, is_signed] :
           {std::pair{"exp_avg", true}, std::pair{"exp_avg_sq", false}}) {
        at::Tensor codes = at::empty({blocks * kBlock8bit}, f32.dtype(at::kByte));
        at::Tensor absmax = at::empty({blocks}, f32);
        Quantize(at::zeros({blocks * kBlock8bit}, f32), mids_[is_signed], codes, absmax);
        AddState(i, moment, std::move(codes), StateLayout::kBlocks, ".codes");
        AddState(i, moment, std::move(absmax), StateLayout::kBlocks, ".absmax");
      }
    }
  }

 private:
  void Update(size_t i, at::Tensor& param, const at::Tensor& grad, double lr) override {
    std::vector<at::Tensor>& s = state(i);
    if (param.numel() == 0) return;  // a rank's empty piece
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
  bool relative_step = false;
};

// Adafactor's relative step size at step `step` for a parameter of RMS `param_rms`.
double RelativeStep(double param_rms, int64_t step) {
  return std::max(1e-3, param_rms) * std::min(1e-2, 1.0 / std::sqrt(static_cast<double>(step)));
}

class Adafactor final : public Optimizer {
 public:
  Adafactor(std::vector<NamedParameter> params, const AdafactorOptions& options, bool paged,
            const OptimizerSharding* sharding)
      : Optimizer(std::move(params), paged, sharding), options_(options) {
    for (size_t i = 0; i < this->params().size(); ++i) {
      const at::Tensor& t = this->params()[i].tensor;
      const std::vector<int64_t> shape =
          piece(i) ? piece(i)->shape : std::vector<int64_t>(t.sizes().begin(), t.sizes().end());
      if (shape.size() >= 2) {  // factored over the last two dimensions
        std::vector<int64_t> row(shape.begin(), shape.end() - 1);
        std::vector<int64_t> col(shape.begin(), shape.end() - 2);
        col.push_back(shape.back());
        AddState(i, "exp_avg_sq_row", at::zeros(row, t.options()), StateLayout::kWholeTensor);
        AddState(i, "exp_avg_sq_col", at::zeros(col, t.options()), StateLayout::kWholeTensor);
      } else {
        AddState(i, "exp_avg_sq", at::zeros_like(t));
      }
      if (options_.beta1 > 0) AddState(i, "exp_avg", at::zeros_like(t));
    }
  }

 private:
  void Update(size_t i, at::Tensor& param, const at::Tensor& grad, double lr) override {
    if (piece(i) != nullptr) {
      ShardedUpdate(i, *piece(i), param, grad, lr);
      return;
    }
    std::vector<at::Tensor>& s = state(i);
    if (options_.relative_step) {
      lr = RelativeStep(at::linalg_vector_norm(param, 2)
                            .div(std::sqrt(static_cast<double>(param.numel())))
                            .item<double>(),
                        steps());
    }
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
    Apply(i, param, update, lr);
  }

  // The same update for a rank's piece of a tensor (1-D, any element range, possibly empty):
  // the row and column sums of the squared gradient and the update's sum of squares are
  // summed over the ranks, so every rank's statistics are the whole tensor's. A path of its
  // own because its sums round differently from Update's means and norm, which the Python
  // reference repeats bit for bit.
  void ShardedUpdate(size_t i, const OptimizerSharding::Piece& piece, at::Tensor& param,
                     const at::Tensor& grad, double lr) {
    std::vector<at::Tensor>& s = state(i);
    if (options_.relative_step) {
      at::Tensor sum_squares = param.square().sum().reshape({1});
      SumOverRanks(sum_squares);
      lr = RelativeStep(std::sqrt(sum_squares.item<double>() / static_cast<double>(WholeNumel(i))),
                        steps());
    }
    const double rho = 1.0 - std::pow(static_cast<double>(steps()), options_.decay_rate);
    const int64_t n = grad.numel();
    at::Tensor squared = grad.mul(grad).add_(1e-30);
    at::Tensor update;
    if (piece.shape.size() >= 2) {
      // The tensor as `matrices` stacked [rows, cols] matrices; the piece touches the stacked
      // rows [r0, r1), and starts `lead` elements into row r0.
      const int64_t cols = piece.shape.back(), rows = piece.shape[piece.shape.size() - 2];
      const int64_t matrices = WholeNumel(i) / (rows * cols);
      const int64_t r0 = piece.offset / cols, r1 = (piece.offset + n + cols - 1) / cols;
      const int64_t lead = piece.offset - r0 * cols;
      auto as_rows = [&](const at::Tensor& x) {  // the piece, padded with zeros to whole rows
        at::Tensor out = at::zeros({(r1 - r0) * cols}, x.options());
        out.narrow(0, lead, n).copy_(x);
        return out.view({r1 - r0, cols});
      };
      // [row sums of every matrix, then column sums of every matrix].
      at::Tensor sums = at::zeros({matrices * (rows + cols)}, grad.options());
      if (n > 0) {
        at::Tensor sq = as_rows(squared);
        sums.narrow(0, r0, r1 - r0).copy_(sq.sum(1));
        for (int64_t m = r0 / rows; m * rows < r1; ++m) {
          const int64_t a = std::max(r0, m * rows), b = std::min(r1, (m + 1) * rows);
          sums.narrow(0, matrices * rows + m * cols, cols).add_(sq.narrow(0, a - r0, b - a).sum(0));
        }
      }
      SumOverRanks(sums);
      at::Tensor &row = s[0], &col = s[1];
      row.mul_(rho).add_(sums.narrow(0, 0, matrices * rows).view(row.sizes()), (1.0 - rho) / cols);
      col.mul_(rho).add_(sums.narrow(0, matrices * rows, matrices * cols).view(col.sizes()),
                         (1.0 - rho) / rows);
      if (n > 0) {
        at::Tensor r = row.div(row.mean(-1, /*keepdim=*/true))
                           .rsqrt_()
                           .reshape({-1})
                           .narrow(0, r0, r1 - r0)
                           .unsqueeze(1);
        at::Tensor c = col.rsqrt().reshape({matrices, cols});
        if (matrices > 1) {
          c = c.index_select(
              0, at::arange(r0, r1, grad.options().dtype(at::kLong)).div(rows, "floor"));
        }
        update = r.mul(c).view({-1}).narrow(0, lead, n).mul(grad);
      } else {
        update = at::zeros_like(grad);
      }
    } else {
      s[0].mul_(rho).add_(squared, 1.0 - rho);
      update = s[0].rsqrt().mul_(grad);
    }
    at::Tensor sum_squares = update.square().sum().reshape({1});
    SumOverRanks(sum_squares);
    update.div_(sum_squares.div_(static_cast<double>(WholeNumel(i)))
                    .sqrt_()
                    .div_(options_.clip_threshold)
                    .clamp_(1.0));
    Apply(i, param, update, lr);
  }

  // The clipped update u of parameter i: through the first moment when there is one, then
  // the decoupled weight decay and p -= lr u.
  void Apply(size_t i, at::Tensor& param, at::Tensor update, double lr) {
    if (options_.beta1 > 0) {
      at::Tensor& exp_avg = state(i).back();
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
  Sgd(std::vector<NamedParameter> params, const SgdOptions& options, bool paged,
      const OptimizerSharding* sharding)
      : Optimizer(std::move(params), paged, sharding), options_(options) {
    if (options_.momentum == 0.0) return;
    for (size_t i = 0; i < this->params().size(); ++i) {
      AddState(i, "momentum_buffer", at::zeros_like(this->params()[i].tensor));
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

Optimizer::Optimizer(std::vector<NamedParameter> params, bool paged,
                     const OptimizerSharding* sharding)
    : params_(std::move(params)),
      paged_(paged),
      sharding_(sharding ? *sharding : OptimizerSharding{}),
      state_(params_.size()),
      state_info_(params_.size()) {
  for (const NamedParameter& p : params_) {
    TORCH_CHECK(p.tensor.is_contiguous(), "trainable tensor ", p.name, " is not contiguous");
  }
  TORCH_CHECK(sharding_.pieces.empty() || sharding_.pieces.size() == params_.size(),
              "a sharded optimizer needs a piece for every parameter");
}

int64_t Optimizer::WholeNumel(size_t i) const {
  if (sharding_.pieces.empty()) return params_[i].tensor.numel();
  int64_t n = 1;
  for (int64_t d : sharding_.pieces[i].shape) n *= d;
  return n;
}

void Optimizer::AddState(size_t param, std::string kind, at::Tensor tensor, StateLayout layout,
                         std::string suffix) {
  state_info_[param].push_back({std::move(kind), std::move(suffix), layout});
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
  std::vector<at::Tensor> grads;
  for (const NamedParameter& p : params_) grads.push_back(p.tensor.grad());
  Step(lr, grads);
}

void Optimizer::Step(double lr, const std::vector<at::Tensor>& grads) {
  at::NoGradGuard no_grad;
  ++steps_;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor param = params_[i].tensor;
    const at::Tensor& grad = grads[i];
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
    for (size_t k = 0; k < state_[i].size(); ++k) {
      const StateInfo& info = state_info_[i][k];
      out->Add(absl::StrCat(info.kind, ".", params_[i].name, info.suffix), state_[i][k]);
    }
  }
}

absl::Status Optimizer::RestoreState(const std::shared_ptr<const SafetensorsFile>& file,
                                     int64_t steps) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    for (size_t k = 0; k < state_[i].size(); ++k) {
      const StateInfo& info = state_info_[i][k];
      const std::string name = absl::StrCat(info.kind, ".", params_[i].name, info.suffix);
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

std::unique_ptr<Optimizer> MakeOptimizer(std::vector<NamedParameter> params, const TrainSpec& train,
                                         const OptimizerSharding* sharding) {
  const AdamWOptions adam{train.adam_beta1, train.adam_beta2, train.adam_eps, train.weight_decay};
  const bool paged = train.paged_optimizer;
  switch (train.optimizer) {
    case OptimizerKind::kAdamW:
      return std::make_unique<AdamW>(std::move(params), adam, paged, sharding);
    case OptimizerKind::kAdamW8bit:
      return std::make_unique<AdamW8bit>(std::move(params), adam, paged, sharding);
    case OptimizerKind::kAdafactor:
      return std::make_unique<Adafactor>(
          std::move(params),
          AdafactorOptions{train.adafactor_beta1, train.adafactor_decay_rate,
                           train.adafactor_clip_threshold, train.weight_decay,
                           train.adafactor_relative_step},
          paged, sharding);
    case OptimizerKind::kSgd:
      return std::make_unique<Sgd>(
          std::move(params), SgdOptions{train.sgd_momentum, train.sgd_nesterov, train.weight_decay},
          paged, sharding);
  }
  return nullptr;
}

}  // namespace lathe
