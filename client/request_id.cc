#include "client/request_id.h"

#include <cstdint>
#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace lathe {

absl::StatusOr<std::string> NewRequestId() {
  char bytes[16];
  std::ifstream urandom("/dev/urandom", std::ios::binary);
  if (!urandom.read(bytes, sizeof(bytes))) {
    return absl::InternalError("cannot read 16 random bytes from /dev/urandom");
  }
  bytes[6] = static_cast<char>((static_cast<uint8_t>(bytes[6]) & 0x0f) | 0x40);  // version 4
  bytes[8] = static_cast<char>((static_cast<uint8_t>(bytes[8]) & 0x3f) | 0x80);  // RFC 4122
  const std::string hex = absl::BytesToHexString(absl::string_view(bytes, sizeof(bytes)));
  return absl::StrCat(hex.substr(0, 8), "-", hex.substr(8, 4), "-", hex.substr(12, 4), "-",
                      hex.substr(16, 4), "-", hex.substr(20));
}

}  // namespace lathe
