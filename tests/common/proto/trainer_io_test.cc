// The task file and the event lines between an agent and its trainer (common/proto/trainer_io.h).
#include "common/proto/trainer_io.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "absl/status/status.h"
#include "google/protobuf/util/message_differencer.h"
#include "tests/testing/temp_dir.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(TrainerTaskTest, RoundTripsThroughItsFile) {
  testing::TempDir dir;
  v1::TrainerTask task;
  task.set_job_id("demo-1a2b3c");
  task.set_generation(3);
  task.set_rank(1);
  task.set_world_size(2);
  task.mutable_spec()->set_name("demo");
  task.mutable_spec()->mutable_train()->set_steps(10);
  task.mutable_plan()->mutable_strategy()->set_micro_batch(4);
  task.mutable_plan()->mutable_strategy()->set_activation_checkpointing(true);
  task.set_rendezvous_address("127.0.0.1:7070");
  task.set_peak_flops(1.5e12);
  const std::string path = dir.Path("task.json");
  ASSERT_TRUE(WriteTrainerTask(path, task).ok());
  absl::StatusOr<v1::TrainerTask> read = ReadTrainerTask(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*read, task))
      << read->DebugString();
}

TEST(TrainerTaskTest, BadFilesAreNamed) {
  testing::TempDir dir;
  EXPECT_EQ(ReadTrainerTask(dir.Path("missing.json")).status().code(), absl::StatusCode::kNotFound);
  const std::string bad = dir.Write("bad.json", R"({"job_id": "j", "rnak": 1})");
  absl::StatusOr<v1::TrainerTask> task = ReadTrainerTask(bad);
  EXPECT_EQ(task.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(task.status().message()), HasSubstr(bad + ": not a trainer task"));
}

TEST(TrainerEventTest, LinesRoundTripAndPrintZeroValues) {
  v1::TrainerEvent event;
  v1::TrainerStep* step = event.mutable_step();
  step->mutable_progress()->set_step(2);
  step->mutable_progress()->set_loss(2.5);
  step->mutable_progress()->mutable_memory()->set_weights(1 << 20);
  step->set_tokens(64);
  const std::string line = TrainerEventLine(event);
  EXPECT_THAT(line, Not(HasSubstr("\n")));
  EXPECT_THAT(line, HasSubstr(R"("skipped":false)"));  // zero values are there
  EXPECT_THAT(line, HasSubstr(R"("mfu":0)"));
  absl::StatusOr<v1::TrainerEvent> parsed = ParseTrainerEventLine(line);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*parsed, event));
}

TEST(TrainerEventTest, OtherOutputIsNotAnEvent) {
  for (const char* line :
       {"", "loading the model", "{}", "{\"step\": ", "[1, 2]", R"({"something": {"else": 1}})"}) {
    EXPECT_FALSE(ParseTrainerEventLine(line).ok()) << line;
  }
  // A field this agent does not know yet is passed over, the event kept.
  absl::StatusOr<v1::TrainerEvent> newer =
      ParseTrainerEventLine(R"({"done": {"steps": "4", "new_field": 1}})");
  ASSERT_TRUE(newer.ok()) << newer.status();
  EXPECT_EQ(newer->done().steps(), 4);
}

}  // namespace
}  // namespace lathe
