// Synthetic models and data sets for demos, tests and benchmarks, written with the
// project's own writers (no libtorch): a random Llama-family model directory, token
// records drawn from a learnable Markov chain, and small byte-level BPE tokenizers in the
// style of GPT-2, Llama 3 and Qwen2.
//
// Thread-safety: free functions.
#ifndef LATHE_WORKER_TOOLS_SYNTHETIC_H_
#define LATHE_WORKER_TOOLS_SYNTHETIC_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
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

// Which real tokenizer a synthetic one imitates: its normalizer, pre-tokenizer regex,
// special tokens and post-processor.
//   gpt2    ByteLevel with GPT-2's regex; <|endoftext|>
//   llama3  Llama 3's Split regex + ByteLevel; <|begin_of_text|>, <|end_of_text|>,
//           <|start_header_id|>, <|end_header_id|>, <|eot_id|>; a template adding
//           <|begin_of_text|>
//   qwen2   NFC, Qwen2's Split regex + ByteLevel; <|endoftext|>, <|im_start|>, <|im_end|>
enum class TokenizerFlavor { kGpt2, kLlama3, kQwen2 };
// "gpt2", "llama3", "qwen2"; INVALID_ARGUMENT for anything else.
absl::StatusOr<TokenizerFlavor> ParseTokenizerFlavor(absl::string_view name);

struct SyntheticTokenizerOptions {
  TokenizerFlavor flavor = TokenizerFlavor::kLlama3;
  // Ids in all: the 256 byte tokens, the merged tokens and the special tokens.
  int64_t vocab_size = 576;
};

struct SyntheticTokenizer {
  std::string json;  // the tokenizer.json text
  int64_t size = 0;  // ids in all (less than vocab_size when the corpus ran out of pairs)
  // What the flavor's config.json names (Hugging Face's base models of that family).
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;
};

// A tokenizer whose BPE merges are learned from a fixed, built-in multilingual corpus:
// the most frequent adjacent pair within pre-tokens first, ties to the pair whose tokens'
// bytes compare first, so the output is the same byte for byte on every run (merges in
// "a b" form, no ignore_merges, so that older `tokenizers` releases read it too).
// INVALID_ARGUMENT when vocab_size leaves no room for the bytes and special tokens.
absl::StatusOr<SyntheticTokenizer> MakeSyntheticTokenizer(const SyntheticTokenizerOptions& options);

}  // namespace lathe

#endif  // LATHE_WORKER_TOOLS_SYNTHETIC_H_
