// The coordinator's profile files (coordinator/logs/profile_store.h): plain names only,
// contiguous appends and resends, the bounds per file and per capture, reads in chunks.
#include "coordinator/logs/profile_store.h"

#include <filesystem>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;

// (The names themselves: tests/common/profile_limits_test.cc.)
TEST(ProfileStoreTest, OnlyPlainNamesAndCaptureIds) {
  testing::TempDir dir;
  std::unique_ptr<ProfileStore> store = *ProfileStore::Open(dir.Path("logs"));
  EXPECT_EQ(store->Append({"job", 1, "prof-1", 0, "../../escape"}, 0, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Append({"job", 1, "../p", 0, "trace.json"}, 0, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(dir.Path("logs/escape")));
}

TEST(ProfileStoreTest, AppendsResendsGapsAndReads) {
  testing::TempDir dir;
  std::unique_ptr<ProfileStore> store = *ProfileStore::Open(dir.Path("logs"));
  const ProfileFileKey key{"job", 2, "prof-1", 1, "trace.json"};
  EXPECT_EQ(store->Size(key).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*store->Append(key, 0, "{\"trace"), 7);
  EXPECT_EQ(*store->Append(key, 0, "{\"trace"), 7) << "a resend is skipped";
  EXPECT_EQ(*store->Append(key, 4, "ace\": 1}"), 12) << "the overlap is skipped";
  EXPECT_EQ(store->Append(key, 20, "x").status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(*store->Size(key), 12);
  EXPECT_TRUE(
      std::filesystem::exists(dir.Path("logs/job/attempt-2/profile/prof-1/rank-1/trace.json")));
  absl::StatusOr<ProfileStore::Chunk> part = store->Read(key, 2, 5);
  ASSERT_TRUE(part.ok());
  EXPECT_EQ(part->data, "trace");
  EXPECT_EQ(part->size, 12);
  EXPECT_TRUE(store->Read(key, 12, 10)->data.empty());
  EXPECT_EQ(store->Read({"job", 2, "prof-1", 0, "trace.json"}, 0, 10).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(ProfileStoreTest, AFileAndACaptureAreBounded) {
  testing::TempDir dir;
  std::unique_ptr<ProfileStore> store =
      *ProfileStore::Open(dir.Path("logs"), /*max_file_bytes=*/10, /*max_capture_bytes=*/15);
  const ProfileFileKey trace{"job", 1, "prof-1", 0, "trace.json"};
  EXPECT_EQ(*store->Append(trace, 0, "0123456789"), 10);
  absl::StatusOr<int64_t> over = store->Append(trace, 10, "x");
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr("rank 0's trace.json: 11 bytes pass the bound"));
  EXPECT_EQ(*store->Size(trace), 10) << "nothing written";
  // Another rank's file counts toward the same capture.
  const ProfileFileKey other{"job", 1, "prof-1", 1, "trace.json"};
  EXPECT_EQ(*store->Append(other, 0, "01234"), 5);
  over = store->Append(other, 5, "5");
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr("the capture would hold 16 bytes"));
  // Another capture has its own bound.
  EXPECT_EQ(*store->Append({"job", 1, "prof-2", 0, "trace.json"}, 0, "0123456789"), 10);
}

}  // namespace
}  // namespace lathe
