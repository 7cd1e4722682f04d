#include "common/sha256.h"

#include <string>

#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace lathe {
namespace {

// Test vectors from FIPS 180-4's examples and NIST's SHA-256 byte-oriented vectors.
TEST(Sha256, KnownVectors) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(Sha256Hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, IncrementalUpdatesEqualOneShot) {
  std::string data;
  for (int i = 0; i < 1000; ++i) data.push_back(static_cast<char>(i * 7));
  for (size_t split : {0u, 1u, 55u, 56u, 63u, 64u, 65u, 999u}) {
    Sha256 sha;
    sha.Update(data.substr(0, split));
    sha.Update(data.substr(split));
    EXPECT_EQ(sha.HexDigest(), Sha256Hex(data)) << split;
  }
}

TEST(Sha256, Files) {
  testing::TempDir dir;
  std::string path = dir.Write("f", "abc");
  EXPECT_EQ(*Sha256File(path), Sha256Hex("abc"));
  EXPECT_EQ(Sha256File(dir.Path("missing")).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace lathe
