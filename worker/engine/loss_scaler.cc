#include "worker/engine/loss_scaler.h"

#include <algorithm>

namespace lathe {

LossScaler::LossScaler(bool enabled, const LossScalerOptions& options)
    : enabled_(enabled), options_(options) {
  state_.scale = enabled ? options.initial_scale : 1.0;
}

bool LossScaler::Update(bool gradients_finite) {
  if (!gradients_finite) {
    if (enabled_) {
      state_.scale = std::max(options_.min_scale, state_.scale * options_.backoff_factor);
    }
    state_.clean_steps = 0;
    return false;
  }
  if (enabled_ && ++state_.clean_steps >= options_.growth_interval) {
    state_.scale *= options_.growth_factor;
    state_.clean_steps = 0;
  }
  return true;
}

}  // namespace lathe
