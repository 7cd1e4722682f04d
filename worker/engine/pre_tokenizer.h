// The pieces of byte-level BPE that come before the merges: UTF-8 checking, the
// pre-tokenisation regexes of GPT-2, Llama 3 and Qwen2 (hand-written scanners, since no
// regex engine at hand matches Oniguruma's, which Hugging Face `tokenizers` uses), and
// GPT-2's byte-to-character alphabet.
//
// Unicode classes come from ICU: \p{L} and \p{N} are the general categories L* and N*, \s
// is the White_Space property (what Oniguruma's \s means for Unicode text).
//
// Thread-safety: pure functions.
#ifndef LATHE_WORKER_ENGINE_PRE_TOKENIZER_H_
#define LATHE_WORKER_ENGINE_PRE_TOKENIZER_H_

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace lathe {

// A pre-tokenisation regex that Lathe implements.
enum class SplitRegex {
  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  // (GPT-2; also what a ByteLevel pre-tokenizer with use_regex applies)
  kGpt2,
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
  //  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+   (Llama 3, one line)
  kLlama3,
  // As kLlama3 with \p{N} (one digit) in place of \p{N}{1,3} (Qwen2, Qwen2.5, Qwen3).
  kQwen2,
};

// The regex exactly as tokenizer.json spells it (after JSON unescaping).
absl::string_view SplitRegexPattern(SplitRegex regex);
// "GPT-2", "Llama 3", "Qwen2".
absl::string_view SplitRegexName(SplitRegex regex);
// The SplitRegex whose pattern is exactly `pattern`; nullopt for any other.
std::optional<SplitRegex> RecognizeSplitRegex(absl::string_view pattern);

// Appends to `pieces` the consecutive matches of `regex` in `text` (they cover it, so no
// text falls between them), as views into `text`.
// REQUIRES: `text` is valid UTF-8.
void SplitPreTokens(SplitRegex regex, absl::string_view text,
                    std::vector<absl::string_view>* pieces);

// The byte offset of the first ill-formed UTF-8 sequence in `text` (overlong forms,
// surrogates and code points past U+10FFFF are ill-formed), or nullopt when it is valid.
std::optional<size_t> FindInvalidUtf8(absl::string_view text);

// GPT-2's bytes_to_unicode: byte b is shown as one printable character, b itself for
// '!'..'~', 0xA1..0xAC and 0xAE..0xFF, and U+0100 + k for the k-th other byte in byte order
// (so ' ' is 'Ġ' and '\n' is 'Ċ'). Entry b is that character in UTF-8.
const std::array<std::string, 256>& ByteLevelAlphabet();
// `bytes` with every byte replaced by its ByteLevelAlphabet character.
std::string ByteLevelEncode(absl::string_view bytes);

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_PRE_TOKENIZER_H_
