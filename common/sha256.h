// SHA-256 (FIPS 180-4), for the checksums in checkpoint manifests.
//
// Thread-safety: a Sha256 object is not thread-safe; the free functions are.
#ifndef LATHE_COMMON_SHA256_H_
#define LATHE_COMMON_SHA256_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lathe {

class Sha256 {
 public:
  Sha256();
  void Update(const void* data, size_t size);
  void Update(absl::string_view data) { Update(data.data(), data.size()); }
  // The digest as 64 lowercase hex digits. The object must not be updated afterwards.
  std::string HexDigest();

 private:
  void Compress(const uint8_t* block);

  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> buffer_;
  size_t buffered_ = 0;
  uint64_t length_ = 0;  // bytes
};

// SHA-256 of `data` as hex.
std::string Sha256Hex(absl::string_view data);

// SHA-256 of the file at `path`, read in chunks. NOT_FOUND / INTERNAL naming the path.
absl::StatusOr<std::string> Sha256File(const std::string& path);

}  // namespace lathe

#endif  // LATHE_COMMON_SHA256_H_
