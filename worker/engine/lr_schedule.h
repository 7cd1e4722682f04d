// The learning rate of each optimizer step (docs/training.md, "Optimizer step"): linear
// warmup, then cosine, linear or constant, as transformers' get_*_schedule_with_warmup.
//
// Thread-safety: pure function.
#ifndef LATHE_WORKER_ENGINE_LR_SCHEDULE_H_
#define LATHE_WORKER_ENGINE_LR_SCHEDULE_H_

#include <cstdint>

#include "common/job_spec.h"

namespace lathe {

// The learning rate of 0-based step `step` of `total_steps`, peak `peak_lr`.
// REQUIRES: 0 <= step < total_steps.
double LearningRate(const ScheduleSpec& schedule, double peak_lr, int64_t step,
                    int64_t total_steps);

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_LR_SCHEDULE_H_
