// Synthetic models and data sets for demos, tests and benchmarks, written with the
// project's own writers (no libtorch): a random Llama-family model directory, and token
// records drawn from a learnable Markov chain.
//
// Thread-safety: free functions.
#ifndef LATHE_WORKER_TOOLS_SYNTHETIC_H_
#define LATHE_WORKER_TOOLS_SYNTHETIC_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "common/model_config.h"
#include "common/safetensors.h"

namespace lathe {

// Writes `dir`/config.json and random weights (matrices normal(0, 1/sqrt(fan_in)), norm
// weights near 1, biases near 0) in
// `dtype` (F32, BF16 or F16), as one model.safetensors or `shards` shards plus
// model.safetensors.index.json. INVALID_ARGUMENT for an invalid config or shard count.
absl::Status WriteSyntheticModel(const ModelConfig& config, DType dtype, int64_t shards,
                                 uint64_t seed, const std::string& dir);

struct SyntheticDataOptions {
  int64_t vocab = 256;
  int64_t records = 256;
  int64_t min_len = 8;
  int64_t max_len = 64;
  bool prompt_labels = false;  // mask the first third of each record with -100 labels
  uint64_t seed = 0;
};

// JSONL text of `options.records` records. Each token has four likely successors (80%),
// so a model can learn the data and its loss visibly falls.
std::string SyntheticDataJsonl(const SyntheticDataOptions& options);

}  // namespace lathe

#endif  // LATHE_WORKER_TOOLS_SYNTHETIC_H_
