#include "common/plan.h"

#include "absl/strings/str_cat.h"

namespace lathe {

Plan PlanOf(const JobSpec& spec, const Strategy& strategy) {
  Plan plan;
  plan.ranks = spec.resources.ranks;
  plan.device = spec.resources.device;
  plan.precision = spec.train.precision;
  plan.total_steps = spec.train.steps;
  plan.strategy = strategy;
  plan.gradient_accumulation = spec.train.global_batch / plan.ranks / strategy.micro_batch;
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
      !(IsAutomatic(spec.strategy) && spec.method == Method::kLora &&
        *plan.method == Method::kQLora)) {
    return error("method", MethodName(*plan.method), " but the spec's method is ",
                 MethodName(spec.method),
                 " (a plan may only choose qlora for lora, under "
                 "strategy: auto)");
  }
  if (plan.optimizer && *plan.optimizer != spec.train.optimizer &&
      !(IsAutomatic(spec.strategy) && spec.train.optimizer == OptimizerKind::kAdamW &&
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
  StrategyContext context = StrategyContextOf(spec);
  context.prefix = "plan";
  context.micro_batch_field = "plan.micro_batch";
  if (absl::Status status = ValidateStrategy(plan.strategy, context); !status.ok()) {
    return absl::Status(status.code(), absl::StrCat(source, ": ", status.message()));
  }
  const int64_t global = spec.train.global_batch;
  const int64_t micro_batch = plan.strategy.micro_batch;
  if (plan.gradient_accumulation != global / plan.ranks / micro_batch) {
    return error("gradient_accumulation", plan.gradient_accumulation, " but train.global_batch ",
                 global, " over ", plan.ranks, " rank(s) of micro-batch ", micro_batch, " needs ",
                 global / plan.ranks / micro_batch);
  }
  if (plan.total_steps != spec.train.steps) {
    return error("total_steps", plan.total_steps, " but the spec's train.steps is ",
                 spec.train.steps);
  }
  return absl::OkStatus();
}

}  // namespace lathe
