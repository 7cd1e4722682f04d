#include "planner/planner.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/flops.h"
#include "common/lora_targets.h"
#include "common/model_config.h"
#include "planner/calibration.h"
#include "planner/model_states.h"

namespace lathe {
namespace {

std::string StrategyText(const Strategy& p) {
  std::vector<std::string> parts = {absl::StrCat("ZeRO-", p.zero_stage)};
  if (p.offload_optimizer) parts.push_back("optimizer offload");
  if (p.offload_params) parts.push_back("parameter offload");
  if (p.activation_checkpointing) parts.push_back("checkpointing");
  if (!p.chunked_loss) parts.push_back("unfused loss");
  parts.push_back(absl::StrCat("micro-batch ", p.micro_batch));
  return absl::StrJoin(parts, ", ");
}

MemoryCorrection CorrectionFor(const JobShape& job, const Strategy& point,
                               const PlanOptions& options) {
  if (options.calibration == nullptr) return {};
  return options.calibration->Lookup(CalibrationKey(job, point, options.pool));
}

uint64_t Corrected(const MemoryEstimate& memory, const MemoryCorrection& correction) {
  return static_cast<uint64_t>(static_cast<double>(memory.device.total) * correction.factor);
}

std::string CorrectionText(const MemoryCorrection& correction) {
  if (correction.samples == 0) return "";
  return absl::StrFormat(" (the memory model's estimate x %.3f, learned from %d measured %s)",
                         correction.factor, correction.samples,
                         correction.samples == 1 ? "attempt" : "attempts");
}

std::string BreakdownText(const Candidate& c) {
  std::vector<std::string> parts;
  for (MemoryComponent m : kMemoryComponents) {
    const uint64_t bytes = c.memory.device.components[static_cast<int>(m)];
    if (bytes > 0) parts.push_back(absl::StrCat(MemoryComponentName(m), " ", FormatBytes(bytes)));
  }
  return absl::StrCat(absl::StrJoin(parts, ", "), CorrectionText(c.correction));
}

// The choices of one field: the spec's value when it fixes the field, else `all`.
template <typename T>
std::vector<T> Choices(const std::optional<T>& fixed, std::vector<T> all) {
  if (fixed) return {*fixed};
  return all;
}

struct Totals {
  int64_t frozen = 0, trainable = 0;
};

Totals TotalsOf(const std::vector<UnitElements>& units) {
  Totals t;
  for (const UnitElements& u : units) {
    t.frozen += u.frozen;
    t.trainable += u.trainable;
  }
  return t;
}

void Time(const JobSpec& spec, const JobShape& job, const Totals& totals,
          const PlanOptions& options, double flops_per_token, Candidate& c) {
  const DeviceRates& r = options.rates;
  const Strategy& p = c.point;
  const int64_t n = job.ranks;
  const int64_t per_rank = spec.train.global_batch / n;
  const int64_t accumulation = per_rank / p.micro_batch;
  const double micro_tokens = static_cast<double>(p.micro_batch * job.seq_len);
  const double efficiency = micro_tokens / (micro_tokens + r.half_saturation_tokens);
  c.compute_seconds =
      static_cast<double>(per_rank) * job.seq_len * flops_per_token / (r.flops * efficiency);
  const double grads = 4.0 * static_cast<double>(totals.trainable);
  const double frozen = static_cast<double>(WeightBytes(job) * totals.frozen);
  double comm = 0;
  if (n > 1) {
    const double f = static_cast<double>(n - 1) / static_cast<double>(n);
    switch (p.zero_stage) {
      case 0:  // all-reduce of the gradients
      case 1:  // reduce-scatter of the gradients, all-gather of the updated parameters
        comm = 2 * f * grads;
        break;
      case 2:  // reduce-scatter after every micro-batch's backward
        comm = f * grads * (accumulation + 1);
        break;
      default:  // every unit gathered for forward and again for backward, every micro-batch;
                // prefetch hides about half of the gathers (bench/RESULTS.md, ZeRO memory)
        comm = f * grads * (accumulation + 1) + 0.5 * 2 * f * (frozen + grads) * accumulation;
        break;
    }
  }
  c.comm_seconds = comm / r.link_bytes_per_s;
  double offload = 0;
  const double shard = 1.0 / static_cast<double>(n);
  if (p.offload_optimizer) offload += 2 * grads * shard;  // gradients out, parameters back
  if (p.offload_params) offload += 2 * (frozen + grads) * shard * accumulation;
  c.offload_seconds = offload / r.host_link_bytes_per_s;
  c.step_seconds = c.compute_seconds + c.comm_seconds + c.offload_seconds;
}

std::string SecondsText(double s) { return absl::StrFormat("%.3g s", s); }

// PlanJob for the spec's own method and optimizer.
absl::StatusOr<PlanResult> PlanAsGiven(const JobSpec& spec, const ModelShape& shape,
                                       const PlanOptions& options) {
  if (TrainsLora(spec)) {
    absl::Status targets = MatchLoraTargets(spec.lora, shape.config).status();
    if (!targets.ok()) return targets;
  }
  const JobShape job = JobShapeOf(spec, shape);
  absl::StatusOr<std::vector<UnitElements>> units =
      UnitsOf(shape, job.method, job.lora_rank, job.lora_targets, job.saved);
  if (!units.ok()) return units.status();
  const Totals totals = TotalsOf(*units);
  const double flops = TrainingFlopsPerToken(shape.config, spec, spec.data.seq_len, false);
  const double flops_recompute = TrainingFlopsPerToken(shape.config, spec, spec.data.seq_len, true);

  const StrategySpec& s = spec.strategy;
  const StrategyContext context = StrategyContextOf(spec, options.limits);
  const bool cpu = spec.resources.device == DeviceKind::kCpu;
  const int64_t ranks = spec.resources.ranks;
  // MeZO (nothing to shard) stays at stage 0 without offload.
  const bool shards = spec.method != Method::kMezo;
  std::vector<int64_t> stages = {0};
  if (ranks > 1 && shards) {
    for (int64_t z = 1; z <= options.limits.max_zero_stage; ++z) stages.push_back(z);
  }
  // On the CPU offloading saves nothing (host and device memory are one): only when fixed.
  const std::vector<bool> offload_choices = options.limits.offload && !cpu && shards
                                                ? std::vector<bool>{false, true}
                                                : std::vector<bool>{false};
  std::vector<int64_t> micro_batches;
  const int64_t per_rank = spec.train.global_batch / ranks;
  for (int64_t m = 1; m <= per_rank; ++m) {
    if (per_rank % m == 0) micro_batches.push_back(m);
  }
  // With fused kernels the loss is the fused linear cross-entropy, chunked.
  const std::optional<bool> chunked_loss =
      s.fused_kernels ? std::optional<bool>(true) : s.chunked_loss;
  const uint64_t budget = static_cast<uint64_t>(static_cast<double>(options.rates.memory_bytes) *
                                                (1.0 - options.headroom));

  std::vector<Candidate> candidates;
  for (int64_t stage : Choices(s.zero_stage, stages)) {
    for (bool offload_optimizer : Choices(s.offload_optimizer, offload_choices)) {
      // Offloading a replicated optimizer is never the planner's idea.
      if (offload_optimizer && stage == 0 && !s.offload_optimizer) continue;
      for (bool offload_params : Choices(s.offload_params, offload_choices)) {
        for (bool ckpt : Choices(s.activation_checkpointing, {false, true})) {
          for (bool chunked : Choices(chunked_loss, {true, false})) {
            for (int64_t micro : Choices(s.micro_batch, micro_batches)) {
              Candidate c;
              c.point = {stage,   offload_optimizer, offload_params, ckpt,
                         chunked, s.fused_kernels,   micro};
              if (!ValidateStrategy(c.point, context).ok()) continue;
              absl::StatusOr<MemoryEstimate> memory = EstimateMemory(job, c.point);
              if (!memory.ok()) return memory.status();
              c.memory = *memory;
              c.correction = CorrectionFor(job, c.point, options);
              c.peak = Corrected(c.memory, c.correction);
              c.fits = c.peak <= budget;
              Time(spec, job, totals, options, ckpt ? flops_recompute : flops, c);
              candidates.push_back(std::move(c));
            }
          }
        }
      }
    }
  }
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     if (a.fits != b.fits) return a.fits;
                     if (a.fits) {
                       if (a.step_seconds != b.step_seconds) return a.step_seconds < b.step_seconds;
                     }
                     return a.peak < b.peak;
                   });
  if (candidates.empty() || !candidates.front().fits) {
    const Candidate* smallest = nullptr;
    for (const Candidate& c : candidates) {
      if (smallest == nullptr || c.peak < smallest->peak) {
        smallest = &c;
      }
    }
    std::string suggestions;
    if (smallest != nullptr) {
      // What would fit: more ranks (same strategy, ZeRO-3 if allowed), a shorter sequence.
      std::vector<std::string> fixes;
      JobShape more = job;
      Strategy p = smallest->point;
      if (options.limits.max_zero_stage >= 3 && shards && !s.zero_stage) {
        p.zero_stage = 3;
      }
      for (int64_t r = std::max<int64_t>(2, ranks * 2); r <= 4096; r *= 2) {
        more.ranks = r;
        absl::StatusOr<MemoryEstimate> m = EstimateMemory(more, p);
        if (m.ok() && Corrected(*m, CorrectionFor(more, p, options)) <= budget) {
          fixes.push_back(absl::StrCat(r, " ranks (", StrategyText(p), ")"));
          break;
        }
      }
      JobShape shorter = job;
      for (int64_t t = job.seq_len / 2; t >= 16; t /= 2) {
        shorter.seq_len = t;
        absl::StatusOr<MemoryEstimate> m = EstimateMemory(shorter, smallest->point);
        if (m.ok() && Corrected(*m, smallest->correction) <= budget) {
          fixes.push_back(absl::StrCat("data.seq_len ", t));
          break;
        }
      }
      if (TrainsLora(spec) && spec.method != Method::kQLora && spec.method != Method::kMezo) {
        JobShape quantized = job;
        quantized.method = Method::kQLora;
        absl::StatusOr<MemoryEstimate> m = EstimateMemory(quantized, smallest->point);
        if (m.ok()) {
          fixes.push_back(absl::StrCat("method qlora (4-bit NF4 frozen projections: weights ",
                                       FormatBytes(smallest->memory.device.components[0]), " -> ",
                                       FormatBytes(m->device.components[0]), ", peak ",
                                       FormatBytes(Corrected(*m, smallest->correction)), ")"));
        }
      }
      suggestions = fixes.empty()
                        ? std::string(
                              "; neither more ranks nor a shorter sequence would "
                              "make it fit")
                        : absl::StrCat("; it would fit with ", absl::StrJoin(fixes, ", or "));
    }
    if (!options.without_sharding_because.empty()) {
      absl::StrAppend(&suggestions,
                      " (sharding and offload were not tried: ", options.without_sharding_because,
                      ")");
    }
    return absl::ResourceExhaustedError(
        absl::StrCat("nothing fits: the smallest configuration (",
                     smallest ? StrategyText(smallest->point) : "none", ") needs ",
                     smallest ? FormatBytes(smallest->peak) : "?", " per rank (",
                     smallest ? BreakdownText(*smallest) : "", "), more than ", FormatBytes(budget),
                     " (", FormatBytes(options.rates.memory_bytes), " less ",
                     absl::StrFormat("%.0f%%", options.headroom * 100), " headroom)", suggestions));
  }

  const Candidate& best = candidates.front();
  int64_t fitting = 0;
  for (Candidate& c : candidates) {
    if (c.fits) ++fitting;
    if (&c == &best) {
      c.verdict = "chosen";
    } else if (!c.fits) {
      c.verdict =
          absl::StrCat("does not fit: needs ", FormatBytes(c.peak), " of ", FormatBytes(budget));
    } else {
      const double slower = c.step_seconds / best.step_seconds - 1;
      std::string why = "compute";
      if (c.comm_seconds - best.comm_seconds > c.compute_seconds - best.compute_seconds) {
        why = "communication";
      }
      if (c.offload_seconds - best.offload_seconds >
          std::max(c.comm_seconds - best.comm_seconds, c.compute_seconds - best.compute_seconds)) {
        why = "offload";
      }
      c.verdict = absl::StrFormat("%.0f%% slower (%s)", 100 * slower, why);
    }
  }
  PlanResult result;
  Plan& plan = result.plan;
  plan = PlanOf(spec, best.point);
  plan.predicted_memory = best.memory.device;
  plan.memory_correction = best.correction.factor;
  plan.calibration_key = CalibrationKey(job, best.point, options.pool);
  result.tokens_per_second =
      static_cast<double>(spec.train.global_batch * spec.data.seq_len) / best.step_seconds;
  plan.explanation = absl::StrCat(
      "planner: ", StrategyText(best.point), ", the fastest of ", fitting, " of ",
      candidates.size(), " configurations that fit ", FormatBytes(budget), " per rank; peak ",
      FormatBytes(best.peak), " in ", best.memory.peak_phase, CorrectionText(best.correction),
      absl::StrFormat("; predicted step %s, %.0f tokens/s", SecondsText(best.step_seconds),
                      result.tokens_per_second));
  result.candidates = std::move(candidates);
  return result;
}

}  // namespace

absl::StatusOr<PlanResult> PlanJob(const JobSpec& spec, const ModelShape& shape,
                                   const PlanOptions& options) {
  absl::StatusOr<PlanResult> given = PlanAsGiven(spec, shape, options);
  if (given.ok() || given.status().code() != absl::StatusCode::kResourceExhausted ||
      !IsAutomatic(spec.strategy)) {
    return given;
  }
  // Nothing fits as asked: under strategy auto, the memory techniques that change the
  // numerics a little, the lightest first (docs/planner.md, "Memory techniques").
  const bool adamw = spec.train.optimizer == OptimizerKind::kAdamW &&
                     spec.method != Method::kMezo && !spec.train.paged_optimizer;
  const bool lora = spec.method == Method::kLora;
  struct Technique {
    bool applies;
    std::optional<Method> method;
    std::optional<OptimizerKind> optimizer;
    const char* why;
  };
  const Technique techniques[] = {
      {adamw, std::nullopt, OptimizerKind::kAdamW8bit, "8-bit AdamW state"},
      {lora, Method::kQLora, std::nullopt, "QLoRA's 4-bit frozen projections"},
      {adamw && lora, Method::kQLora, OptimizerKind::kAdamW8bit,
       "QLoRA's 4-bit frozen projections and 8-bit AdamW state"},
  };
  for (const Technique& t : techniques) {
    if (!t.applies) continue;
    JobSpec changed = spec;
    if (t.method) changed.method = *t.method;
    if (t.optimizer) changed.train.optimizer = *t.optimizer;
    absl::StatusOr<PlanResult> result = PlanAsGiven(changed, shape, options);
    if (!result.ok()) continue;
    result->plan.method = t.method;
    result->plan.optimizer = t.optimizer;
    result->plan.explanation =
        absl::StrCat("nothing fits with the spec's method ", MethodName(spec.method),
                     " and optimizer ", OptimizerKindName(spec.train.optimizer), "; with ", t.why,
                     " it does (strategy auto chooses them then; an explicit strategy does not): ",
                     result->plan.explanation);
    return result;
  }
  return given;
}

}  // namespace lathe
