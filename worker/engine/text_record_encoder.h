// Turns text, chat and instruction records into token ids and labels with the model's
// tokenizer (docs/training.md, "Data", has the exact rules):
//
//   text         the tokenizer's encoding with its special tokens (Llama 3: BOS first), then
//                config.json's eos_token_id (unless already last); every token a target
//   chat         the conversation in the chat format the tokenizer's special tokens identify,
//                ChatML (<|im_start|>, <|im_end|>: Qwen2) or Llama 3 (<|start_header_id|>,
//                <|end_header_id|>, <|eot_id|>, <|begin_of_text|>); targets: the content of
//                every assistant turn and the token that ends it
//   instruction  a user turn (instruction, plus "\n\n" and the input when there is one) and
//                an assistant turn (output), as a chat; with no chat format, the Alpaca
//                prompt, with the output, the post-processor's closing tokens and the eos
//                token as targets
//
// The tokenizer is read from the model directory when the first record needs it, so that
// data of token ids never depends on tokenizer.json.
//
// Thread-safety: not thread-safe (the tokenizer is loaded on first use).
#ifndef LATHE_WORKER_ENGINE_TEXT_RECORD_ENCODER_H_
#define LATHE_WORKER_ENGINE_TEXT_RECORD_ENCODER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/model_config.h"
#include "worker/engine/token_dataset.h"
#include "worker/engine/tokenizer.h"

namespace lathe {

struct ChatMessage {
  enum class Role { kSystem, kUser, kAssistant };
  Role role;
  std::string content;
};

// The chat format of a tokenizer, from its special tokens.
enum class ChatFormat { kNone, kChatMl, kLlama3 };

// ChatML when the tokenizer has <|im_start|> and <|im_end|>; otherwise Llama 3 when it has
// <|begin_of_text|>, <|start_header_id|>, <|end_header_id|> and <|eot_id|>; otherwise none.
ChatFormat ChatFormatOf(const Tokenizer& tokenizer);

class TextRecordEncoder {
 public:
  // For the model in `model_dir` with config `config`: `model_dir`/tokenizer.json is read
  // when a record first needs it; the eos token is config.eos_token_ids' first entry.
  TextRecordEncoder(const std::string& model_dir, const ModelConfig& config);
  // With a tokenizer already loaded (tests and tools); `eos_token_id` as above.
  TextRecordEncoder(Tokenizer tokenizer, std::optional<int64_t> eos_token_id);

  // Each returns the document of one record. INVALID_ARGUMENT of one line, without the file
  // and line (the caller adds them), when: the tokenizer is missing ("text records need
  // /m/tokenizer.json, which does not exist"), cannot be loaded or has more ids than the
  // model's vocab_size; the text is not valid UTF-8; a chat or instruction record meets a
  // tokenizer without a chat format (chats) or a model without an eos token (instructions
  // in the Alpaca prompt); a chat has no assistant turn.
  absl::StatusOr<Document> EncodeText(absl::string_view text);
  absl::StatusOr<Document> EncodeChat(const std::vector<ChatMessage>& messages);
  absl::StatusOr<Document> EncodeInstruction(absl::string_view instruction, absl::string_view input,
                                             absl::string_view output);

 private:
  // The tokenizer, loading it on first use; `kind` ("text", "chat", "instruction") names
  // the records that need it in the message when it is missing.
  absl::StatusOr<const Tokenizer*> GetTokenizer(absl::string_view kind);

  std::string tokenizer_name_;  // <model_dir>/tokenizer.json, or "the tokenizer"
  int64_t vocab_size_ = 0;      // 0: not checked
  std::optional<int64_t> eos_token_id_;
  std::optional<Tokenizer> tokenizer_;
  absl::Status load_status_;  // the first failure to load, repeated to every later record
};

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_TEXT_RECORD_ENCODER_H_
