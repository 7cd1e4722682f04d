#include "common/profile_limits.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace lathe {
namespace {

bool IsNameChar(char c, bool dot) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' ||
         (dot && c == '.');
}

}  // namespace

absl::Status CheckCaptureId(absl::string_view capture_id) {
  bool ok = !capture_id.empty() && capture_id.size() <= 64;
  for (char c : capture_id) ok = ok && IsNameChar(c, false);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("capture_id: \"", capture_id.substr(0, 64), "\" is not [A-Za-z0-9_-]{1,64}"));
}

absl::Status CheckProfileFileName(absl::string_view name, absl::string_view what) {
  bool ok = !name.empty() && name.size() <= 128 && name != "." && name != "..";
  for (char c : name) ok = ok && IsNameChar(c, true);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, ": \"", name.substr(0, 128),
                                                 "\" is not a plain file name ([A-Za-z0-9._-], "
                                                 "at most 128, not . or ..)"));
}

}  // namespace lathe
