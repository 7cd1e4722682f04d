#include "common/plan.h"

#include "absl/strings/str_cat.h"

namespace lathe {

int64_t AutoMicroBatch(int64_t per_rank_batch, int64_t seq_len) {
  for (int64_t m = per_rank_batch; m > 1; --m) {
    if (per_rank_batch % m == 0 && m * seq_len <= 8192) return m;
  }
  return 1;
}

Plan PlanFromSpec(const JobSpec& spec) {
  const StrategySpec& s = spec.strategy;
  const TrainSpec& train = spec.train;
  Plan plan;
  plan.ranks = spec.resources.ranks;
  plan.device = spec.resources.device;
  plan.precision = train.precision;
  plan.total_steps = train.steps;
  plan.fused_kernels = s.fused_kernels;
  if (!s.automatic) {
    plan.zero_stage = s.zero_stage;
    plan.offload_optimizer = s.offload_optimizer;
    plan.offload_params = s.offload_params;
    plan.activation_checkpointing = s.activation_checkpointing;
  }
  plan.chunked_loss = s.fused_kernels || (!s.automatic && s.chunked_loss);
  const int64_t per_rank = train.global_batch / plan.ranks;
  plan.micro_batch =
      train.micro_batch > 0 ? train.micro_batch : AutoMicroBatch(per_rank, spec.data.seq_len);
  plan.gradient_accumulation = per_rank / plan.micro_batch;
  if (s.automatic) {
    plan.explanation = absl::StrCat(
        "not planned by a coordinator: the spec's resources without sharding, offload or "
        "checkpointing; ",
        train.micro_batch > 0 ? "the spec's micro-batch"
                              : "micro-batch auto: the largest divisor of the per-rank batch "
                                "within 8192 tokens");
  } else {
    plan.explanation = "the spec's explicit strategy";
  }
  return plan;
}

JobSpec WithPlannedTechniques(const JobSpec& spec, const Plan& plan) {
  JobSpec out = spec;
  if (plan.method) out.method = *plan.method;
  if (plan.optimizer) out.train.optimizer = *plan.optimizer;
  return out;
}

absl::Status CheckPlanRunsSpec(const JobSpec& spec, const Plan& plan, absl::string_view source) {
  auto error = [source](absl::string_view field, const auto&... problem) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": plan.", field, ": ", problem...));
  };
  if (plan.method && *plan.method != spec.method &&
      !(spec.strategy.automatic && spec.method == Method::kLora &&
        *plan.method == Method::kQLora)) {
    return error("method", MethodName(*plan.method), " but the spec's method is ",
                 MethodName(spec.method),
                 " (a plan may only choose qlora for lora, under "
                 "strategy: auto)");
  }
  if (plan.optimizer && *plan.optimizer != spec.train.optimizer &&
      !(spec.strategy.automatic && spec.train.optimizer == OptimizerKind::kAdamW &&
        *plan.optimizer == OptimizerKind::kAdamW8bit)) {
    return error("optimizer", OptimizerKindName(*plan.optimizer),
                 " but the spec's train.optimizer is ", OptimizerKindName(spec.train.optimizer),
                 " (a plan may only choose adamw8bit for adamw, under strategy: auto)");
  }
  if (plan.ranks != spec.resources.ranks) {
    return error("ranks", plan.ranks, " but the spec's resources.ranks is ", spec.resources.ranks);
  }
  if (plan.device != spec.resources.device) {
    return error("device", DeviceKindName(plan.device), " but the spec's resources.device is ",
                 DeviceKindName(spec.resources.device));
  }
  if (plan.precision != spec.train.precision) {
    return error("precision", PrecisionName(plan.precision), " but the spec's train.precision is ",
                 PrecisionName(spec.train.precision));
  }
  const int64_t global = spec.train.global_batch;
  if (plan.micro_batch < 1 || global % plan.ranks != 0 ||
      (global / plan.ranks) % plan.micro_batch != 0) {
    return error("micro_batch", plan.micro_batch, " does not divide train.global_batch ", global,
                 " over ", plan.ranks, plan.ranks == 1 ? " rank" : " ranks");
  }
  if (plan.gradient_accumulation != global / plan.ranks / plan.micro_batch) {
    return error("gradient_accumulation", plan.gradient_accumulation, " but train.global_batch ",
                 global, " over ", plan.ranks, " rank(s) of micro-batch ", plan.micro_batch,
                 " needs ", global / plan.ranks / plan.micro_batch);
  }
  if (plan.total_steps != spec.train.steps) {
    return error("total_steps", plan.total_steps, " but the spec's train.steps is ",
                 spec.train.steps);
  }
  if (plan.zero_stage < 0 || plan.zero_stage > 3) {
    return error("zero_stage", "must be 0, 1, 2 or 3, got ", plan.zero_stage);
  }
  if (plan.offload_params && plan.zero_stage != 3) {
    return error("offload_params", "requires zero_stage 3, got zero_stage ", plan.zero_stage);
  }
  return absl::OkStatus();
}

}  // namespace lathe
