// Token data sets and the order in which training sees them (docs/training.md, "Data").
// No libtorch: batches are plain id vectors that the trainer turns into tensors.
//
// Thread-safety: TokenDataset is immutable after Load. SequenceSampler is not thread-safe.
#ifndef LATHE_WORKER_ENGINE_TOKEN_DATASET_H_
#define LATHE_WORKER_ENGINE_TOKEN_DATASET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lathe {

inline constexpr int64_t kIgnoreLabel = -100;

class TextRecordEncoder;

// One document: token ids and, aligned with them, labels (-100 where not a target).
struct Document {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> labels;
};

class TokenDataset {
 public:
  // Reads a JSONL file of {"input_ids": [...], "labels": [...]?} records. `field` names the
  // spec field in messages ("data.train"). INVALID_ARGUMENT "<field>: <path>: line N: ..."
  // for a malformed line, a missing or empty input_ids, an id outside [0, vocab_size),
  // labels of another length or with invalid values, and for a file without records;
  // NOT_FOUND when the file does not exist.
  static absl::StatusOr<TokenDataset> Load(const std::string& path, absl::string_view field,
                                           int64_t vocab_size);

  // As above, and also reads records of text ({"text": "..."}), chats ({"messages":
  // [{"role", "content"}, ...]}) and instructions ({"instruction", "input"?, "output"}),
  // which `encoder` tokenises (see TextRecordEncoder); kinds may be mixed in one file. Each
  // record has exactly one of "input_ids", "text", "messages", "instruction"; other keys are
  // ignored. INVALID_ARGUMENT "<field>: <path>: line N: ..." also for a record of two
  // kinds, a text that is not a non-empty string, a malformed message (not an object, a
  // missing or unknown role, missing or non-string content, another key), an empty list of
  // messages, and whatever `encoder` refuses (no tokenizer.json, no assistant turn, ...).
  // With a null `encoder` those records are refused as the first overload does.
  static absl::StatusOr<TokenDataset> Load(const std::string& path, absl::string_view field,
                                           int64_t vocab_size, TextRecordEncoder* encoder);

  const std::vector<Document>& documents() const { return documents_; }
  int64_t total_tokens() const { return total_tokens_; }

 private:
  std::vector<Document> documents_;
  int64_t total_tokens_ = 0;
};

// The documents' order in epoch `epoch`: a Fisher-Yates shuffle driven by SplitMix64 seeded
// from `seed` and `epoch` (exact algorithm in docs/training.md).
std::vector<int64_t> EpochPermutation(int64_t n, uint64_t seed, int64_t epoch);

// One training sequence. In packed mode every sequence has exactly seq_len tokens.
struct Sequence {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> labels;
};

// Draws training sequences in order, epoch after epoch, packed or not.
class SequenceSampler {
 public:
  // REQUIRES: `dataset` outlives the sampler and has at least one document; seq_len >= 2.
  SequenceSampler(const TokenDataset* dataset, int64_t seq_len, bool pack, uint64_t seed);

  Sequence Next();

  // Where the sampler stands: enough to continue the exact same sequence order later.
  struct Cursor {
    int64_t epoch = 0;
    int64_t next_document = 0;  // index into the epoch's permutation
    int64_t offset_in_document = 0;
  };
  Cursor cursor() const;
  // Continues from `cursor`. INVALID_ARGUMENT when it does not fit this data set.
  absl::Status Restore(const Cursor& cursor);

  // Sequences in one epoch (floor(total tokens / seq_len) packed, documents unpacked), at
  // least 1.
  int64_t SequencesPerEpoch() const;

 private:
  void StartEpoch();

  const TokenDataset* dataset_;
  int64_t seq_len_;
  bool pack_;
  uint64_t seed_;
  int64_t epoch_ = -1;
  std::vector<int64_t> order_;
  size_t next_document_ = 0;
  // Packed mode: the document being consumed and the offset into it.
  size_t offset_in_document_ = 0;
};

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_TOKEN_DATASET_H_
