#include "worker/engine/text_record_encoder.h"

#include <unicode/uchar.h>
#include <unicode/utf8.h>

#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace lathe {
namespace {

// Stanford Alpaca's prompts, for instruction records when the tokenizer has no chat format.
constexpr char kAlpacaPrompt[] =
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n";
constexpr char kAlpacaPromptWithInput[] =
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n### Instruction:\n";

absl::string_view RoleName(ChatMessage::Role role) {
  switch (role) {
    case ChatMessage::Role::kSystem:
      return "system";
    case ChatMessage::Role::kUser:
      return "user";
    case ChatMessage::Role::kAssistant:
      return "assistant";
  }
  return "";
}

// Whitespace as Python's str.isspace (and so Jinja's `trim`, which Llama 3's chat template
// applies to every message): White_Space plus the separators U+001C..U+001F.
bool IsPythonSpace(UChar32 c) { return (c >= 0x1C && c <= 0x1F) || u_isUWhiteSpace(c); }

absl::string_view StripPythonSpace(absl::string_view text) {
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  int32_t begin = 0;
  int32_t end = static_cast<int32_t>(text.size());
  while (begin < end) {
    int32_t next = begin;
    UChar32 c;
    U8_NEXT(s, next, end, c);
    if (c < 0 || !IsPythonSpace(c)) break;
    begin = next;
  }
  while (end > begin) {
    int32_t previous = end;
    UChar32 c;
    U8_PREV(s, begin, previous, c);
    if (c < 0 || !IsPythonSpace(c)) break;
    end = previous;
  }
  return text.substr(begin, end - begin);
}

// A document assembled from special tokens and pieces of text, each a target or not.
class DocumentBuilder {
 public:
  explicit DocumentBuilder(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}

  void Token(int64_t id, bool target) {
    doc_.input_ids.push_back(id);
    doc_.labels.push_back(target ? id : kIgnoreLabel);
  }
  void Tokens(const std::vector<int64_t>& ids, bool target) {
    for (int64_t id : ids) Token(id, target);
  }
  // The text's ids without the post-processor's tokens.
  absl::Status Text(absl::string_view text, bool target) {
    LATHE_ASSIGN_OR_RETURN(std::vector<int64_t> ids, tokenizer_.Encode(text, false));
    Tokens(ids, target);
    return absl::OkStatus();
  }
  int64_t last() const { return doc_.input_ids.empty() ? -1 : doc_.input_ids.back(); }
  Document Finish() { return std::move(doc_); }

 private:
  const Tokenizer& tokenizer_;
  Document doc_;
};

}  // namespace

ChatFormat ChatFormatOf(const Tokenizer& tokenizer) {
  auto has = [&](absl::string_view token) { return tokenizer.TokenId(token).has_value(); };
  if (has("<|im_start|>") && has("<|im_end|>")) return ChatFormat::kChatMl;
  if (has("<|begin_of_text|>") && has("<|start_header_id|>") && has("<|end_header_id|>") &&
      has("<|eot_id|>")) {
    return ChatFormat::kLlama3;
  }
  return ChatFormat::kNone;
}

TextRecordEncoder::TextRecordEncoder(const std::string& model_dir, const ModelConfig& config)
    : tokenizer_name_((std::filesystem::path(model_dir) / "tokenizer.json").string()),
      vocab_size_(config.vocab_size) {
  if (!config.eos_token_ids.empty()) eos_token_id_ = config.eos_token_ids.front();
}

TextRecordEncoder::TextRecordEncoder(Tokenizer tokenizer, std::optional<int64_t> eos_token_id)
    : tokenizer_name_("the tokenizer"),
      eos_token_id_(eos_token_id),
      tokenizer_(std::move(tokenizer)) {}

absl::StatusOr<const Tokenizer*> TextRecordEncoder::GetTokenizer(absl::string_view kind) {
  if (tokenizer_.has_value()) return &*tokenizer_;
  if (!load_status_.ok()) return load_status_;
  const std::string& path = tokenizer_name_;
  absl::StatusOr<Tokenizer> tokenizer = Tokenizer::Load(path);
  if (absl::IsNotFound(tokenizer.status())) {
    return absl::InvalidArgumentError(
        absl::StrCat(kind, " records need ", path, ", which does not exist"));
  }
  if (!tokenizer.ok()) {
    load_status_ = tokenizer.status();
  } else if (vocab_size_ > 0 && tokenizer->size() > vocab_size_) {
    load_status_ = absl::InvalidArgumentError(absl::StrCat(path, " has ", tokenizer->size(),
                                                           " token ids, more than the model's ",
                                                           "vocab_size ", vocab_size_));
  } else {
    tokenizer_ = *std::move(tokenizer);
    return &*tokenizer_;
  }
  return load_status_;
}

absl::StatusOr<Document> TextRecordEncoder::EncodeText(absl::string_view text) {
  LATHE_ASSIGN_OR_RETURN(const Tokenizer* tokenizer, GetTokenizer("text"));
  LATHE_ASSIGN_OR_RETURN(std::vector<int64_t> ids, tokenizer->Encode(text, true));
  if (eos_token_id_.has_value() && (ids.empty() || ids.back() != *eos_token_id_)) {
    ids.push_back(*eos_token_id_);
  }
  Document doc;
  doc.labels = ids;
  doc.input_ids = std::move(ids);
  return doc;
}

absl::StatusOr<Document> TextRecordEncoder::EncodeChat(const std::vector<ChatMessage>& messages) {
  LATHE_ASSIGN_OR_RETURN(const Tokenizer* tokenizer, GetTokenizer("chat"));
  const ChatFormat format = ChatFormatOf(*tokenizer);
  if (format == ChatFormat::kNone) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chat records need a chat format, but ", tokenizer_name_,
        " has the special tokens of neither ChatML (<|im_start|>, <|im_end|>) nor Llama 3 "
        "(<|begin_of_text|>, <|start_header_id|>, <|end_header_id|>, <|eot_id|>); give "
        "\"text\" or \"input_ids\" records"));
  }
  bool has_assistant = false;
  for (const ChatMessage& message : messages) {
    has_assistant = has_assistant || message.role == ChatMessage::Role::kAssistant;
  }
  if (!has_assistant) {
    return absl::InvalidArgumentError("messages has no assistant turn, so nothing to train on");
  }
  DocumentBuilder doc(*tokenizer);
  // The text before an assistant's content is tokenised apart from it, as it is when the
  // model generates after the prompt; other turns are tokenised as the template renders
  // them, header and content together.
  if (format == ChatFormat::kChatMl) {
    // <|im_start|>{role}\n{content}<|im_end|>\n
    const int64_t start = *tokenizer->TokenId("<|im_start|>");
    const int64_t end = *tokenizer->TokenId("<|im_end|>");
    for (const ChatMessage& message : messages) {
      const bool target = message.role == ChatMessage::Role::kAssistant;
      doc.Token(start, false);
      if (target) {
        LATHE_RETURN_IF_ERROR(doc.Text(absl::StrCat(RoleName(message.role), "\n"), false));
        LATHE_RETURN_IF_ERROR(doc.Text(message.content, true));
      } else {
        LATHE_RETURN_IF_ERROR(
            doc.Text(absl::StrCat(RoleName(message.role), "\n", message.content), false));
      }
      doc.Token(end, target);
      LATHE_RETURN_IF_ERROR(doc.Text("\n", false));
    }
    return doc.Finish();
  }
  // Llama 3: <|begin_of_text|> then, per message,
  // <|start_header_id|>{role}<|end_header_id|>\n\n{content, trimmed}<|eot_id|>
  doc.Token(*tokenizer->TokenId("<|begin_of_text|>"), false);
  const int64_t header_start = *tokenizer->TokenId("<|start_header_id|>");
  const int64_t header_end = *tokenizer->TokenId("<|end_header_id|>");
  const int64_t end = *tokenizer->TokenId("<|eot_id|>");
  for (const ChatMessage& message : messages) {
    const bool target = message.role == ChatMessage::Role::kAssistant;
    const absl::string_view content = StripPythonSpace(message.content);
    doc.Token(header_start, false);
    LATHE_RETURN_IF_ERROR(doc.Text(RoleName(message.role), false));
    doc.Token(header_end, false);
    if (target) {
      LATHE_RETURN_IF_ERROR(doc.Text("\n\n", false));
      LATHE_RETURN_IF_ERROR(doc.Text(content, true));
    } else {
      LATHE_RETURN_IF_ERROR(doc.Text(absl::StrCat("\n\n", content), false));
    }
    doc.Token(end, target);
  }
  return doc.Finish();
}

absl::StatusOr<Document> TextRecordEncoder::EncodeInstruction(absl::string_view instruction,
                                                              absl::string_view input,
                                                              absl::string_view output) {
  LATHE_ASSIGN_OR_RETURN(const Tokenizer* tokenizer, GetTokenizer("instruction"));
  if (ChatFormatOf(*tokenizer) != ChatFormat::kNone) {
    std::string user(instruction);
    if (!input.empty()) absl::StrAppend(&user, "\n\n", input);
    return EncodeChat({{ChatMessage::Role::kUser, std::move(user)},
                       {ChatMessage::Role::kAssistant, std::string(output)}});
  }
  if (!eos_token_id_.has_value()) {
    return absl::InvalidArgumentError(
        "instruction records need an eos_token_id in config.json when the tokenizer has no "
        "chat format (the Alpaca prompt ends the response with it)");
  }
  DocumentBuilder doc(*tokenizer);
  doc.Tokens(tokenizer->template_prefix(), false);
  const std::string prompt = input.empty()
                                 ? absl::StrCat(kAlpacaPrompt, instruction, "\n\n### Response:\n")
                                 : absl::StrCat(kAlpacaPromptWithInput, instruction,
                                                "\n\n### Input:\n", input, "\n\n### Response:\n");
  LATHE_RETURN_IF_ERROR(doc.Text(prompt, false));
  LATHE_RETURN_IF_ERROR(doc.Text(output, true));
  doc.Tokens(tokenizer->template_suffix(), true);
  if (doc.last() != *eos_token_id_) doc.Token(*eos_token_id_, true);
  return doc.Finish();
}

}  // namespace lathe
