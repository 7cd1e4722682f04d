#include "worker/tools/synthetic.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/float16.h"
#include "common/status_macros.h"

namespace lathe {
namespace {

// Float values converted to the bytes of `dtype` (F32, BF16 or F16).
std::vector<std::byte> Encode(const std::vector<float>& values, DType dtype) {
  std::vector<std::byte> bytes(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
    } else {
      uint16_t half = dtype == DType::kBF16 ? FloatToBFloat16(values[i]) : FloatToHalf(values[i]);
      std::memcpy(bytes.data() + 2 * i, &half, 2);
    }
  }
  return bytes;
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

absl::Status WriteSyntheticModel(const ModelConfig& config, DType dtype, int64_t shards,
                                 uint64_t seed, const std::string& dir) {
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return absl::InvalidArgumentError("dtype: expected F32, BF16 or F16");
  }
  std::string config_json = ModelConfigToJson(config);
  LATHE_RETURN_IF_ERROR(ParseModelConfig(config_json, "generated config.json").status());
  std::vector<WeightSpec> weights = ExpectedWeights(config);
  if (shards < 1 || shards > static_cast<int64_t>(weights.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("shards: expected 1..", weights.size(), ", got ", shards));
  }
  std::mt19937_64 rng(seed);
  std::vector<std::vector<std::byte>> buffers;
  std::vector<TensorToWrite> tensors;
  buffers.reserve(weights.size());
  for (const WeightSpec& w : weights) {
    std::vector<float> values(static_cast<size_t>(Numel(w.shape)));
    // Matrices scaled by 1/sqrt(fan_in) keep activations and logits of order one, so even a
    // tiny model has something to learn; norms start near one, biases near zero.
    bool is_norm = absl::EndsWith(w.name, "norm.weight");
    float scale = w.shape.size() == 2 ? 1.0f / std::sqrt(static_cast<float>(w.shape[1])) : 0.02f;
    std::normal_distribution<float> normal(is_norm ? 1.0f : 0.0f, is_norm ? 0.1f : scale);
    for (float& v : values) v = normal(rng);
    buffers.push_back(Encode(values, dtype));
    tensors.push_back({w.name, dtype, w.shape, buffers.back().data(), buffers.back().size()});
  }

  std::filesystem::create_directories(dir);
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  if (shards == 1) {
    LATHE_RETURN_IF_ERROR(WriteSafetensors(dir + "/model.safetensors", tensors, metadata));
  } else {
    std::string weight_map;
    size_t per_shard = (tensors.size() + shards - 1) / shards;
    for (int64_t s = 0; s < shards; ++s) {
      std::string file = absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, shards);
      size_t begin = s * per_shard;
      size_t end = std::min(tensors.size(), begin + per_shard);
      if (begin >= end) continue;
      absl::Span<const TensorToWrite> part(tensors.data() + begin, end - begin);
      LATHE_RETURN_IF_ERROR(WriteSafetensors(dir + "/" + file, part, metadata));
      for (const TensorToWrite& t : part) {
        absl::StrAppend(&weight_map, weight_map.empty() ? "" : ",\n    ", "\"", t.name, "\": \"",
                        file, "\"");
      }
    }
    LATHE_RETURN_IF_ERROR(
        WriteFileAtomically(dir + "/model.safetensors.index.json",
                            absl::StrCat("{\n  \"metadata\": {},\n  \"weight_map\": {\n    ",
                                         weight_map, "\n  }\n}\n")));
  }
  LATHE_RETURN_IF_ERROR(WriteFileAtomically(dir + "/config.json", config_json));
  return absl::OkStatus();
}

std::string SyntheticDataJsonl(const SyntheticDataOptions& options) {
  std::mt19937_64 rng(options.seed);
  std::vector<std::array<int64_t, 4>> successors(options.vocab);
  std::uniform_int_distribution<int64_t> token(0, options.vocab - 1);
  for (auto& s : successors) {
    for (int64_t& t : s) t = token(rng);
  }
  std::uniform_int_distribution<int64_t> length(options.min_len, options.max_len);
  std::uniform_int_distribution<int> pick(0, 9);
  std::string text;
  for (int64_t r = 0; r < options.records; ++r) {
    int64_t len = length(rng);
    std::vector<int64_t> ids(len);
    ids[0] = token(rng);
    for (int64_t i = 1; i < len; ++i) {
      int p = pick(rng);
      ids[i] = p < 8 ? successors[ids[i - 1]][p % 4] : token(rng);
    }
    absl::StrAppend(&text, "{\"input_ids\": [", absl::StrJoin(ids, ", "), "]");
    if (options.prompt_labels) {
      int64_t prompt = len / 3;
      std::vector<int64_t> labels(ids);
      for (int64_t i = 0; i < prompt; ++i) labels[i] = -100;
      absl::StrAppend(&text, ", \"labels\": [", absl::StrJoin(labels, ", "), "]");
    }
    absl::StrAppend(&text, "}\n");
  }
  return text;
}

}  // namespace lathe
