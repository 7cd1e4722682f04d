#include "common/flops.h"

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "common/lora_targets.h"

namespace lathe {

double TrainingFlopsPerToken(const ModelConfig& config, const JobSpec& spec, int64_t seq_len,
                             bool recompute) {
  // Weights of one layer's projections, and of the LoRA adapters on them.
  double layer_weights = 0;
  for (const std::string& module : ProjectionModules(config)) {
    const ProjectionShape shape = ProjectionShapeOf(config, module);
    layer_weights += static_cast<double>(shape.in_features) * shape.out_features;
  }
  const double layers = static_cast<double>(config.num_hidden_layers);
  // Weights of the adapters, averaged over the layers (the targets may differ between them;
  // targets that select nothing count none: the job is refused elsewhere).
  double layer_adapters = 0;
  if (TrainsLora(spec)) {
    absl::StatusOr<std::vector<LoraTarget>> targets = MatchLoraTargets(spec.lora, config);
    for (const LoraTarget& target : targets.ok() ? *targets : std::vector<LoraTarget>{}) {
      const ProjectionShape shape = ProjectionShapeOf(config, target.module);
      layer_adapters += static_cast<double>(target.rank) * (shape.in_features + shape.out_features);
    }
    if (layers > 0) layer_adapters /= layers;
  }
  const double head = static_cast<double>(config.vocab_size) * config.hidden_size;
  const double attention = 2.0 * (static_cast<double>(seq_len) + 1) *
                           static_cast<double>(config.num_attention_heads) * config.head_dim;
  // Forward FLOPs of the decoder blocks, of the head.
  const double blocks_forward = layers * (2 * layer_weights + 2 * layer_adapters + attention);
  const double head_forward = 2 * head;
  double total;
  if (spec.method == Method::kMezo) {
    total = 2 * (blocks_forward + head_forward);  // two forward passes, no backward
  } else if (spec.method == Method::kFull) {
    total = 3 * (blocks_forward + head_forward);
  } else {
    // Frozen weights: forward + input gradients. Adapters and attention: forward + input
    // gradients + weight gradients (attention has no weights, but its backward is 2x too).
    const double frozen = layers * 2 * layer_weights + head_forward;
    const double trained = layers * (2 * layer_adapters + attention);
    total = 2 * frozen + 3 * trained;
    // A trained copy of the LM head (lora.modules_to_save) adds its weight gradient; the
    // embeddings' copy only gathers rows.
    const absl::StatusOr<SavedModules> saved = ResolveModulesToSave(spec.lora.modules_to_save);
    if (saved.ok() && saved->lm_head) total += head_forward;
  }
  if (recompute) total += blocks_forward;
  return total;
}

std::optional<double> CudaPeakFlops(absl::string_view name, Precision precision) {
  struct Entry {
    const char* name_part;  // matched in order: more specific names first
    double half;            // bf16 / fp16 dense tensor cores
    double fp32;            // without TF32
  };
  static constexpr Entry kTable[] = {
      {"H200", 989.4e12, 66.9e12},     {"H100 PCIe", 756.0e12, 51.2e12},
      {"H100 NVL", 835.0e12, 60.0e12}, {"H100", 989.4e12, 66.9e12},
      {"A100", 312.0e12, 19.5e12},     {"L40S", 362.1e12, 91.6e12},
      {"L40", 181.0e12, 90.5e12},      {"L4", 121.0e12, 30.3e12},
  };

  for (const Entry& e : kTable) {
    if (absl::StrContains(name, e.name_part)) {
      return precision == Precision::kFp32 ? e.fp32 : e.half;
    }
  }
  return std::nullopt;
}

double Mfu(double flops_per_token, double tokens_per_second, double peak_flops_per_rank,
           int64_t ranks) {
  if (peak_flops_per_rank <= 0 || ranks <= 0) return 0.0;
  return flops_per_token * tokens_per_second / (peak_flops_per_rank * static_cast<double>(ranks));
}

}  // namespace lathe
