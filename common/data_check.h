// The check of a training or eval data file that admission runs at submit
// (coordinator/scheduler/job_manager.h): the first lines of the file are parsed as the
// trainer parses them (docs/training.md, "Data"; worker/engine/token_dataset.cc) and their
// token ids are checked against the model's vocabulary, so that a broken line or an id
// outside the vocabulary near the top of a file is refused before the job waits in the
// queue. The check is bounded: it reads at most DataCheckLimits::max_bytes of the file and
// parses at most DataCheckLimits::max_lines lines; what lies beyond is checked by the
// trainer only, when the job starts.
//
// Text, chat and instruction records are checked for their shape only (the keys, their
// types, a non-empty text, the messages' roles and an assistant turn), and that the model
// has a tokenizer.json: tokenising needs the engine's tokenizer, which the coordinator does
// not link, so the tokenizer file itself and the ids it would produce are not checked here.
//
// Thread-safety: stateless; safe from any thread.
#ifndef LATHE_COMMON_DATA_CHECK_H_
#define LATHE_COMMON_DATA_CHECK_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace lathe {

struct DataCheckLimits {
  // Lines parsed (blank lines count), at most.
  int64_t max_lines = 1000;
  // Bytes read from the start of the file, at most. A line that the bound cuts, and any
  // line after it, is not checked; a first line longer than the bound leaves nothing
  // checked.
  int64_t max_bytes = int64_t{4} << 20;
};

// Checks the first lines of the JSON Lines file `path` (see above). `field` ("data.train")
// and `path` begin every message, then the line number, in the trainer's words:
//   "data.train: /d/train.jsonl: line 17: input_ids[3]: token id 70000 is outside the
//   vocabulary (vocab_size 32000)".
// INVALID_ARGUMENT for a line that is not valid JSON or UTF-8, not an object, with none or
// two of the record keys, ids that are not integers in [0, vocab_size), labels of another
// length or other than -100 and valid ids, labels on a text-type record, a malformed text,
// chat or instruction record, a text-type record when `model_dir`/tokenizer.json does not
// exist, or a file read whole that holds no record; NOT_FOUND for a missing file; INTERNAL
// for a read error.
absl::Status CheckDataFile(const std::string& path, absl::string_view field, int64_t vocab_size,
                           const std::string& model_dir, const DataCheckLimits& limits = {});

}  // namespace lathe

#endif  // LATHE_COMMON_DATA_CHECK_H_
