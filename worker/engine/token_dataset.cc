#include "worker/engine/token_dataset.h"

#include <fstream>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/engine/pre_tokenizer.h"
#include "worker/engine/text_record_encoder.h"

namespace lathe {
namespace {

absl::StatusOr<std::vector<int64_t>> IdArray(const nlohmann::json& value, absl::string_view key) {
  if (!value.is_array()) return absl::InvalidArgumentError(absl::StrCat(key, " is not an array"));
  std::vector<int64_t> ids;
  ids.reserve(value.size());
  for (const nlohmann::json& v : value) {
    if (!v.is_number_integer()) {
      return absl::InvalidArgumentError(
          absl::StrCat(key, "[", ids.size(), "] is not an integer: ", v.dump()));
    }
    ids.push_back(v.get<int64_t>());
  }
  return ids;
}

absl::Status CheckIdsInVocabulary(const std::vector<int64_t>& ids, int64_t vocab_size,
                                  absl::string_view what) {
  for (size_t i = 0; i < ids.size(); ++i) {
    int64_t id = ids[i];
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(what, "[", i, "]: token id ", id,
                                                     " is outside the vocabulary (vocab_size ",
                                                     vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> StringField(const nlohmann::json& value, absl::string_view key) {
  if (!value.is_string()) return absl::InvalidArgumentError(absl::StrCat(key, " is not a string"));
  return value.get<std::string>();
}

absl::StatusOr<std::vector<ChatMessage>> ParseMessages(const nlohmann::json& value) {
  if (!value.is_array()) return absl::InvalidArgumentError("messages is not a list");
  if (value.empty()) return absl::InvalidArgumentError("messages is empty");
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < value.size(); ++i) {
    const nlohmann::json& message = value[i];
    const std::string name = absl::StrCat("messages[", i, "]");
    if (!message.is_object()) return absl::InvalidArgumentError(name + " is not an object");
    for (auto it = message.begin(); it != message.end(); ++it) {
      if (it.key() != "role" && it.key() != "content") {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": unknown field \"", it.key(), "\" (only role and content)"));
      }
    }
    if (!message.contains("role")) return absl::InvalidArgumentError(name + " has no \"role\"");
    if (!message.contains("content")) {
      return absl::InvalidArgumentError(name + " has no \"content\"");
    }
    LATHE_ASSIGN_OR_RETURN(std::string role, StringField(message["role"], name + ".role"));
    ChatMessage parsed;
    if (role == "system") {
      parsed.role = ChatMessage::Role::kSystem;
    } else if (role == "user") {
      parsed.role = ChatMessage::Role::kUser;
    } else if (role == "assistant") {
      parsed.role = ChatMessage::Role::kAssistant;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".role: \"", role, "\" is not one of system, user, assistant"));
    }
    LATHE_ASSIGN_OR_RETURN(parsed.content, StringField(message["content"], name + ".content"));
    messages.push_back(std::move(parsed));
  }
  return messages;
}

// A record of text, messages or an instruction, tokenised by `encoder`.
absl::StatusOr<Document> EncodeTextRecord(const nlohmann::json& record, absl::string_view kind,
                                          TextRecordEncoder* encoder) {
  if (auto labels = record.find("labels"); labels != record.end() && !labels->is_null()) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"labels\" go with \"input_ids\" only, not with \"", kind, "\""));
  }
  if (encoder == nullptr) {
    return absl::InvalidArgumentError(
        "text records need a tokenizer (the model's tokenizer.json), which this caller does not "
        "pass; give \"input_ids\"");
  }
  if (kind == "text") {
    LATHE_ASSIGN_OR_RETURN(std::string text, StringField(record["text"], "text"));
    if (text.empty()) return absl::InvalidArgumentError("text is empty");
    return encoder->EncodeText(text);
  }
  if (kind == "messages") {
    LATHE_ASSIGN_OR_RETURN(std::vector<ChatMessage> messages, ParseMessages(record["messages"]));
    return encoder->EncodeChat(messages);
  }
  LATHE_ASSIGN_OR_RETURN(std::string instruction,
                         StringField(record["instruction"], "instruction"));
  std::string input;
  if (auto it = record.find("input"); it != record.end() && !it->is_null()) {
    LATHE_ASSIGN_OR_RETURN(input, StringField(*it, "input"));
  }
  auto output = record.find("output");
  if (output == record.end()) return absl::InvalidArgumentError("no \"output\"");
  LATHE_ASSIGN_OR_RETURN(std::string output_text, StringField(*output, "output"));
  return encoder->EncodeInstruction(instruction, input, output_text);
}

absl::StatusOr<Document> ParseRecord(absl::string_view line, int64_t vocab_size,
                                     TextRecordEncoder* encoder) {
  nlohmann::json record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (record.is_discarded()) {
    if (std::optional<size_t> bad = FindInvalidUtf8(line); bad.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("invalid UTF-8 at byte ", *bad));
    }
    return absl::InvalidArgumentError("not valid JSON");
  }
  if (!record.is_object()) return absl::InvalidArgumentError("not a JSON object");
  std::vector<absl::string_view> kinds;
  for (absl::string_view kind : {"input_ids", "text", "messages", "instruction"}) {
    if (record.contains(kind)) kinds.push_back(kind);
  }
  if (kinds.empty()) {
    return absl::InvalidArgumentError(
        "no \"input_ids\", \"text\", \"messages\" or \"instruction\"");
  }
  if (kinds.size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("has both \"", kinds[0], "\" and \"", kinds[1], "\"; give one per record"));
  }
  Document doc;
  if (kinds[0] != "input_ids") {
    LATHE_ASSIGN_OR_RETURN(doc, EncodeTextRecord(record, kinds[0], encoder));
    LATHE_RETURN_IF_ERROR(CheckIdsInVocabulary(doc.input_ids, vocab_size, "tokens"));
    return doc;
  }
  LATHE_ASSIGN_OR_RETURN(doc.input_ids, IdArray(record["input_ids"], "input_ids"));
  if (doc.input_ids.empty()) return absl::InvalidArgumentError("input_ids is empty");
  LATHE_RETURN_IF_ERROR(CheckIdsInVocabulary(doc.input_ids, vocab_size, "input_ids"));
  auto labels_it = record.find("labels");
  if (labels_it == record.end() || labels_it->is_null()) {
    doc.labels = doc.input_ids;
    return doc;
  }
  LATHE_ASSIGN_OR_RETURN(doc.labels, IdArray(*labels_it, "labels"));
  if (doc.labels.size() != doc.input_ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "labels has ", doc.labels.size(), " entries but input_ids has ", doc.input_ids.size()));
  }
  for (size_t i = 0; i < doc.labels.size(); ++i) {
    int64_t label = doc.labels[i];
    if (label != kIgnoreLabel && (label < 0 || label >= vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "labels[", i, "]: ", label, " is neither -100 nor a token id below ", vocab_size));
    }
  }
  return doc;
}

uint64_t SplitMix64Next(uint64_t& state) {
  state += 0x9E3779B97F4A7C15ULL;
  uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace

absl::StatusOr<TokenDataset> TokenDataset::Load(const std::string& path, absl::string_view field,
                                                int64_t vocab_size) {
  return Load(path, field, vocab_size, nullptr);
}

absl::StatusOr<TokenDataset> TokenDataset::Load(const std::string& path, absl::string_view field,
                                                int64_t vocab_size, TextRecordEncoder* encoder) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(field, ": ", path, ": no such file or not readable"));
  }
  TokenDataset dataset;
  std::string line;
  int64_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    absl::StatusOr<Document> doc = ParseRecord(line, vocab_size, encoder);
    if (!doc.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", path, ": line ", line_number, ": ", doc.status().message()));
    }
    dataset.total_tokens_ += static_cast<int64_t>(doc->input_ids.size());
    dataset.documents_.push_back(*std::move(doc));
  }
  if (in.bad()) {
    return absl::InternalError(absl::StrCat(field, ": ", path, ": read error"));
  }
  if (dataset.documents_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, ": the data set is empty"));
  }
  return dataset;
}

std::vector<int64_t> EpochPermutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> perm(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) perm[i] = i;
  uint64_t state = seed + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(epoch + 1);
  for (int64_t i = n - 1; i >= 1; --i) {
    uint64_t j = SplitMix64Next(state) % static_cast<uint64_t>(i + 1);
    std::swap(perm[i], perm[j]);
  }
  return perm;
}

SequenceSampler::SequenceSampler(const TokenDataset* dataset, int64_t seq_len, bool pack,
                                 uint64_t seed)
    : dataset_(dataset), seq_len_(seq_len), pack_(pack), seed_(seed) {
  StartEpoch();
}

void SequenceSampler::StartEpoch() {
  ++epoch_;
  order_ = EpochPermutation(static_cast<int64_t>(dataset_->documents().size()), seed_, epoch_);
  next_document_ = 0;
  offset_in_document_ = 0;
}

Sequence SequenceSampler::Next() {
  const std::vector<Document>& docs = dataset_->documents();
  Sequence seq;
  if (!pack_) {
    if (next_document_ == order_.size()) StartEpoch();
    const Document& doc = docs[order_[next_document_++]];
    size_t len = std::min(doc.input_ids.size(), static_cast<size_t>(seq_len_));
    seq.input_ids.assign(doc.input_ids.begin(), doc.input_ids.begin() + len);
    seq.labels.assign(doc.labels.begin(), doc.labels.begin() + len);
    return seq;
  }
  seq.input_ids.reserve(seq_len_);
  seq.labels.reserve(seq_len_);
  while (static_cast<int64_t>(seq.input_ids.size()) < seq_len_) {
    if (next_document_ == order_.size()) StartEpoch();
    const Document& doc = docs[order_[next_document_]];
    size_t take = std::min(doc.input_ids.size() - offset_in_document_,
                           static_cast<size_t>(seq_len_) - seq.input_ids.size());
    for (size_t i = offset_in_document_; i < offset_in_document_ + take; ++i) {
      seq.input_ids.push_back(doc.input_ids[i]);
      // No document is trained to predict the first token of the next one.
      seq.labels.push_back(i == 0 ? kIgnoreLabel : doc.labels[i]);
    }
    offset_in_document_ += take;
    if (offset_in_document_ == doc.input_ids.size()) {
      ++next_document_;
      offset_in_document_ = 0;
    }
  }
  return seq;
}

SequenceSampler::Cursor SequenceSampler::cursor() const {
  return {epoch_, static_cast<int64_t>(next_document_), static_cast<int64_t>(offset_in_document_)};
}

absl::Status SequenceSampler::Restore(const Cursor& cursor) {
  const std::vector<Document>& docs = dataset_->documents();
  const int64_t n = static_cast<int64_t>(docs.size());
  if (cursor.epoch < 0 || cursor.next_document < 0 || cursor.next_document > n ||
      cursor.offset_in_document < 0) {
    return absl::InvalidArgumentError("data cursor out of range for this data set");
  }
  std::vector<int64_t> order = EpochPermutation(n, seed_, cursor.epoch);
  if (cursor.next_document < n &&
      cursor.offset_in_document >=
          static_cast<int64_t>(docs[order[cursor.next_document]].input_ids.size())) {
    return absl::InvalidArgumentError("data cursor points past the end of a document");
  }
  epoch_ = cursor.epoch;
  order_ = std::move(order);
  next_document_ = static_cast<size_t>(cursor.next_document);
  offset_in_document_ = static_cast<size_t>(cursor.offset_in_document);
  return absl::OkStatus();
}

int64_t SequenceSampler::SequencesPerEpoch() const {
  int64_t n = pack_ ? dataset_->total_tokens() / seq_len_
                    : static_cast<int64_t>(dataset_->documents().size());
  return std::max<int64_t>(1, n);
}

}  // namespace lathe
