#include "common/data_check.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace lathe {
namespace {

using Json = nlohmann::json;

constexpr int64_t kIgnoreLabel = -100;

// The offset of the first byte that is not part of well-formed UTF-8, if any.
std::optional<size_t> FindInvalidUtf8(absl::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    size_t n = 0;
    uint32_t min = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, min = 0x10000;
    } else {
      return i;
    }
    if (i + n >= text.size()) return i;  // cut short
    uint32_t code = c & (0x3F >> n);
    for (size_t k = 1; k <= n; ++k) {
      const auto b = static_cast<unsigned char>(text[i + k]);
      if ((b & 0xC0) != 0x80) return i;
      code = (code << 6) | (b & 0x3F);
    }
    if (code < min || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return i;
    i += n + 1;
  }
  return std::nullopt;
}

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

// The trainer's checks of an id array (worker/engine/token_dataset.cc), without keeping it.
absl::StatusOr<size_t> CheckIds(const Json& value, absl::string_view key, int64_t vocab_size) {
  if (!value.is_array()) return Invalid(absl::StrCat(key, " is not an array"));
  for (size_t i = 0; i < value.size(); ++i) {
    const Json& v = value[i];
    if (!v.is_number_integer()) {
      return Invalid(absl::StrCat(key, "[", i, "] is not an integer: ", v.dump()));
    }
    const int64_t id = v.get<int64_t>();
    if (key == "labels") {
      if (id != kIgnoreLabel && (id < 0 || id >= vocab_size)) {
        return Invalid(absl::StrCat("labels[", i, "]: ", id,
                                    " is neither -100 nor a token id below ", vocab_size));
      }
    } else if (id < 0 || id >= vocab_size) {
      return Invalid(absl::StrCat(key, "[", i, "]: token id ", id,
                                  " is outside the vocabulary (vocab_size ", vocab_size, ")"));
    }
  }
  return value.size();
}

absl::Status CheckString(const Json& value, absl::string_view key) {
  if (!value.is_string()) return Invalid(absl::StrCat(key, " is not a string"));
  return absl::OkStatus();
}

absl::Status CheckMessages(const Json& value) {
  if (!value.is_array()) return Invalid("messages is not a list");
  if (value.empty()) return Invalid("messages is empty");
  bool has_assistant = false;
  for (size_t i = 0; i < value.size(); ++i) {
    const Json& message = value[i];
    const std::string name = absl::StrCat("messages[", i, "]");
    if (!message.is_object()) return Invalid(name + " is not an object");
    for (auto it = message.begin(); it != message.end(); ++it) {
      if (it.key() != "role" && it.key() != "content") {
        return Invalid(
            absl::StrCat(name, ": unknown field \"", it.key(), "\" (only role and content)"));
      }
    }
    if (!message.contains("role")) return Invalid(name + " has no \"role\"");
    if (!message.contains("content")) return Invalid(name + " has no \"content\"");
    LATHE_RETURN_IF_ERROR(CheckString(message["role"], name + ".role"));
    const std::string role = message["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant") {
      return Invalid(
          absl::StrCat(name, ".role: \"", role, "\" is not one of system, user, assistant"));
    }
    has_assistant = has_assistant || role == "assistant";
    LATHE_RETURN_IF_ERROR(CheckString(message["content"], name + ".content"));
  }
  if (!has_assistant) return Invalid("messages has no assistant turn, so nothing to train on");
  return absl::OkStatus();
}

// One line, as token_dataset.cc's ParseRecord and text_record_encoder.cc read it.
absl::Status CheckRecord(absl::string_view line, int64_t vocab_size, const std::string& model_dir,
                         std::optional<bool>& has_tokenizer) {
  const Json record = Json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (record.is_discarded()) {
    if (std::optional<size_t> bad = FindInvalidUtf8(line); bad.has_value()) {
      return Invalid(absl::StrCat("invalid UTF-8 at byte ", *bad));
    }
    return Invalid("not valid JSON");
  }
  if (!record.is_object()) return Invalid("not a JSON object");
  std::vector<absl::string_view> kinds;
  for (absl::string_view kind : {"input_ids", "text", "messages", "instruction"}) {
    if (record.contains(kind)) kinds.push_back(kind);
  }
  if (kinds.empty()) return Invalid("no \"input_ids\", \"text\", \"messages\" or \"instruction\"");
  if (kinds.size() > 1) {
    return Invalid(
        absl::StrCat("has both \"", kinds[0], "\" and \"", kinds[1], "\"; give one per record"));
  }
  const absl::string_view kind = kinds[0];
  auto labels = record.find("labels");
  const bool has_labels = labels != record.end() && !labels->is_null();
  if (kind == "input_ids") {
    LATHE_ASSIGN_OR_RETURN(size_t n, CheckIds(record["input_ids"], "input_ids", vocab_size));
    if (n == 0) return Invalid("input_ids is empty");
    if (!has_labels) return absl::OkStatus();
    if (!labels->is_array()) return Invalid("labels is not an array");
    if (labels->size() != n) {
      return Invalid(absl::StrCat("labels has ", labels->size(), " entries but input_ids has ", n));
    }
    return CheckIds(*labels, "labels", vocab_size).status();
  }
  if (has_labels) {
    return Invalid(absl::StrCat("\"labels\" go with \"input_ids\" only, not with \"", kind, "\""));
  }
  if (kind == "text") {
    LATHE_RETURN_IF_ERROR(CheckString(record["text"], "text"));
    if (record["text"].get<std::string>().empty()) return Invalid("text is empty");
  } else if (kind == "messages") {
    LATHE_RETURN_IF_ERROR(CheckMessages(record["messages"]));
  } else {
    LATHE_RETURN_IF_ERROR(CheckString(record["instruction"], "instruction"));
    if (auto input = record.find("input"); input != record.end() && !input->is_null()) {
      LATHE_RETURN_IF_ERROR(CheckString(*input, "input"));
    }
    auto output = record.find("output");
    if (output == record.end()) return Invalid("no \"output\"");
    LATHE_RETURN_IF_ERROR(CheckString(*output, "output"));
  }
  const std::string tokenizer = (std::filesystem::path(model_dir) / "tokenizer.json").string();
  if (!has_tokenizer.has_value()) {
    std::error_code error;
    has_tokenizer = std::filesystem::is_regular_file(tokenizer, error);
  }
  if (!*has_tokenizer) {
    const absl::string_view what = kind == "messages" ? "chat" : kind;
    return Invalid(absl::StrCat(what, " records need ", tokenizer, ", which does not exist"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckDataFile(const std::string& path, absl::string_view field, int64_t vocab_size,
                           const std::string& model_dir, const DataCheckLimits& limits) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(field, ": ", path, ": no such file or not readable"));
  }
  // At most max_bytes, and one more to know whether the file ends within them.
  std::string head(static_cast<size_t>(std::max<int64_t>(limits.max_bytes, 0)) + 1, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  if (in.bad()) return absl::InternalError(absl::StrCat(field, ": ", path, ": read error"));
  head.resize(static_cast<size_t>(in.gcount()));
  const bool whole = head.size() <= static_cast<size_t>(std::max<int64_t>(limits.max_bytes, 0));
  if (!whole) {
    // Only complete lines: drop the one the bound cuts.
    const size_t last_newline =
        head.size() < 2 ? std::string::npos : head.rfind('\n', head.size() - 2);
    head.resize(last_newline == std::string::npos ? 0 : last_newline + 1);
  }
  std::vector<absl::string_view> lines = absl::StrSplit(head, '\n');
  if (!lines.empty() && lines.back().empty()) lines.pop_back();  // after the last newline
  std::optional<bool> has_tokenizer;
  int64_t records = 0;
  int64_t line_number = 0;
  for (absl::string_view line : lines) {
    if (line_number == limits.max_lines) return absl::OkStatus();
    ++line_number;
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    absl::Status status = CheckRecord(line, vocab_size, model_dir, has_tokenizer);
    if (!status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", path, ": line ", line_number, ": ", status.message()));
    }
    ++records;
  }
  if (whole && records == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, ": the data set is empty"));
  }
  return absl::OkStatus();
}

}  // namespace lathe
