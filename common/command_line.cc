#include "common/command_line.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace lathe {

std::string ParsedFlags::Get(absl::string_view name, absl::string_view fallback) const {
  auto it = values_.find(std::string(name));
  return it == values_.end() ? std::string(fallback) : it->second;
}

absl::StatusOr<int64_t> ParsedFlags::GetInt(absl::string_view name, int64_t fallback) const {
  auto it = values_.find(std::string(name));
  if (it == values_.end()) return fallback;
  int64_t value = 0;
  if (!absl::SimpleAtoi(it->second, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, ": expected an integer, got \"", it->second, "\""));
  }
  return value;
}

absl::StatusOr<double> ParsedFlags::GetDouble(absl::string_view name, double fallback) const {
  auto it = values_.find(std::string(name));
  if (it == values_.end()) return fallback;
  double value = 0;
  if (!absl::SimpleAtod(it->second, &value) || !std::isfinite(value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, ": expected a number, got \"", it->second, "\""));
  }
  return value;
}

bool WantsHelp(const std::vector<std::string>& args) {
  for (const std::string& arg : args) {
    if (arg == "--help" || arg == "-h") return true;
  }
  return false;
}

absl::StatusOr<ParsedFlags> ParseFlags(const std::vector<std::string>& args,
                                       const std::vector<FlagSpec>& specs) {
  ParsedFlags parsed;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) {
      parsed.positional_.push_back(arg);
      continue;
    }
    std::string name = arg.substr(2);
    std::optional<std::string> inline_value;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name.resize(eq);
    }
    const FlagSpec* spec = nullptr;
    for (const FlagSpec& s : specs) {
      if (s.name == name) spec = &s;
    }
    if (spec == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    if (!spec->takes_value) {
      if (inline_value) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
      }
      parsed.values_[name] = "true";
    } else if (inline_value) {
      parsed.values_[name] = *inline_value;
    } else if (i + 1 < args.size()) {
      parsed.values_[name] = args[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
    }
  }
  return parsed;
}

std::string FlagsHelp(const std::vector<FlagSpec>& specs) {
  std::string out;
  for (const FlagSpec& s : specs) {
    std::string left = absl::StrCat("  --", s.name, s.takes_value ? " VALUE" : "");
    if (left.size() < 24) left.resize(24, ' ');
    absl::StrAppend(&out, left, " ", s.help, "\n");
  }
  return out;
}

}  // namespace lathe
