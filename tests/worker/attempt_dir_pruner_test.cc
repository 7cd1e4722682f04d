#include "worker/agent/attempt_dir_pruner.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <filesystem>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace lathe {
namespace {

namespace fs = std::filesystem;
using ::lathe::testing::TempDir;

bool NotInUse(const std::string&) { return false; }
bool Released() { return true; }

class AttemptDirPrunerTest : public ::testing::Test {
 protected:
  AttemptDirPrunerTest() : work_(dir_.Path("work")) { fs::create_directories(work_); }

  // An attempt folder as the agent leaves it; returns its path.
  std::string MakeAttemptDir(const std::string& name) {
    const std::string path = work_ + "/" + name;
    fs::create_directories(path);
    dir_.Write("work/" + name + "/task.json", "{}");
    dir_.Write("work/" + name + "/trainer.log", "step 1\n");
    dir_.Write("work/" + name + "/events.jsonl", "{}\n");
    return path;
  }

  // Sets the modification time of `path` (not following a link) and, for a folder, of what
  // is directly in it.
  static void SetModified(const std::string& path, absl::Time when) {
    if (fs::is_directory(fs::symlink_status(path))) {
      for (const fs::directory_entry& entry : fs::directory_iterator(path)) {
        SetModified(entry.path().string(), when);
      }
    }
    const timespec t = absl::ToTimespec(when);
    const timespec times[2] = {t, t};
    ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), times, AT_SYMLINK_NOFOLLOW), 0) << path;
  }

  static bool Exists(const std::string& path) { return fs::exists(fs::symlink_status(path)); }

  TempDir dir_;
  const std::string work_;
};

TEST_F(AttemptDirPrunerTest, KnowsTheAttemptFolderNames) {
  EXPECT_EQ(AttemptDirPruner::DirName("job-1", 3, 0), "job-1-g3-r0");
  for (const char* name : {"job-1-g3-r0", "a-g0-r12", "j.b_c-g1-r0-g2-r3"}) {
    EXPECT_TRUE(AttemptDirPruner::IsAttemptDirName(name)) << name;
  }
  for (const char* name :
       {"", "job-1", "job-1-g3", "job-1-r0", "-g1-r0", "..-g1-r0", ".-g1-r0", "job-g-r0",
        "job-g1-r", "job-g1-r0x", "job-g-1-r0", "a/b-g1-r0", "job-g1-r0/", "notes", "job-g1-r 0"}) {
    EXPECT_FALSE(AttemptDirPruner::IsAttemptDirName(name)) << name;
  }
}

TEST_F(AttemptDirPrunerTest, RemovesAFinishedAttemptAfterTheRetention) {
  FakeClock clock;
  AttemptDirPruner pruner(work_, absl::Hours(24), &clock);
  const std::string path = MakeAttemptDir("job-1-g2-r0");
  pruner.Ended("job-1-g2-r0", Released);
  EXPECT_EQ(pruner.Prune(NotInUse), 0);
  clock.Advance(absl::Hours(24) - absl::Seconds(1));
  EXPECT_EQ(pruner.Prune(NotInUse), 0);
  EXPECT_TRUE(Exists(path));
  clock.Advance(absl::Seconds(1));
  EXPECT_EQ(pruner.Prune(NotInUse), 1);
  EXPECT_FALSE(Exists(path));
  EXPECT_EQ(pruner.tracked(), 0u);
  EXPECT_TRUE(Exists(work_));
}

TEST_F(AttemptDirPrunerTest, ZeroRetentionRemovesAtTheFirstPrune) {
  FakeClock clock;
  AttemptDirPruner pruner(work_, absl::ZeroDuration(), &clock);
  const std::string path = MakeAttemptDir("job-1-g1-r1");
  const std::string other = MakeAttemptDir("job-1-g1-r0");  // not ended
  pruner.Ended("job-1-g1-r1", Released);
  EXPECT_EQ(pruner.Prune(NotInUse), 1);
  EXPECT_FALSE(Exists(path));
  EXPECT_TRUE(Exists(other));
}

TEST_F(AttemptDirPrunerTest, RetentionStartsOnceTheLogIsShipped) {
  FakeClock clock;
  AttemptDirPruner pruner(work_, absl::Hours(1), &clock);
  const std::string path = MakeAttemptDir("job-1-g1-r0");
  bool shipped = false;
  pruner.Ended("job-1-g1-r0", [&shipped] { return shipped; });
  clock.Advance(absl::Hours(5));
  EXPECT_EQ(pruner.Prune(NotInUse), 0);
  EXPECT_TRUE(Exists(path));
  shipped = true;
  EXPECT_EQ(pruner.Prune(NotInUse), 0);  // the hour starts now
  clock.Advance(absl::Minutes(59));
  EXPECT_EQ(pruner.Prune(NotInUse), 0);
  EXPECT_TRUE(Exists(path));
  clock.Advance(absl::Minutes(1));
  EXPECT_EQ(pruner.Prune(NotInUse), 1);
  EXPECT_FALSE(Exists(path));
}

TEST_F(AttemptDirPrunerTest, KeepsTheFolderOfARankInUse) {
  FakeClock clock;
  AttemptDirPruner pruner(work_, absl::ZeroDuration(), &clock);
  const std::string path = MakeAttemptDir("job-1-g1-r0");
  pruner.Ended("job-1-g1-r0", Released);
  bool running = true;
  auto in_use = [&running](const std::string& name) { return running && name == "job-1-g1-r0"; };
  clock.Advance(absl::Hours(48));
  EXPECT_EQ(pruner.Prune(in_use), 0);
  EXPECT_TRUE(Exists(path));
  EXPECT_EQ(pruner.tracked(), 1u);
  running = false;
  EXPECT_EQ(pruner.Prune(in_use), 1);
  EXPECT_FALSE(Exists(path));
}

TEST_F(AttemptDirPrunerTest, LeavesLinksFilesAndForeignFoldersAlone) {
  FakeClock clock(absl::Now() + absl::Hours(24 * 365));
  AttemptDirPruner pruner(work_, absl::ZeroDuration(), &clock);
  // A link named like an attempt folder, to a folder outside the work dir.
  fs::create_directories(dir_.Path("outside"));
  const std::string precious = dir_.Write("outside/precious", "keep me");
  fs::create_directory_symlink(dir_.Path("outside"), work_ + "/job-9-g1-r0");
  // A file named like one, and folders that are not attempt folders.
  const std::string file = dir_.Write("work/job-8-g1-r0", "a file");
  fs::create_directories(work_ + "/notes");
  dir_.Write("work/notes/todo", "x");
  fs::create_directories(work_ + "/job-7-g1");
  pruner.Ended("job-9-g1-r0", Released);
  pruner.Ended("job-8-g1-r0", Released);
  pruner.Ended("../outside", Released);
  EXPECT_EQ(pruner.tracked(), 2u);
  EXPECT_EQ(pruner.Prune(NotInUse), 0);
  EXPECT_EQ(pruner.SweepLeftovers(NotInUse), 0);
  EXPECT_TRUE(Exists(work_ + "/job-9-g1-r0"));
  EXPECT_TRUE(Exists(precious));
  EXPECT_TRUE(Exists(file));
  EXPECT_TRUE(Exists(work_ + "/notes/todo"));
  EXPECT_TRUE(Exists(work_ + "/job-7-g1"));
}

TEST_F(AttemptDirPrunerTest, SweepsOldLeftoversAtStart) {
  const absl::Time now = absl::Now();
  FakeClock clock(now);
  AttemptDirPruner pruner(work_, absl::Hours(24), &clock);
  const std::string old_dir = MakeAttemptDir("job-1-g1-r0");
  SetModified(old_dir, now - absl::Hours(25));
  const std::string recent = MakeAttemptDir("job-2-g1-r0");
  SetModified(recent, now - absl::Hours(23));
  // An old folder whose log was still written recently.
  const std::string recent_log = MakeAttemptDir("job-3-g1-r0");
  SetModified(recent_log, now - absl::Hours(48));
  SetModified(recent_log + "/trainer.log", now - absl::Hours(1));
  // Old, but a slot holds that rank again.
  const std::string held = MakeAttemptDir("job-4-g1-r0");
  SetModified(held, now - absl::Hours(48));
  // Old, but not an attempt folder.
  fs::create_directories(work_ + "/cache");
  SetModified(work_ + "/cache", now - absl::Hours(48));

  EXPECT_EQ(pruner.SweepLeftovers([](const std::string& name) { return name == "job-4-g1-r0"; }),
            1);
  EXPECT_FALSE(Exists(old_dir));
  EXPECT_TRUE(Exists(recent));
  EXPECT_TRUE(Exists(recent_log));
  EXPECT_TRUE(Exists(held));
  EXPECT_TRUE(Exists(work_ + "/cache"));

  clock.Advance(absl::Hours(1) + absl::Seconds(1));
  EXPECT_EQ(pruner.SweepLeftovers(NotInUse), 2);
  EXPECT_FALSE(Exists(recent));
  EXPECT_FALSE(Exists(held));
  EXPECT_TRUE(Exists(recent_log));
}

TEST_F(AttemptDirPrunerTest, SweepLeavesTrackedAttemptsToPrune) {
  const absl::Time now = absl::Now();
  FakeClock clock(now);
  AttemptDirPruner pruner(work_, absl::Hours(1), &clock);
  const std::string path = MakeAttemptDir("job-1-g1-r0");
  SetModified(path, now - absl::Hours(2));
  pruner.Ended("job-1-g1-r0", [] { return false; });  // its log is not shipped yet
  EXPECT_EQ(pruner.SweepLeftovers(NotInUse), 0);
  EXPECT_TRUE(Exists(path));
}

TEST_F(AttemptDirPrunerTest, AMissingWorkDirIsNoError) {
  FakeClock clock;
  AttemptDirPruner pruner(dir_.Path("nowhere"), absl::ZeroDuration(), &clock);
  EXPECT_EQ(pruner.SweepLeftovers(NotInUse), 0);
  pruner.Ended("job-1-g1-r0", Released);
  EXPECT_EQ(pruner.Prune(NotInUse), 0);
  EXPECT_EQ(pruner.tracked(), 0u);
}

}  // namespace
}  // namespace lathe
