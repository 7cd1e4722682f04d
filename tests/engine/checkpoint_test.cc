#include "worker/engine/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace lathe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

class CheckpointStoreTest : public ::testing::Test {
 protected:
  TrainingState State(int64_t step) {
    TrainingState state;
    state.step = step;
    state.optimizer_steps = step - 1;
    state.cursor = {2, 5, 7};
    state.rng_state = std::string("\0\1\2rng", 6);
    state.last_loss = 1.5 + step;
    state.loss_scale = {8192.0, 17};
    state.skipped_steps = 4;
    state.consecutive_nonfinite = 2;
    state.spec_fingerprint = "abc";
    return state;
  }

  absl::Status Save(CheckpointStore& store, int64_t step) {
    float values[3] = {1.0f * step, 2.0f, 3.0f};
    TensorToWrite trainable{"w", DType::kF32, {3}, values, sizeof(values)};
    TensorToWrite moment{"exp_avg.w", DType::kF32, {3}, values, sizeof(values)};
    return store.Save(State(step), {&trainable, 1}, {&moment, 1});
  }

  std::string StepDir(int64_t step) {
    char name[32];
    std::snprintf(name, sizeof(name), "step-%08ld", static_cast<long>(step));
    return dir_.Path(std::string("ckpt/") + name);
  }

  testing::TempDir dir_;
};

TEST_F(CheckpointStoreTest, RoundTripsTheNewestAndKeepsOnlyK) {
  CheckpointStore store(dir_.Path("ckpt"), 2);
  for (int64_t step : {10, 20, 30}) ASSERT_TRUE(Save(store, step).ok());
  EXPECT_FALSE(fs::exists(StepDir(10)));
  EXPECT_TRUE(fs::exists(StepDir(20)));
  std::vector<std::string> rejected;
  absl::StatusOr<std::optional<LoadedCheckpoint>> loaded = store.LoadNewest(&rejected);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_TRUE(loaded->has_value());
  const TrainingState& state = (*loaded)->state;
  EXPECT_EQ(state.step, 30);
  EXPECT_EQ(state.optimizer_steps, 29);
  EXPECT_EQ(state.cursor.epoch, 2);
  EXPECT_EQ(state.cursor.next_document, 5);
  EXPECT_EQ(state.cursor.offset_in_document, 7);
  EXPECT_EQ(state.rng_state, std::string("\0\1\2rng", 6));
  EXPECT_DOUBLE_EQ(*state.last_loss, 31.5);
  EXPECT_EQ(state.loss_scale.scale, 8192.0);
  EXPECT_EQ(state.loss_scale.clean_steps, 17);
  EXPECT_EQ(state.skipped_steps, 4);
  EXPECT_EQ(state.consecutive_nonfinite, 2);
  EXPECT_EQ(state.spec_fingerprint, "abc");
  const TensorView* w = (*loaded)->trainable->Find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(reinterpret_cast<const float*>(w->data)[0], 30.0f);
  EXPECT_TRUE(rejected.empty());
}

TEST_F(CheckpointStoreTest, AnEmptyDirectoryHasNoCheckpoint) {
  CheckpointStore store(dir_.Path("none"), 3);
  absl::StatusOr<std::optional<LoadedCheckpoint>> loaded = store.LoadNewest(nullptr);
  ASSERT_TRUE(loaded.ok());
  EXPECT_FALSE(loaded->has_value());
}

TEST_F(CheckpointStoreTest, FallsBackFromACorruptedNewestCheckpoint) {
  struct Case {
    std::string name;
    std::function<void(const std::string&)> corrupt;
    std::string reason;
  } cases[] = {
      {"truncated file",
       [](const std::string& d) {
         fs::resize_file(d + "/trainable.safetensors",
                         fs::file_size(d + "/trainable.safetensors") - 4);
       },
       "trainable.safetensors: "},
      {"flipped byte",
       [](const std::string& d) {
         std::fstream f(d + "/optimizer.safetensors",
                        std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(-1, std::ios::end);
         f.put('\x7f');
       },
       "optimizer.safetensors: SHA-256 mismatch"},
      {"missing manifest", [](const std::string& d) { fs::remove(d + "/manifest.json"); },
       "no manifest"},
  };
  for (const Case& c : cases) {
    testing::TempDir dir;
    CheckpointStore store(dir.Path("ckpt"), 3);
    ASSERT_TRUE(Save(store, 10).ok());
    ASSERT_TRUE(Save(store, 20).ok());
    c.corrupt(dir.Path("ckpt/step-00000020"));
    std::vector<std::string> rejected;
    absl::StatusOr<std::optional<LoadedCheckpoint>> loaded = store.LoadNewest(&rejected);
    ASSERT_TRUE(loaded.ok()) << c.name;
    ASSERT_TRUE(loaded->has_value()) << c.name;
    EXPECT_EQ((*loaded)->state.step, 10) << c.name;
    ASSERT_EQ(rejected.size(), 1u) << c.name;
    EXPECT_THAT(rejected[0], HasSubstr("step-00000020: " + c.reason)) << c.name;
  }
}

TEST_F(CheckpointStoreTest, InterruptedSavesLeaveNoTrace) {
  CheckpointStore store(dir_.Path("ckpt"), 3);
  fs::create_directories(dir_.Path("ckpt/.tmp-step-00000005-1"));
  ASSERT_TRUE(Save(store, 10).ok());
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir_.Path("ckpt"))) {
    names.push_back(entry.path().filename().string());
  }
  EXPECT_THAT(names, ElementsAre("step-00000010"));
}

TEST_F(CheckpointStoreTest, ShardFilesOfSeveralRanksAreCommittedAndVerifiedTogether) {
  CheckpointStore store(dir_.Path("ckpt"), 3);
  ASSERT_TRUE(store.Prepare(10).ok());
  for (int rank = 0; rank < 2; ++rank) {  // what each rank writes
    float values[2] = {1.0f * rank, 2.0f};
    TensorToWrite slice{"unit.1.param", DType::kF32, {2}, values, sizeof(values)};
    ASSERT_TRUE(WriteSafetensors(store.TempDir(10) + "/" + ShardFileName(rank), {&slice, 1}).ok());
  }
  TrainingState state = State(10);
  state.shard_world = 2;
  ASSERT_TRUE(store.Commit(state).ok());
  absl::StatusOr<std::optional<LoadedCheckpoint>> loaded = store.LoadNewest(nullptr);
  ASSERT_TRUE(loaded.ok() && loaded->has_value()) << loaded.status();
  EXPECT_EQ((*loaded)->state.shard_world, 2);
  EXPECT_EQ((*loaded)->trainable, nullptr);
  ASSERT_EQ((*loaded)->files.size(), 2u);
  const TensorView* slice = (*loaded)->files.at("shard-00001.safetensors")->Find("unit.1.param");
  ASSERT_NE(slice, nullptr);
  EXPECT_EQ(reinterpret_cast<const float*>(slice->data)[0], 1.0f);

  // A rank's file that went missing, or changed, fails verification: the checkpoint is
  // skipped, never half-loaded.
  fs::remove(StepDir(10) + "/shard-00001.safetensors");
  std::vector<std::string> rejected;
  loaded = store.LoadNewest(&rejected);
  ASSERT_TRUE(loaded.ok());
  EXPECT_FALSE(loaded->has_value());
  ASSERT_EQ(rejected.size(), 1u);
  EXPECT_THAT(rejected[0], HasSubstr("shard-00001.safetensors: missing"));
}

// A zombie: attempt 1 paused past its end while attempt 2 took over. Everything attempt 1
// writes afterwards is refused and changes nothing.
TEST_F(CheckpointStoreTest, AStaleAttemptCannotCommitPruneOrExport) {
  const std::string dir = dir_.Path("ckpt");
  CheckpointStore first(dir, 2, {"job-1", 1});
  ASSERT_TRUE(first.Claim().ok());
  ASSERT_TRUE(Save(first, 10).ok());

  CheckpointStore second(dir, 2, {"job-1", 2});
  ASSERT_TRUE(second.Claim().ok());
  ASSERT_TRUE(Save(second, 20).ok());

  for (int64_t step : {30, 40, 50}) {  // enough saves to prune attempt 2's checkpoints
    absl::Status stale = Save(first, step);
    EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition) << stale;
    EXPECT_THAT(std::string(stale.message()),
                HasSubstr("job job-1 attempt 2 has taken over; job job-1 attempt 1"));
  }
  bool ran = false;
  EXPECT_EQ(first
                .Fenced([&] {
                  ran = true;
                  return absl::OkStatus();
                })
                .code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(ran);
  // Nor can it claim the directory back.
  EXPECT_EQ(first.Claim().code(), absl::StatusCode::kFailedPrecondition);

  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_THAT(names, ElementsAre(".fence", "step-00000010", "step-00000020"));
  absl::StatusOr<std::optional<LoadedCheckpoint>> loaded = second.LoadNewest(nullptr);
  ASSERT_TRUE(loaded.ok() && loaded->has_value());
  EXPECT_EQ((*loaded)->state.step, 20);

  // The current attempt goes on, and a new job may take the directory over.
  ASSERT_TRUE(Save(second, 30).ok());
  CheckpointStore other_job(dir, 2, {"job-2", 1});
  ASSERT_TRUE(other_job.Claim().ok());
  EXPECT_EQ(Save(second, 40).code(), absl::StatusCode::kFailedPrecondition);
}

// A save that passed its fence check just before the takeover and landed after it (its
// writer was paused in between): loaders skip it and the next pruning removes it.
TEST_F(CheckpointStoreTest, ALateCommitOfAStaleAttemptIsSkippedAndPruned) {
  const std::string dir = dir_.Path("ckpt");
  CheckpointStore first(dir, 3, {"job-1", 1});
  ASSERT_TRUE(first.Claim().ok());
  ASSERT_TRUE(Save(first, 10).ok());
  CheckpointStore second(dir, 3, {"job-1", 2});
  ASSERT_TRUE(second.Claim().ok());  // claims with step 10 the newest
  // Attempt 1's step 30, written before the takeover, renamed into place after it.
  CheckpointStore elsewhere(dir_.Path("elsewhere"), 3, {"job-1", 1});
  ASSERT_TRUE(elsewhere.Claim().ok());
  ASSERT_TRUE(Save(elsewhere, 30).ok());
  fs::rename(dir_.Path("elsewhere/step-00000030"), StepDir(30));

  std::vector<std::string> rejected;
  absl::StatusOr<std::optional<LoadedCheckpoint>> loaded = second.LoadNewest(&rejected);
  ASSERT_TRUE(loaded.ok() && loaded->has_value());
  EXPECT_EQ((*loaded)->state.step, 10);
  EXPECT_EQ((*loaded)->state.writer.generation, 1);
  EXPECT_THAT(rejected, ElementsAre("step-00000030: committed by job job-1 attempt 1 after a "
                                    "later attempt took over"));
  ASSERT_TRUE(Save(second, 20).ok());
  EXPECT_FALSE(fs::exists(StepDir(30)));
  EXPECT_TRUE(fs::exists(StepDir(10)));
}

TEST(CheckpointManifestTest, RefusesWhatIsNotAManifestWithoutThrowing) {
  const char* bad[] = {
      "",
      "[]",
      R"({"files": 3})",
      R"({"files": {"state.json": {"size": "12", "sha256": "ab"}}})",
      R"({"files": {"state.json": {"size": -1, "sha256": "ab"}}})",
      R"({"files": {"state.json": {"size": 1, "sha256": 5}}})",
      R"({"files": {"../x": {"size": 1, "sha256": "ab"}}})",
      R"({"files": {"a.safetensors": {"size": 1, "sha256": "ab"}}})",
  };
  for (const char* text : bad) {
    EXPECT_EQ(ParseCheckpointManifest(text).status().code(), absl::StatusCode::kDataLoss) << text;
  }
  absl::StatusOr<std::map<std::string, ManifestEntry>> ok =
      ParseCheckpointManifest(R"({"files": {"state.json": {"size": 7, "sha256": "ab"}}})");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->at("state.json").size, 7u);
  for (const char* text :
       {R"({"format": "1"})", R"({"format": 1, "step": "x"})", R"({"format": 1, "loss_scale": 3})",
        // found by fuzz/checkpoint_fuzzer: 1e300 overflowed the conversion
        R"({"format":1,"step":1e300,"optimizer_steps":1,"cursor":{"epoch":0,)"
        R"("next_document":0,"offset_in_document":0},"rng_state":"",)"
        R"("spec_fingerprint":""})",
        R"({"format":1,"step":18446744073709551615,"optimizer_steps":1})"}) {
    EXPECT_EQ(ParseTrainingState(text, "s.json").status().code(), absl::StatusCode::kDataLoss)
        << text;
  }
}

}  // namespace
}  // namespace lathe
