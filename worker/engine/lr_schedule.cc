#include "worker/engine/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace lathe {

double LearningRate(const ScheduleSpec& schedule, double peak_lr, int64_t step,
                    int64_t total_steps) {
  const int64_t warmup = schedule.warmup_steps;
  if (step < warmup) {
    return peak_lr * static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup));
  }
  const double decay_steps = static_cast<double>(std::max<int64_t>(1, total_steps - warmup));
  switch (schedule.kind) {
    case ScheduleKind::kConstant:
      return peak_lr;
    case ScheduleKind::kLinear:
      return peak_lr * std::max(0.0, static_cast<double>(total_steps - step) / decay_steps);
    case ScheduleKind::kCosine: {
      double progress = static_cast<double>(step - warmup) / decay_steps;
      return peak_lr * std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * progress)));
    }
  }
  return peak_lr;
}

}  // namespace lathe
