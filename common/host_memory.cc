#include "common/host_memory.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"
#include "common/status_macros.h"

namespace lathe {

absl::StatusOr<uint64_t> ParseMeminfoBytes(absl::string_view meminfo, absl::string_view field) {
  const std::string prefix = absl::StrCat(field, ":");
  for (absl::string_view line : absl::StrSplit(meminfo, '\n')) {
    if (!absl::ConsumePrefix(&line, prefix)) continue;
    line = absl::StripAsciiWhitespace(line);
    uint64_t multiplier = 1;
    if (absl::ConsumeSuffix(&line, "kB")) multiplier = 1024;
    uint64_t value = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("meminfo: ", field, ": not a number: \"", line, "\""));
    }
    return value * multiplier;
  }
  return absl::InvalidArgumentError(absl::StrCat("meminfo: no ", field, " line"));
}

absl::StatusOr<uint64_t> ParseMemTotalBytes(absl::string_view meminfo) {
  return ParseMeminfoBytes(meminfo, "MemTotal");
}

absl::StatusOr<uint64_t> HostMemoryBytes() {
  LATHE_ASSIGN_OR_RETURN(std::string text, ReadFile("/proc/meminfo"));
  return ParseMemTotalBytes(text);
}

absl::StatusOr<uint64_t> HostAvailableMemoryBytes() {
  LATHE_ASSIGN_OR_RETURN(std::string text, ReadFile("/proc/meminfo"));
  return ParseMeminfoBytes(text, "MemAvailable");
}

}  // namespace lathe
