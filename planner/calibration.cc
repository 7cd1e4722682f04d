#include "planner/calibration.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace lathe {

std::string CalibrationKey(const JobShape& job, const Strategy& point, absl::string_view pool) {
  const ModelConfig& m = job.model.config;
  std::string key = absl::StrCat(
      m.model_type, " h", m.hidden_size, " L", m.num_hidden_layers, " i", m.intermediate_size, " a",
      m.num_attention_heads, "/", m.num_key_value_heads, " d", m.head_dim, " v", m.vocab_size,
      m.tie_word_embeddings ? " tied" : "", " | ", MethodName(job.method));
  if (job.method == Method::kLora) {
    std::vector<absl::string_view> targets;
    for (const std::string& t : job.lora_targets) {
      targets.push_back(absl::StripSuffix(t, "_proj"));
    }
    absl::StrAppend(&key, " r", job.lora_rank, " ", absl::StrJoin(targets, ","));
  }
  absl::StrAppend(&key, " | ", PrecisionName(job.precision), " | ZeRO-", point.zero_stage,
                  point.offload_optimizer ? " offload-optimizer" : "",
                  point.offload_params ? " offload-params" : "",
                  point.activation_checkpointing ? " ckpt" : "",
                  point.chunked_loss ? "" : " unfused-loss",
                  point.fused_kernels ? " fused" : " unfused", " | ", job.ranks, " x ", pool);
  return key;
}

void MemoryCalibration::Record(absl::string_view key, uint64_t predicted, uint64_t measured) {
  if (key.empty() || predicted == 0 || measured == 0) return;
  const double ratio = static_cast<double>(measured) / static_cast<double>(predicted);
  if (ratio < 0.25 || ratio > 4) return;
  auto it = ratios_.find(key);
  if (it == ratios_.end()) it = ratios_.emplace(std::string(key), std::deque<double>()).first;
  it->second.push_back(ratio);
  if (it->second.size() > kWindow) it->second.pop_front();
}

MemoryCorrection MemoryCalibration::Lookup(absl::string_view key) const {
  auto it = ratios_.find(key);
  if (it == ratios_.end()) return {};
  double sum = 0;
  for (double r : it->second) sum += r;
  const int64_t n = static_cast<int64_t>(it->second.size());
  return {sum / static_cast<double>(n), n};
}

std::map<std::string, MemoryCorrection> MemoryCalibration::All() const {
  std::map<std::string, MemoryCorrection> all;
  for (const auto& [key, ratios] : ratios_) all[key] = Lookup(key);
  return all;
}

}  // namespace lathe
