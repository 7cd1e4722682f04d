// Typed, checked access to the keys of a JSON object (a Hugging Face config.json), with
// errors that name the file and the key. Shared by the engine's model config
// (common/model_config.h) and the planner's model shape (planner/).
//
// Thread-safety: a ConfigFields reads a JSON value it does not own; use it on one thread.
#ifndef LATHE_COMMON_JSON_FIELDS_H_
#define LATHE_COMMON_JSON_FIELDS_H_

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lathe {

// Untrusted text for an error message: printable ASCII kept, every other byte as \xNN, so
// the message stays one line whatever the input (parsers' messages quote the bytes they
// stopped at).
std::string PrintableAscii(absl::string_view text);

// Renders a JSON value for an error message: compact, on one line (control characters
// escaped as JSON does, invalid UTF-8 replaced), cut between characters after `max_chars`
// with "...". Untrusted input: renders only what it shows, so a deeply nested value costs
// no deep recursion (dump() would be one frame per level) and a huge one no long string.
std::string DescribeJson(const nlohmann::json& value, size_t max_chars = 40);

// Typed access to the keys of one JSON object. Absent and null keys read as std::nullopt
// (Hugging Face writes null for "use the default"). Errors read
// "<source>: <prefix><key>: <problem>" (INVALID_ARGUMENT).
class ConfigFields {
 public:
  // `object` and `source` must outlive this.
  ConfigFields(const nlohmann::json& object, absl::string_view source, std::string prefix)
      : object_(object), source_(source), prefix_(std::move(prefix)) {}

  absl::Status Error(absl::string_view key, absl::string_view problem) const;
  // The value at `key`, or null when it is absent or JSON null.
  const nlohmann::json* Find(absl::string_view key) const;

  absl::StatusOr<std::optional<int64_t>> Int(absl::string_view key) const;
  absl::StatusOr<std::optional<double>> Double(absl::string_view key) const;
  absl::StatusOr<std::optional<bool>> Bool(absl::string_view key) const;
  absl::StatusOr<std::optional<std::string>> String(absl::string_view key) const;

  // A size that must be present and > 0.
  absl::StatusOr<int64_t> RequiredPositive(absl::string_view key) const;
  // A size that defaults to `fallback` when absent or null, and must be > 0 when given.
  absl::StatusOr<int64_t> OptionalPositive(absl::string_view key, int64_t fallback) const;
  // A real number that defaults to `fallback` and must be finite and > 0.
  absl::StatusOr<double> PositiveDouble(absl::string_view key, double fallback) const;
  absl::StatusOr<double> RequiredDouble(absl::string_view key) const;
  absl::StatusOr<bool> BoolOr(absl::string_view key, bool fallback) const;

 private:
  absl::StatusOr<int64_t> CheckPositive(absl::string_view key, int64_t value) const;

  const nlohmann::json& object_;
  absl::string_view source_;
  std::string prefix_;
};

}  // namespace lathe

#endif  // LATHE_COMMON_JSON_FIELDS_H_
