#include "common/strategy.h"

#include "absl/strings/str_cat.h"

namespace lathe {

bool IsAutomatic(const StrategySpec& spec) {
  return !spec.zero_stage && !spec.offload_optimizer && !spec.offload_params &&
         !spec.activation_checkpointing && !spec.chunked_loss;
}

std::optional<Strategy> FixedStrategy(const StrategySpec& spec) {
  if (!spec.zero_stage || !spec.offload_optimizer || !spec.offload_params ||
      !spec.activation_checkpointing || !spec.chunked_loss || !spec.micro_batch) {
    return std::nullopt;
  }
  Strategy s;
  s.zero_stage = *spec.zero_stage;
  s.offload_optimizer = *spec.offload_optimizer;
  s.offload_params = *spec.offload_params;
  s.activation_checkpointing = *spec.activation_checkpointing;
  s.chunked_loss = *spec.chunked_loss || spec.fused_kernels;
  s.micro_batch = *spec.micro_batch;
  s.fused_kernels = spec.fused_kernels;
  return s;
}

StrategySpec AsSpec(const Strategy& strategy) {
  StrategySpec spec;
  spec.zero_stage = strategy.zero_stage;
  spec.offload_optimizer = strategy.offload_optimizer;
  spec.offload_params = strategy.offload_params;
  spec.activation_checkpointing = strategy.activation_checkpointing;
  spec.chunked_loss = strategy.chunked_loss;
  spec.micro_batch = strategy.micro_batch;
  spec.fused_kernels = strategy.fused_kernels;
  return spec;
}

absl::Status ValidateStrategy(const StrategySpec& s, const StrategyContext& context) {
  auto field = [&](absl::string_view name) { return absl::StrCat(context.prefix, ".", name); };
  if (s.zero_stage && (*s.zero_stage < 0 || *s.zero_stage > 3)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field("zero_stage"), ": must be 0, 1, 2 or 3, got ", *s.zero_stage));
  }
  // Parameters live sharded only under ZeRO-3; below it every rank holds them all.
  if (s.offload_params.value_or(false) && s.zero_stage && *s.zero_stage != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        field("offload_params"), ": requires zero_stage 3, got zero_stage ", *s.zero_stage));
  }
  if (s.micro_batch) {
    const int64_t micro = *s.micro_batch;
    const int64_t ranks = context.ranks;
    // micro * ranks fits: both are at most global_batch when the first test passes.
    if (micro < 1 || (context.global_batch > 0 && (micro > context.global_batch / ranks ||
                                                   context.global_batch % (micro * ranks) != 0))) {
      return absl::InvalidArgumentError(absl::StrCat(
          context.micro_batch_field, ": ", micro, " does not divide train.global_batch ",
          context.global_batch, " over ", ranks, ranks == 1 ? " rank" : " ranks"));
    }
  }
  const StrategyLimits& limits = context.limits;
  if (s.zero_stage && *s.zero_stage > limits.max_zero_stage) {
    return absl::UnimplementedError(absl::StrCat(
        field("zero_stage"), ": ", *s.zero_stage,
        " is not supported by this engine yet (supported: 0 to ", limits.max_zero_stage, ")"));
  }
  const bool offload = s.offload_optimizer.value_or(false) || s.offload_params.value_or(false);
  if (context.zeroth_order && !limits.sharded_zeroth_order &&
      (s.zero_stage.value_or(0) > 0 || offload)) {
    return absl::UnimplementedError(absl::StrCat(
        field("zero_stage"), ": ", s.zero_stage.value_or(0), offload ? " with offload" : "",
        " with method mezo is not supported by this engine yet (MeZO runs on a replicated "
        "model, zero_stage 0: it keeps no gradients or optimizer state to shard)"));
  }
  if (!limits.offload) {
    for (const auto& [name, on] : {std::pair{"offload_optimizer", s.offload_optimizer},
                                   std::pair{"offload_params", s.offload_params}}) {
      if (on.value_or(false)) {
        return absl::UnimplementedError(absl::StrCat(
            field(name), ": true is not supported by this engine yet (no CPU offload)"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateStrategy(const Strategy& strategy, const StrategyContext& context) {
  return ValidateStrategy(AsSpec(strategy), context);
}

}  // namespace lathe
