// The names a profile capture may use (common/profile_limits.h), which the coordinator, the
// agent and the trainer all check.
#include "common/profile_limits.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;

TEST(ProfileLimitsTest, OnlyPlainNamesAndCaptureIds) {
  for (const char* bad : {"", ".", "..", "a/b", "../x", "/etc/passwd", "a\\b", "tab\tname"}) {
    EXPECT_EQ(CheckProfileFileName(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(CheckProfileFileName(std::string(129, 'a')).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckProfileFileName("rank0.pt.trace.json").ok());
  EXPECT_TRUE(CheckProfileFileName("..trace").ok()) << "dots inside a name are fine";
  EXPECT_THAT(CheckProfileFileName("a/b", "files[0]").message(),
              HasSubstr("files[0]: \"a/b\" is not a plain file name"));
  EXPECT_TRUE(CheckCaptureId("prof-1").ok());
  EXPECT_EQ(CheckCaptureId("prof.1").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckCaptureId("").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckCaptureId(std::string(65, 'p')).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace lathe
