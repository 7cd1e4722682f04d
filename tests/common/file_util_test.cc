#include "common/file_util.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace lathe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;

using testing::StatusIs;

class FileUtilTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "lathe_file_util_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  std::vector<std::string> DirEntries() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  std::string dir_;
};

TEST_F(FileUtilTest, ReadMissingFileIsNotFound) {
  EXPECT_THAT(ReadFile(Path("absent")), StatusIs(absl::StatusCode::kNotFound, Path("absent")));
}

TEST_F(FileUtilTest, ReadDirectoryIsInternal) {
  EXPECT_THAT(ReadFile(dir_), StatusIs(absl::StatusCode::kInternal, dir_));
}

TEST_F(FileUtilTest, WriteThenReadRoundTrips) {
  std::string contents("binary\0data\n", 12);
  ASSERT_TRUE(WriteFileAtomically(Path("f"), contents).ok());
  absl::StatusOr<std::string> read = ReadFile(Path("f"));
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, contents);
  EXPECT_THAT(DirEntries(), ElementsAre("f"));
}

TEST_F(FileUtilTest, WriteReplacesExistingFile) {
  ASSERT_TRUE(WriteFileAtomically(Path("f"), "old contents that are longer").ok());
  ASSERT_TRUE(WriteFileAtomically(Path("f"), "new").ok());
  EXPECT_EQ(*ReadFile(Path("f")), "new");
  EXPECT_THAT(DirEntries(), ElementsAre("f"));
}

TEST_F(FileUtilTest, WriteEmptyFile) {
  ASSERT_TRUE(WriteFileAtomically(Path("empty"), "").ok());
  EXPECT_EQ(*ReadFile(Path("empty")), "");
}

TEST_F(FileUtilTest, LargeContentsRoundTrip) {
  std::string contents(3 * 1024 * 1024 + 17, '\0');
  for (size_t i = 0; i < contents.size(); ++i) contents[i] = static_cast<char>(i * 131);
  ASSERT_TRUE(WriteFileAtomically(Path("big"), contents).ok());
  EXPECT_EQ(*ReadFile(Path("big")), contents);
}

TEST_F(FileUtilTest, WriteIntoMissingDirectoryFailsAndLeavesNothing) {
  absl::Status status = WriteFileAtomically(Path("no/such/dir/f"), "x");
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kInternal, Path("no/such/dir/f")));
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kInternal, "No such file or directory"));
  EXPECT_THAT(DirEntries(), IsEmpty());
}

TEST_F(FileUtilTest, FailedRenameRemovesTempFileAndKeepsTarget) {
  // A non-empty directory at the target path makes the final rename fail.
  std::filesystem::create_directory(Path("target"));
  ASSERT_TRUE(WriteFileAtomically(Path("target/inner"), "keep").ok());
  EXPECT_THAT(WriteFileAtomically(Path("target"), "x"),
              StatusIs(absl::StatusCode::kInternal, "rename"));
  EXPECT_THAT(DirEntries(), ElementsAre("target"));
  EXPECT_EQ(*ReadFile(Path("target/inner")), "keep");
}

TEST_F(FileUtilTest, WriterShowsNothingBeforeCommit) {
  absl::StatusOr<AtomicFileWriter> writer = AtomicFileWriter::Open(Path("f"));
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE(writer->Append("hello ").ok());
  ASSERT_TRUE(writer->Append("world", 5).ok());
  std::vector<std::string> entries = DirEntries();
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_THAT(entries[0], StartsWith(absl::StrCat("f.tmp.", ::getpid(), ".")));

  ASSERT_TRUE(writer->Commit().ok());
  EXPECT_THAT(DirEntries(), ElementsAre("f"));
  EXPECT_EQ(*ReadFile(Path("f")), "hello world");
}

TEST_F(FileUtilTest, UncommittedWriterRemovesTempFile) {
  {
    absl::StatusOr<AtomicFileWriter> writer = AtomicFileWriter::Open(Path("f"));
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE(writer->Append("partial").ok());
  }
  EXPECT_THAT(DirEntries(), IsEmpty());
}

TEST_F(FileUtilTest, MovedWriterKeepsTempFileUntilCommit) {
  absl::StatusOr<AtomicFileWriter> opened = AtomicFileWriter::Open(Path("f"));
  ASSERT_TRUE(opened.ok()) << opened.status();
  AtomicFileWriter writer = *std::move(opened);
  {
    AtomicFileWriter moved = std::move(writer);
    ASSERT_TRUE(moved.Append("abc").ok());
    ASSERT_TRUE(moved.Commit().ok());
  }
  EXPECT_EQ(*ReadFile(Path("f")), "abc");
  EXPECT_THAT(writer.Append("x"), StatusIs(absl::StatusCode::kFailedPrecondition, ""));
}

TEST_F(FileUtilTest, WriterRejectsCallsAfterCommit) {
  absl::StatusOr<AtomicFileWriter> writer = AtomicFileWriter::Open(Path("f"));
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE(writer->Commit().ok());
  EXPECT_THAT(writer->Append("x"), StatusIs(absl::StatusCode::kFailedPrecondition, Path("f")));
  EXPECT_THAT(writer->Commit(), StatusIs(absl::StatusCode::kFailedPrecondition, Path("f")));
  EXPECT_EQ(*ReadFile(Path("f")), "");
}

TEST_F(FileUtilTest, ConcurrentWritersUseDistinctTempFiles) {
  absl::StatusOr<AtomicFileWriter> first = AtomicFileWriter::Open(Path("f"));
  absl::StatusOr<AtomicFileWriter> second = AtomicFileWriter::Open(Path("f"));
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_TRUE(first->Append("first").ok());
  ASSERT_TRUE(second->Append("second").ok());
  EXPECT_EQ(DirEntries().size(), 2u);
  ASSERT_TRUE(first->Commit().ok());
  ASSERT_TRUE(second->Commit().ok());
  EXPECT_THAT(DirEntries(), ElementsAre("f"));
  EXPECT_EQ(*ReadFile(Path("f")), "second");
}

TEST_F(FileUtilTest, ModelSideFilesAreCopiedWhereTheyExist) {
  std::filesystem::create_directories(Path("base"));
  std::filesystem::create_directories(Path("out"));
  ASSERT_TRUE(WriteFileAtomically(Path("base/tokenizer.json"), "{}").ok());
  ASSERT_TRUE(WriteFileAtomically(Path("base/generation_config.json"), "{\"a\": 1}").ok());
  ASSERT_TRUE(WriteFileAtomically(Path("base/model.safetensors"), "weights").ok());
  ASSERT_TRUE(CopyModelSideFiles(Path("base"), Path("out")).ok());
  EXPECT_EQ(*ReadFile(Path("out/tokenizer.json")), "{}");
  EXPECT_EQ(*ReadFile(Path("out/generation_config.json")), "{\"a\": 1}");
  EXPECT_FALSE(std::filesystem::exists(Path("out/model.safetensors")));
  EXPECT_FALSE(std::filesystem::exists(Path("out/special_tokens_map.json")));
}

TEST_F(FileUtilTest, SyncDirectory) {
  EXPECT_TRUE(SyncDirectory(dir_).ok());
  EXPECT_THAT(SyncDirectory(Path("absent")), StatusIs(absl::StatusCode::kInternal, Path("absent")));
}

}  // namespace
}  // namespace lathe
