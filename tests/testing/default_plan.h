// The plan the engine tests train under when they do not ask the planner: the spec's fixed
// strategy fields, and for each field the spec leaves to the planner a fixed stand-in
// (replicated, no offload, no checkpointing, the loss chunked exactly when fused kernels
// are on, and the largest micro-batch dividing the per-rank batch within 8192 tokens).
// Production code never does this: only the planner resolves "auto" (common/plan.h).
#ifndef LATHE_TESTS_TESTING_DEFAULT_PLAN_H_
#define LATHE_TESTS_TESTING_DEFAULT_PLAN_H_

#include <cstdint>

#include "common/job_spec.h"
#include "common/plan.h"
#include "common/strategy.h"

namespace lathe::testing {

// Fixes every strategy field `spec` leaves to the planner at its default (0, false), as a
// strategy map that leaves the field out does; the micro-batch stays as it is.
inline void FixStrategy(StrategySpec* spec) {
  spec->zero_stage = spec->zero_stage.value_or(0);
  spec->offload_optimizer = spec->offload_optimizer.value_or(false);
  spec->offload_params = spec->offload_params.value_or(false);
  spec->activation_checkpointing = spec->activation_checkpointing.value_or(false);
  spec->chunked_loss = spec->chunked_loss.value_or(false);
}

inline Plan DefaultPlan(const JobSpec& spec) {
  const StrategySpec& s = spec.strategy;
  Strategy strategy;
  strategy.zero_stage = s.zero_stage.value_or(0);
  strategy.offload_optimizer = s.offload_optimizer.value_or(false);
  strategy.offload_params = s.offload_params.value_or(false);
  strategy.activation_checkpointing = s.activation_checkpointing.value_or(false);
  strategy.fused_kernels = s.fused_kernels;
  strategy.chunked_loss = s.fused_kernels || s.chunked_loss.value_or(false);
  const int64_t per_rank = spec.train.global_batch / spec.resources.ranks;
  strategy.micro_batch = 1;
  if (s.micro_batch) {
    strategy.micro_batch = *s.micro_batch;
  } else {
    for (int64_t m = per_rank; m > 1; --m) {
      if (per_rank % m == 0 && m * spec.data.seq_len <= 8192) {
        strategy.micro_batch = m;
        break;
      }
    }
  }
  return PlanOf(spec, strategy);
}

}  // namespace lathe::testing

#endif  // LATHE_TESTS_TESTING_DEFAULT_PLAN_H_
