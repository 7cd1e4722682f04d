// Dynamic loss scaling for fp16 training (docs/training.md, "Precision"): the loss is
// multiplied by `scale` before backward so that small fp16 gradients do not flush to zero,
// and the gradients are divided by it before clipping and the update. A step whose
// gradients overflow (inf/NaN) is skipped and the scale halved; after `growth_interval`
// clean steps in a row the scale doubles.
//
// No libtorch: the trainer decides whether the gradients were finite.
// Thread-safety: not thread-safe.
#ifndef LATHE_WORKER_ENGINE_LOSS_SCALER_H_
#define LATHE_WORKER_ENGINE_LOSS_SCALER_H_

#include <cstdint>

namespace lathe {

struct LossScalerOptions {
  double initial_scale = 65536.0;  // 2^16
  int64_t growth_interval = 2000;  // clean steps before the scale doubles
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  double min_scale = 1.0;  // the scale never falls below this
};

class LossScaler {
 public:
  // What a checkpoint keeps to continue the same scale sequence.
  struct State {
    double scale = 1.0;
    int64_t clean_steps = 0;  // finite steps since the last change of scale
  };

  // `enabled` false: the scale stays 1 and Update never changes it (fp32, bf16).
  LossScaler(bool enabled, const LossScalerOptions& options = {});

  double scale() const { return state_.scale; }
  bool enabled() const { return enabled_; }

  // Records the outcome of a step whose gradients were (not) finite: backs off after an
  // overflow, grows after growth_interval clean steps. Returns whether the optimizer may
  // step (false: skip this step).
  bool Update(bool gradients_finite);

  State state() const { return state_; }
  void Restore(const State& state) { state_ = state; }

 private:
  bool enabled_;
  LossScalerOptions options_;
  State state_;
};

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_LOSS_SCALER_H_
