// A Hugging Face tokenizer (tokenizer.json of the `tokenizers` library) for BPE: byte-level,
// as Llama 3, Qwen2 and GPT-2 use it, or SentencePiece-style with byte fallback, as Llama 2,
// Mistral v0.1 and Gemma use it. Encode gives the ids Hugging Face gives; what the file asks
// for that is not implemented is refused when it is loaded, never approximated.
//
// Implemented, as `tokenizers` does it:
//   normalizer      null, NFC, Prepend, Replace (a {"String": ...} pattern), or a Sequence
//                   of those
//   pre_tokenizer   byte-level: ByteLevel (use_regex: GPT-2's regex; add_prefix_space),
//                   Split with the GPT-2, Llama 3 or Qwen2 regex (behavior Isolated, invert
//                   false), or a Sequence of those ending in ByteLevel.
//                   SentencePiece-style: null, or Metaspace (replacement, prepend_scheme
//                   always/first/never, split; the older add_prefix_space).
//   model           BPE with vocab, merges ("a b" strings or ["a", "b"] pairs),
//                   ignore_merges; no dropout or subword prefixes. Byte-level: all 256 byte
//                   characters, no byte_fallback. SentencePiece-style: characters looked up
//                   as they are; one outside the vocabulary becomes the "<0xXX>" tokens of
//                   its UTF-8 bytes with byte_fallback, else unk_token (consecutive ones one
//                   unk with fuse_unk), else nothing.
//   added_tokens    matched in the raw text (normalized: false) or in the normalized text
//                   (normalized: true), longest match first, with lstrip, rstrip and
//                   single_word; their ids are those in the file
//   post_processor  null, ByteLevel (no effect on ids), TemplateProcessing (single
//                   sequence), or a Sequence of those
//   decoder         byte-level: not read (Decode inverts the byte alphabet).
//                   SentencePiece-style: null, Replace, ByteFallback, Fuse, Strip, Metaspace,
//                   or a Sequence of those.
// truncation and padding must be null (Lathe cuts sequences itself).
//
// Thread-safety: immutable after Load; Encode may be called from several threads (its word
// cache takes a lock). Copies share the loaded data.
#ifndef LATHE_WORKER_ENGINE_TOKENIZER_H_
#define LATHE_WORKER_ENGINE_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace lathe {

namespace tokenizer_internal {
struct TokenizerData;
}  // namespace tokenizer_internal

class Tokenizer {
 public:
  // Reads and parses `path`. NOT_FOUND when the file does not exist; otherwise as Parse.
  static absl::StatusOr<Tokenizer> Load(const std::string& path);

  // Parses tokenizer.json text; `source` names the file in messages. INVALID_ARGUMENT of one
  // line, "<source>: <json.field.path>: <problem>", for malformed JSON and for anything not
  // implemented (see above), e.g.
  //   /m/tokenizer.json: model.type: "Unigram" is not supported (BPE only)
  static absl::StatusOr<Tokenizer> Parse(absl::string_view json_text, absl::string_view source);

  // The ids of `text`. With `add_special_tokens` the post-processor's tokens for a single
  // sequence are added (Llama 3: <|begin_of_text|> first). Added tokens written in the text
  // (e.g. "<|im_end|>") become their ids either way, as in Hugging Face. INVALID_ARGUMENT
  // "invalid UTF-8 at byte N" when `text` is not valid UTF-8, and when the file's normalizer
  // makes a piece of it more than 16 times longer (a hostile file's Replace steps).
  absl::StatusOr<std::vector<int64_t>> Encode(absl::string_view text,
                                              bool add_special_tokens) const;

  // The bytes the ids stand for, added and special tokens included (for debugging; the
  // result may be invalid UTF-8 when the ids split a character). SentencePiece-style files
  // go through their decoder as in `tokenizers` (no decoder: tokens joined by spaces), except
  // that byte tokens that are not valid UTF-8 stay bytes rather than U+FFFD.
  // INVALID_ARGUMENT for an id the tokenizer does not have.
  absl::StatusOr<std::string> Decode(absl::Span<const int64_t> ids) const;

  // The id of an added token ("<|im_end|>") or of a vocabulary entry as written in the file
  // (byte-level form: "Ġthe"; SentencePiece: "▁the"); nullopt when there is none.
  std::optional<int64_t> TokenId(absl::string_view token) const;

  // One past the largest id, added tokens included: a model's vocab_size must be at least
  // this.
  int64_t size() const;

  // The ids the post-processor puts before and after a single sequence when special tokens
  // are added (Llama 3: {<|begin_of_text|>} and {}).
  const std::vector<int64_t>& template_prefix() const;
  const std::vector<int64_t>& template_suffix() const;

 private:
  explicit Tokenizer(std::shared_ptr<const tokenizer_internal::TokenizerData> data)
      : data_(std::move(data)) {}

  std::shared_ptr<const tokenizer_internal::TokenizerData> data_;
};

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_TOKENIZER_H_
