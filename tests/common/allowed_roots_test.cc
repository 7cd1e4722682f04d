// Paths confined to the allowed roots (common/allowed_roots.h; issue #27): the canonical form
// the coordinator stores, and the trainer's second look, which opens each path below its
// root without following a link and keeps reading and writing what it checked even when the
// path is swapped for a link afterwards.
#include "common/allowed_roots.h"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace lathe {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class AllowedRootsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::canonical(dir_.Path("")).string();
    fs::create_directories(root_ + "/runs/a");
    fs::create_directories(outside_.path());
    fs::create_symlink(root_ + "/runs", root_ + "/alias");
    fs::create_symlink(outside_.path(), root_ + "/escape");
    dir_.Write("data.jsonl", "{}\n");
  }

  testing::TempDir dir_, outside_;
  std::string root_;
};

TEST_F(AllowedRootsTest, TheCanonicalFormResolvesLinksAndMustStayInside) {
  // Two spellings of one directory compare equal once canonical.
  EXPECT_EQ(*CanonicalInRoots(root_ + "/alias/a", {root_}, "output"), root_ + "/runs/a");
  EXPECT_EQ(*CanonicalInRoots(root_ + "/runs/./b/../a/", {root_}, "output"), root_ + "/runs/a");
  EXPECT_EQ(*CanonicalInRoots(root_ + "/alias/new", {root_}, "output"), root_ + "/runs/new");
  absl::StatusOr<std::string> out = CanonicalInRoots(root_ + "/escape/x", {root_}, "output");
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(), HasSubstr("output: " + root_ + "/escape/x is outside"));
  EXPECT_THAT(CanonicalInRoots("runs/a", {root_}, "output").status().message(),
              HasSubstr("output: must be an absolute path"));
  EXPECT_TRUE(CanonicalInRoots(root_ + "/escape/x", {}, "output").ok()) << "no roots: anywhere";
  EXPECT_FALSE(IsInsideRoot(root_ + "-other/x", root_));
  EXPECT_TRUE(IsInsideRoot(root_, root_ + "/"));
}

TEST_F(AllowedRootsTest, PinningOpensBelowTheRootFollowingNoLink) {
  PinnedPaths pinned;
  absl::StatusOr<std::string> data =
      pinned.Pin(root_ + "/data.jsonl", {root_}, PinKind::kFile, "data.train");
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_THAT(*data, ::testing::StartsWith("/proc/self/fd/"));
  EXPECT_EQ(Slurp(*data), "{}\n");
  // A directory that does not exist yet is made, parents included.
  absl::StatusOr<std::string> out =
      pinned.Pin(root_ + "/runs/b/c", {root_}, PinKind::kCreateDirectory, "output");
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(fs::is_directory(root_ + "/runs/b/c"));
  EXPECT_EQ(pinned.Original("written to " + *out + "/adapter"),
            "written to " + root_ + "/runs/b/c/adapter");

  // A link anywhere below the root is refused, naming it, even one that stays inside.
  absl::StatusOr<std::string> linked =
      pinned.Pin(root_ + "/alias/a", {root_}, PinKind::kDirectory, "output");
  EXPECT_EQ(linked.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(linked.status().message(),
              HasSubstr("output: " + root_ + "/alias/a: " + root_ + "/alias is a symbolic link"));
  EXPECT_THAT(pinned.Pin(root_ + "/escape", {root_}, PinKind::kCreateDirectory, "output")
                  .status()
                  .message(),
              HasSubstr("is a symbolic link"));
  EXPECT_THAT(
      pinned.Pin(outside_.Path("x"), {root_}, PinKind::kFile, "data.train").status().message(),
      HasSubstr("is outside the allowed roots"));
  EXPECT_THAT(pinned.Pin(root_ + "/missing.jsonl", {root_}, PinKind::kFile, "data.train")
                  .status()
                  .message(),
              HasSubstr("data.train: " + root_ + "/missing.jsonl does not exist"));
  EXPECT_THAT(pinned.Pin(root_ + "/runs", {root_}, PinKind::kFile, "data.train").status().message(),
              HasSubstr("data.train: " + root_ + "/runs is not a regular file"));
  EXPECT_THAT(
      pinned.Pin(root_ + "/data.jsonl/x", {root_}, PinKind::kFile, "data.train").status().message(),
      HasSubstr(": " + root_ + "/data.jsonl is not a directory"));
}

// Issue #27's attack, after the check: the output directory is renamed away and a link out
// of the roots put in its place. What the trainer writes still lands in the directory it
// checked, and nothing outside the roots.
TEST_F(AllowedRootsTest, ALinkSwappedInAfterPinningIsNotFollowed) {
  PinnedPaths pinned;
  absl::StatusOr<std::string> out =
      pinned.Pin(root_ + "/runs/job", {root_}, PinKind::kCreateDirectory, "output");
  ASSERT_TRUE(out.ok()) << out.status();
  fs::rename(root_ + "/runs/job", root_ + "/runs/moved");
  fs::create_symlink(outside_.path(), root_ + "/runs/job");
  fs::create_directories(*out + "/adapter");
  std::ofstream(*out + "/adapter/weights") << "w";
  EXPECT_EQ(Slurp(root_ + "/runs/moved/adapter/weights"), "w");
  EXPECT_TRUE(fs::is_empty(outside_.path())) << "written outside the roots";
}

}  // namespace
}  // namespace lathe
