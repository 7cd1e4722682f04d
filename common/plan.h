// How a job runs: the plan the coordinator makes at submit and the trainer follows
// (docs/architecture.md, "The path of a job"). It mirrors lathe.v1.Plan
// (common/proto/job_spec_proto.h converts); the engine takes this struct so that it builds without
// protobuf.
//
// Only the planner (planner/, docs/planner.md) decides what a spec leaves to it: the
// coordinator plans submitted jobs, and `lathe-worker train --spec` plans locally as
// `lathe plan --local` does. The trainer never decides any of this again.
//
// Thread-safety: plain values and pure functions.
#ifndef LATHE_COMMON_PLAN_H_
#define LATHE_COMMON_PLAN_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "common/memory_components.h"

namespace lathe {

// Bytes per rank by component, and the peak of their sum.
struct MemoryBytes {
  std::array<uint64_t, kNumMemoryComponents> components{};
  uint64_t total = 0;
};

// Whether a decoder block's attention runs as libtorch's fused scaled_dot_product_attention,
// which keeps a log-sum-exp per query row for backward, rather than the explicit
// softmax(q k^T + mask) v, which keeps the T x T probabilities: with fused kernels, always on
// CUDA, and on the CPU from kCpuFusedAttentionMinTokens tokens, where libtorch's CPU flash
// kernel measured faster than the explicit path (bench/RESULTS.md, "fused_ops_bench";
// forward and backward at 16 heads of 64: 0.88x its time at 384 tokens, 0.29x at 2,048,
// 1.18x at 256). The engine (CausalLm) and the planner's memory model both ask this.
inline constexpr int64_t kCpuFusedAttentionMinTokens = 384;
inline bool FusedAttention(bool fused_kernels, DeviceKind device, int64_t tokens) {
  return fused_kernels && (device == DeviceKind::kCuda || tokens >= kCpuFusedAttentionMinTokens);
}

struct Plan {
  int64_t ranks = 1;
  DeviceKind device = DeviceKind::kCpu;
  Strategy strategy;
  int64_t gradient_accumulation = 1;  // micro-batches per rank per optimizer step
  int64_t total_steps = 0;            // train.steps; 0: counted from train.epochs by the trainer
  Precision precision = Precision::kFp32;
  // A memory technique the planner chose under `strategy: auto` when nothing fitted with the
  // spec's own method and optimizer (docs/planner.md, "Memory techniques"): method lora ->
  // qlora, optimizer adamw -> adamw8bit. Absent: the spec's.
  std::optional<Method> method;
  std::optional<OptimizerKind> optimizer;
  MemoryBytes predicted_memory;  // the memory model's; zero until the planner predicts
  // What the planner multiplied predicted_memory.total by, learned from the measured peaks
  // of earlier attempts under calibration_key (planner/calibration.h).
  double memory_correction = 1.0;
  std::string calibration_key;
  std::string explanation;  // why this plan, in a sentence or two
};

// The plan that runs `spec` (valid, ValidateJobSpec) with `strategy`: the spec's ranks,
// device, precision and steps, and the accumulation that makes up its global batch.
// REQUIRES: strategy.micro_batch divides the spec's per-rank batch.
Plan PlanOf(const JobSpec& spec, const Strategy& strategy);

// The spec as it runs under `plan`: its method and optimizer replaced by the plan's choices.
JobSpec WithPlannedTechniques(const JobSpec& spec, const Plan& plan);

// Whether `plan` can run `spec`: INVALID_ARGUMENT naming the plan field ("<source>:
// plan.micro_batch: ...") for ranks, device or precision other than the spec's, a
// micro-batch below 1 or one that does not divide the spec's batch over the ranks, an
// accumulation that does not match, total_steps other than train.steps, and a strategy
// ValidateStrategy refuses.
absl::Status CheckPlanRunsSpec(const JobSpec& spec, const Plan& plan, absl::string_view source);

}  // namespace lathe

#endif  // LATHE_COMMON_PLAN_H_
