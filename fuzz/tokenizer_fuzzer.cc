// Fuzzes Tokenizer::Parse (worker/engine/tokenizer.h) with tokenizer.json text and, when it
// is accepted, Encode and Decode with the input's first bytes as the text. Any bytes must
// give a tokenizer or an INVALID_ARGUMENT of one line (valid UTF-8, no C0 control characters),
// and a tokenizer must encode to ids that it has and that decode.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "fuzz/fuzz_check.h"
#include "worker/engine/pre_tokenizer.h"
#include "worker/engine/tokenizer.h"

namespace {

// How much of the input is encoded: enough for words, added tokens and their surroundings.
constexpr size_t kMaxTextBytes = 1024;

bool IsOneLine(absl::string_view message) {
  for (char c : message) {
    if (static_cast<unsigned char>(c) < 0x20) return false;
  }
  return !lathe::FindInvalidUtf8(message).has_value();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view json(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<lathe::Tokenizer> tokenizer =
      lathe::Tokenizer::Parse(json, "/m/tokenizer.json");
  if (!tokenizer.ok()) {
    if (!absl::IsInvalidArgument(tokenizer.status())) {
      lathe::FuzzFail("tokenizer_fuzzer", "not INVALID_ARGUMENT", tokenizer.status().ToString());
    }
    if (!IsOneLine(tokenizer.status().message())) {
      lathe::FuzzFail("tokenizer_fuzzer", "message is not one printable line",
                      tokenizer.status().ToString());
    }
    return 0;
  }
  const absl::string_view text = json.substr(0, std::min(size, kMaxTextBytes));
  for (bool add_special_tokens : {false, true}) {
    const absl::StatusOr<std::vector<int64_t>> ids = tokenizer->Encode(text, add_special_tokens);
    if (!ids.ok()) {
      if (!absl::IsInvalidArgument(ids.status()))
        lathe::FuzzFail("tokenizer_fuzzer", "Encode", ids.status().ToString());
      continue;
    }
    for (int64_t id : *ids) {
      if (id < 0 || id >= tokenizer->size())
        lathe::FuzzFail("tokenizer_fuzzer", "Encode gave an id out of range", text);
    }
    const absl::StatusOr<std::string> decoded = tokenizer->Decode(*ids);
    if (!decoded.ok())
      lathe::FuzzFail("tokenizer_fuzzer", "Decode refused Encode's ids",
                      decoded.status().ToString());
  }
  return 0;
}
