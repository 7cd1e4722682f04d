// A small parser for `program SUBCOMMAND --flag value --switch ...` command lines, shared
// by the Lathe binaries. Each subcommand declares its flags; anything else is a usage error
// naming the flag. (absl flags are global and process-wide, which does not fit several
// subcommands with different flags in one binary.)
//
// Thread-safety: plain values.
#ifndef LATHE_COMMON_COMMAND_LINE_H_
#define LATHE_COMMON_COMMAND_LINE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lathe {

struct FlagSpec {
  std::string name;  // without the leading "--"
  bool takes_value = true;
  std::string help;
};

class ParsedFlags {
 public:
  bool Has(absl::string_view name) const { return values_.count(std::string(name)) > 0; }
  // The value of --name, or `fallback` when absent.
  std::string Get(absl::string_view name, absl::string_view fallback = "") const;
  // Typed accessors: INVALID_ARGUMENT "--name: expected an integer, got "x"" on bad text.
  absl::StatusOr<int64_t> GetInt(absl::string_view name, int64_t fallback) const;
  absl::StatusOr<double> GetDouble(absl::string_view name, double fallback) const;
  // Arguments that are not flags, in order.
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  friend absl::StatusOr<ParsedFlags> ParseFlags(const std::vector<std::string>& args,
                                                const std::vector<FlagSpec>& specs);
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

// Parses `args` (without the program and subcommand names). Accepts "--name value",
// "--name=value" and, for switches, "--name". INVALID_ARGUMENT naming the flag for an
// unknown flag, a missing value, or a value given to a switch.
absl::StatusOr<ParsedFlags> ParseFlags(const std::vector<std::string>& args,
                                       const std::vector<FlagSpec>& specs);

// "  --name VALUE   help" lines for a usage message.
std::string FlagsHelp(const std::vector<FlagSpec>& specs);

// Whether `args` ask for help (--help or -h), which every command answers with its usage on
// stdout and exit code 0, whatever else they hold.
bool WantsHelp(const std::vector<std::string>& args);

}  // namespace lathe

#endif  // LATHE_COMMON_COMMAND_LINE_H_
