#include "common/json_fields.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace lathe {

using Json = nlohmann::json;

namespace {

// Appends compact JSON for `value` (as dump() writes it) to `out` until `out` is longer than
// `limit`.
void AppendJson(const Json& value, size_t limit, std::string* out) {
  if (out->size() > limit) return;
  if (!value.is_structured()) {
    *out += value.dump(-1, ' ', false, Json::error_handler_t::replace);
    return;
  }
  out->push_back(value.is_array() ? '[' : '{');
  for (auto it = value.begin(); it != value.end() && out->size() <= limit; ++it) {
    if (it != value.begin()) out->push_back(',');
    if (value.is_object()) {
      *out += Json(it.key()).dump(-1, ' ', false, Json::error_handler_t::replace);
      out->push_back(':');
    }
    AppendJson(it.value(), limit, out);
  }
  out->push_back(value.is_array() ? ']' : '}');
}

}  // namespace

std::string PrintableAscii(absl::string_view text) {
  std::string out;
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f) {
      out.push_back(c);
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(byte, absl::kZeroPad2));
    }
  }
  return out;
}

std::string DescribeJson(const Json& value, size_t max_chars) {
  std::string text;
  AppendJson(value, max_chars, &text);
  if (text.size() > max_chars) {
    size_t cut = max_chars;  // between UTF-8 characters
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
    text = text.substr(0, cut) + "...";
  }
  return text;
}

absl::Status ConfigFields::Error(absl::string_view key, absl::string_view problem) const {
  return absl::InvalidArgumentError(absl::StrCat(source_, ": ", prefix_, key, ": ", problem));
}

const Json* ConfigFields::Find(absl::string_view key) const {
  auto it = object_.find(std::string(key));
  if (it == object_.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::StatusOr<std::optional<int64_t>> ConfigFields::Int(absl::string_view key) const {
  const Json* value = Find(key);
  if (value == nullptr) return std::nullopt;
  if (value->is_number_unsigned()) {
    uint64_t v = value->get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Error(key, absl::StrCat(DescribeJson(*value), " is out of range"));
    }
    return static_cast<int64_t>(v);
  }
  if (value->is_number_integer()) return value->get<int64_t>();
  if (value->is_number_float()) {
    // Some exporters write integral sizes as floats ("hidden_size": 4096.0).
    double v = value->get<double>();
    if (std::isfinite(v) && std::floor(v) == v && std::fabs(v) < 9.0e18) {
      return static_cast<int64_t>(v);
    }
  }
  return Error(key, absl::StrCat("expected an integer, got ", DescribeJson(*value)));
}

absl::StatusOr<std::optional<double>> ConfigFields::Double(absl::string_view key) const {
  const Json* value = Find(key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_number()) {
    return Error(key, absl::StrCat("expected a number, got ", DescribeJson(*value)));
  }
  return value->get<double>();
}

absl::StatusOr<std::optional<bool>> ConfigFields::Bool(absl::string_view key) const {
  const Json* value = Find(key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_boolean()) {
    return Error(key, absl::StrCat("expected true or false, got ", DescribeJson(*value)));
  }
  return value->get<bool>();
}

absl::StatusOr<std::optional<std::string>> ConfigFields::String(absl::string_view key) const {
  const Json* value = Find(key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_string()) {
    return Error(key, absl::StrCat("expected a string, got ", DescribeJson(*value)));
  }
  return value->get<std::string>();
}

absl::StatusOr<int64_t> ConfigFields::RequiredPositive(absl::string_view key) const {
  LATHE_ASSIGN_OR_RETURN(std::optional<int64_t> value, Int(key));
  if (!value.has_value()) return Error(key, "required field is missing");
  return CheckPositive(key, *value);
}

absl::StatusOr<int64_t> ConfigFields::OptionalPositive(absl::string_view key,
                                                       int64_t fallback) const {
  LATHE_ASSIGN_OR_RETURN(std::optional<int64_t> value, Int(key));
  if (!value.has_value()) return fallback;
  return CheckPositive(key, *value);
}

absl::StatusOr<double> ConfigFields::PositiveDouble(absl::string_view key, double fallback) const {
  LATHE_ASSIGN_OR_RETURN(std::optional<double> value, Double(key));
  if (!value.has_value()) return fallback;
  if (!std::isfinite(*value) || *value <= 0) {
    return Error(key, absl::StrCat("must be > 0, got ", *value));
  }
  return *value;
}

absl::StatusOr<double> ConfigFields::RequiredDouble(absl::string_view key) const {
  LATHE_ASSIGN_OR_RETURN(std::optional<double> value, Double(key));
  if (!value.has_value()) return Error(key, "required field is missing");
  return *value;
}

absl::StatusOr<bool> ConfigFields::BoolOr(absl::string_view key, bool fallback) const {
  LATHE_ASSIGN_OR_RETURN(std::optional<bool> value, Bool(key));
  return value.value_or(fallback);
}

absl::StatusOr<int64_t> ConfigFields::CheckPositive(absl::string_view key, int64_t value) const {
  if (value <= 0) return Error(key, absl::StrCat("must be > 0, got ", value));
  // Far above any published model, far below what would overflow or exhaust memory before
  // the planner could say so (a config is untrusted input).
  static constexpr std::pair<absl::string_view, int64_t> kMax[] = {
      {"vocab_size", int64_t{1} << 24},
      {"hidden_size", int64_t{1} << 20},
      {"intermediate_size", int64_t{1} << 22},
      {"num_hidden_layers", 4096},
      {"num_attention_heads", 1 << 16},
      {"num_key_value_heads", 1 << 16},
      {"head_dim", 1 << 16},
      {"max_position_embeddings", int64_t{1} << 28},
  };
  for (const auto& [name, max] : kMax) {
    if (key == name && value > max) {
      return Error(key, absl::StrCat("must be <= ", max, ", got ", value));
    }
  }
  return value;
}

}  // namespace lathe
