// How a job runs on each rank: its ZeRO stage, offload, activation checkpointing, loss and
// micro-batch (docs/planner.md). The fields are declared once, in StrategyFields, and used
// in two forms:
//   - Strategy: every field decided. The plan holds one (common/plan.h); the trainer, the
//     memory model and the sharded model follow it.
//   - StrategySpec: what a job spec asks for. An empty field is the planner's to choose
//     (`auto` in the spec); a field with a value is fixed.
// Every rule a strategy obeys is stated once, in ValidateStrategy. lathe.v1.Strategy mirrors
// the fields on the wire (common/proto/job_spec_proto.h converts).
//
// Thread-safety: plain values and pure functions.
#ifndef LATHE_COMMON_STRATEGY_H_
#define LATHE_COMMON_STRATEGY_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace lathe {
namespace strategy_internal {
template <typename T>
using Decided = T;

template <typename T>
inline constexpr bool kIsOptional = false;
template <typename T>
inline constexpr bool kIsOptional<std::optional<T>> = true;

// A field's initial value: `value` in a Strategy, empty in a StrategySpec.
template <typename Field, typename T>
constexpr Field Initial(T value) {
  if constexpr (kIsOptional<Field>) {
    return std::nullopt;
  } else {
    return value;
  }
}
}  // namespace strategy_internal

// `Field<T>` is T in a Strategy and std::optional<T> in a StrategySpec. A Strategy starts
// at the engine's defaults below; a StrategySpec starts empty ("strategy: auto").
template <template <typename> class Field>
struct StrategyFields {
  // 0: every rank holds the whole model state; 1 shards the optimizer state over the ranks,
  // 2 the gradients too, 3 the parameters too (gathered unit by unit as they are used).
  Field<int64_t> zero_stage = strategy_internal::Initial<Field<int64_t>>(0);
  // Optimizer state and the optimizer step in host memory.
  Field<bool> offload_optimizer = strategy_internal::Initial<Field<bool>>(false);
  // ZeRO-3's parameter slices in host memory, copied to the device as a unit is gathered.
  Field<bool> offload_params = strategy_internal::Initial<Field<bool>>(false);
  // Keep only each block's input in forward and recompute the rest in backward.
  Field<bool> activation_checkpointing = strategy_internal::Initial<Field<bool>>(false);
  // The loss in vocabulary chunks, without [tokens, vocab] logits. With fused kernels the
  // loss always is (the fused linear cross-entropy): a Strategy then says true.
  Field<bool> chunked_loss = strategy_internal::Initial<Field<bool>>(true);
  // The engine's fused kernels (kernels/); false runs the plain ATen composition. Always the
  // spec's: the planner does not choose it.
  bool fused_kernels = true;
  // Sequences per forward/backward on each rank (the spec's train.micro_batch); >= 1.
  Field<int64_t> micro_batch = strategy_internal::Initial<Field<int64_t>>(1);
};

using Strategy = StrategyFields<strategy_internal::Decided>;
using StrategySpec = StrategyFields<std::optional>;

// Whether the spec leaves the whole strategy to the planner ("strategy: auto"): every field
// but the micro-batch (which train.micro_batch fixes or not on its own) empty. Only then may
// the planner also choose a memory technique (docs/planner.md, "Memory techniques").
bool IsAutomatic(const StrategySpec& spec);

// The strategy `spec` fixes completely; nullopt when it leaves a field to the planner. With
// fused kernels chunked_loss is true whatever the spec says.
std::optional<Strategy> FixedStrategy(const StrategySpec& spec);

// `strategy` as a spec that fixes every field.
StrategySpec AsSpec(const Strategy& strategy);

// The engine's limits on the strategy (common/capabilities.h, Engine().strategy). The
// defaults limit nothing: what a spec may say on its own (ValidateJobSpec).
struct StrategyLimits {
  int64_t max_zero_stage = 3;
  bool offload = true;  // offload_optimizer, offload_params
  // MeZO (zeroth-order) with a ZeRO stage above 0 or offload.
  bool sharded_zeroth_order = true;
};

// What the rules need to know of the job besides its strategy.
struct StrategyContext {
  // Field paths in messages: "<prefix>.zero_stage"; the micro-batch is `micro_batch_field`.
  absl::string_view prefix = "strategy";
  absl::string_view micro_batch_field = "train.micro_batch";
  int64_t ranks = 1;
  int64_t global_batch = 0;   // sequences per step over all ranks; 0: not checked
  bool zeroth_order = false;  // method mezo: no gradients or optimizer state to shard
  StrategyLimits limits;
};

// Every rule of a strategy, each checked here and nowhere else. A field the spec leaves
// empty satisfies every rule (the planner chooses only values that do). Returns the first
// problem:
//   INVALID_ARGUMENT "<prefix>.zero_stage: must be 0, 1, 2 or 3, got 4";
//   INVALID_ARGUMENT "<prefix>.offload_params: requires zero_stage 3, got zero_stage 2";
//   INVALID_ARGUMENT "<micro_batch_field>: 3 does not divide train.global_batch 8 over 2
//     ranks" (or a micro-batch below 1);
//   UNIMPLEMENTED "<prefix>.zero_stage: 3 is not supported by this engine yet (supported: 0
//     to 2)", and the same for offload beyond `limits`;
//   UNIMPLEMENTED "<prefix>.zero_stage: 1 with method mezo is not supported by this engine
//     yet (...)" for sharding or offload under MeZO, beyond `limits`.
absl::Status ValidateStrategy(const StrategySpec& spec, const StrategyContext& context);
absl::Status ValidateStrategy(const Strategy& strategy, const StrategyContext& context);

}  // namespace lathe

#endif  // LATHE_COMMON_STRATEGY_H_
