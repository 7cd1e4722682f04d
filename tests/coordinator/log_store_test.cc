// The coordinator's log files (coordinator/logs): appends at the worker's offsets, resends,
// declared gaps and undeclared ones (refused), the cap, reads in chunks, and what a restarted
// coordinator finds.
#include "coordinator/logs/log_store.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;

TEST(LogStoreTest, AppendsResendsGapsAndTheCap) {
  testing::TempDir dir;
  absl::StatusOr<std::unique_ptr<LogStore>> store = LogStore::Open(dir.Path("logs"), 64);
  ASSERT_TRUE(store.ok()) << store.status();
  const LogKey key{"job-1", 2, 0};
  EXPECT_EQ(*(*store)->Append(key, 0, "step 1\n"), 7);
  EXPECT_EQ(*(*store)->Append(key, 0, "step 1\n"), 7) << "a resend is skipped";
  EXPECT_EQ(*(*store)->Append(key, 3, "p 1\nstep 2\n"), 14) << "the overlap is skipped";
  // A gap only as large as the sender declares lost (issue #27: one offset of 2^62 moved a
  // log's end so far that every real line after it was dropped).
  absl::StatusOr<int64_t> forged = (*store)->Append(key, int64_t{1} << 61, "forged\n", 0);
  EXPECT_EQ(forged.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(forged.status().message(), HasSubstr("past the log's end, 14"));
  EXPECT_EQ((*store)->Append(key, 20, "step 4\n", 5).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(*(*store)->Append(key, 20, "step 4\n", 6), 27) << "six bytes lost";
  absl::StatusOr<LogStore::Chunk> all = (*store)->Read(key, 0, 1000);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->data, "step 1\nstep 2\n[... 6 bytes of this log were lost ...]\nstep 4\n");
  EXPECT_EQ(all->size, static_cast<int64_t>(all->data.size()));
  // In chunks, from an offset.
  absl::StatusOr<LogStore::Chunk> part = (*store)->Read(key, 7, 7);
  ASSERT_TRUE(part.ok());
  EXPECT_EQ(part->data, "step 2\n");
  EXPECT_TRUE((*store)->Read(key, all->size, 10)->data.empty());
  EXPECT_TRUE((*store)->Read({"job-1", 1, 0}, 0, 10)->data.empty()) << "no such log: empty";

  // Over the cap of 64 bytes: cut, marked once, then nothing more.
  ASSERT_TRUE((*store)->Append(key, 27, std::string(40, 'x') + "\n").ok());
  ASSERT_TRUE((*store)->Append(key, 68, "more\n").ok());
  all = (*store)->Read(key, 0, 1000);
  EXPECT_THAT(all->data, HasSubstr("[... this log reached its cap of 64 bytes"));
  EXPECT_THAT(all->data, ::testing::Not(HasSubstr("more")));

  // A restarted coordinator takes the file's size for what it has.
  absl::StatusOr<std::unique_ptr<LogStore>> again = LogStore::Open(dir.Path("logs"));
  ASSERT_TRUE(again.ok());
  const LogKey other{"job-2", 1, 1};
  ASSERT_TRUE((*store)->Append(other, 0, "a\n").ok());
  EXPECT_EQ(*(*again)->Append(other, 0, "a\nb\n"), 4);
  EXPECT_EQ((*again)->Read(other, 0, 100)->data, "a\nb\n");
}

TEST(LogStoreTest, AnUncreatableDirectoryIsNamed) {
  testing::TempDir dir;
  dir.Write("file", "x");
  absl::StatusOr<std::unique_ptr<LogStore>> store = LogStore::Open(dir.Path("file/logs"));
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(store.status().message(),
              HasSubstr("--log-dir: cannot create " + dir.Path("file/logs")));
}

}  // namespace
}  // namespace lathe
