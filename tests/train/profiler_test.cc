// Profiling a running trainer on request (worker/train/profiler.h): the Kineto trace holds
// every engine scope, the memory timeline's peak is the step's reported peak, and a bad or
// late request is answered without stopping training.
#include "worker/train/profiler.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/default_plan.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tiny_job.h"
#include "tests/testing/tiny_model.h"
#include "worker/engine/memory_tracker.h"
#include "worker/train/trainer.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

// A request file as the test writes it: "capture_id steps memory(0|1)". The trainer library
// takes the parser from its caller (lathe-worker parses protobuf JSON).
absl::StatusOr<ProfileRequest> ParseTestRequest(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, ' ');
  ProfileRequest request;
  int memory = 0;
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[1], &request.steps) ||
      !absl::SimpleAtoi(parts[2], &memory)) {
    return absl::InvalidArgumentError("request.json: not a profile request");
  }
  request.capture_id = parts[0];
  request.memory = memory != 0;
  return request;
}

nlohmann::json ReadJson(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  EXPECT_TRUE(text.ok()) << text.status();
  if (!text.ok()) return nullptr;
  nlohmann::json json = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(json.is_discarded()) << path << " is not JSON";
  return json;
}

class ProfilerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = testing::TinyModelConfig();
    spec_ = testing::TinyLoraJob(dir_, config_);
    testing::FixStrategy(&spec_.strategy);
  }

  std::string ProfileDir() const { return dir_.Path("profile"); }
  void Request(const std::string& text) const {
    std::filesystem::create_directories(ProfileDir());
    dir_.Write("profile/request.json", text);
  }

  // Trains `spec` with profiling on; `after_step` runs after each step's report.
  absl::StatusOr<TrainResult> Train(
      const JobSpec& spec, std::optional<ProfileRequest> initial = std::nullopt,
      const std::function<void(const StepReport&)>& after_step = [](const StepReport&) {}) {
    TrainerOptions options;
    options.threads = 1;
    options.peak_flops = 1e9;
    options.profile.dir = ProfileDir();
    options.profile.parse = ParseTestRequest;
    options.profile.initial = std::move(initial);
    options.profile.on_profile = [this](const ProfileOutcome& o) { outcomes_.push_back(o); };
    absl::StatusOr<std::unique_ptr<Trainer>> trainer =
        Trainer::Create(spec, testing::DefaultPlan(spec), options);
    if (!trainer.ok()) return trainer.status();
    return (*trainer)->Run([&](const StepReport& r) {
      reports_.push_back(r);
      after_step(r);
    });
  }

  TempDir dir_;
  ModelConfig config_;
  JobSpec spec_;
  std::vector<ProfileOutcome> outcomes_;
  std::vector<StepReport> reports_;
};

// The scope names of a Chrome trace's complete events, and the name of the process that has
// the "step.N" slices.
std::set<std::string> SliceNames(const nlohmann::json& trace) {
  std::set<std::string> names;
  for (const nlohmann::json& event : trace["traceEvents"]) {
    if (event.value("ph", "") == "X") names.insert(event.value("name", ""));
  }
  return names;
}

TEST_F(ProfilerTest, TraceHoldsEveryEngineScope) {
  // ZeRO-3 on one rank gathers and reduce-scatters each unit; a checkpoint every step.
  spec_.strategy.zero_stage = 3;
  spec_.train.checkpoint_every = 1;
  spec_.train.steps = 4;
  spec_.data.eval = spec_.data.train;
  spec_.train.eval_every = 2;  // inside the capture, at step 2
  Request("trace-1 2 0");
  absl::StatusOr<TrainResult> result = Train(spec_);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(reports_.size(), 4u);  // training went on after the capture

  ASSERT_EQ(outcomes_.size(), 1u);
  const ProfileOutcome& outcome = outcomes_[0];
  EXPECT_EQ(outcome.capture_id, "trace-1");
  EXPECT_EQ(outcome.first_step, 1);
  EXPECT_EQ(outcome.last_step, 2);
  EXPECT_EQ(outcome.error, "");
  const std::string trace_path = dir_.Path("profile/trace-1/rank-0.trace.json");
  EXPECT_THAT(outcome.files, ::testing::ElementsAre(trace_path));
  EXPECT_FALSE(std::filesystem::exists(dir_.Path("profile/request.json")));

  const nlohmann::json trace = ReadJson(trace_path);
  ASSERT_TRUE(trace.is_object());
  ASSERT_TRUE(trace["traceEvents"].is_array());
  const std::set<std::string> names = SliceNames(trace);
  for (const char* scope :
       {"step.1", "step.2", "data/batch", "data/collate", "forward", "forward/embeddings",
        "forward/block.0", "forward/block.1", "loss", "backward", "optimizer", "checkpoint/save",
        "eval", "comm/all_gather/unit.1", "comm/reduce_scatter/unit.1",
        "comm/all_reduce/grad_norm"}) {
    EXPECT_EQ(names.count(scope), 1u) << "no slice named " << scope;
  }
  EXPECT_EQ(names.count("step.3"), 0u) << "step 3 was not asked for";
  // libtorch's operators, inside the scopes.
  EXPECT_TRUE(std::any_of(names.begin(), names.end(),
                          [](const std::string& n) { return n.rfind("aten::", 0) == 0; }));
  // The process carries the rank.
  bool named = false;
  for (const nlohmann::json& event : trace["traceEvents"]) {
    if (event.value("ph", "") == "M" && event.value("name", "") == "process_name" &&
        event["args"].value("name", "") == "lathe rank 0") {
      named = true;
    }
  }
  EXPECT_TRUE(named);
}

// ZeRO-2: the reduce-scatter per unit during backward, then the updated slices gathered.
TEST_F(ProfilerTest, TraceHoldsTheShardedStepsCollectives) {
  spec_.strategy.zero_stage = 2;
  absl::StatusOr<TrainResult> result = Train(spec_, ProfileRequest{"zero2", 1, false});
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(outcomes_.size(), 1u);
  EXPECT_EQ(outcomes_[0].error, "");
  const nlohmann::json trace = ReadJson(dir_.Path("profile/zero2/rank-0.trace.json"));
  ASSERT_TRUE(trace.is_object());
  const std::set<std::string> names = SliceNames(trace);
  for (const char* scope :
       {"comm/reduce_scatter/unit.1", "comm/all_gather/params.1", "comm/all_reduce/grad_norm"}) {
    EXPECT_EQ(names.count(scope), 1u) << "no slice named " << scope;
  }
  EXPECT_EQ(names.count("comm/all_gather/unit.1"), 0u) << "ZeRO-2 keeps the whole parameters";
}

TEST_F(ProfilerTest, MemoryPeakIsTheStepsReportedPeak) {
  spec_.train.steps = 4;
  // Asked for after step 1: steps 2 and 3 are profiled.
  absl::StatusOr<TrainResult> result = Train(spec_, std::nullopt, [&](const StepReport& r) {
    if (r.step == 1) Request("mem 2 1");
  });
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(outcomes_.size(), 1u);
  const ProfileOutcome& outcome = outcomes_[0];
  EXPECT_EQ(outcome.error, "");
  EXPECT_EQ(outcome.first_step, 2);
  EXPECT_EQ(outcome.last_step, 3);
  const std::string memory_path = dir_.Path("profile/mem/rank-0.memory.json");
  EXPECT_THAT(outcome.files,
              ::testing::ElementsAre(dir_.Path("profile/mem/rank-0.trace.json"), memory_path));
  const nlohmann::json memory = ReadJson(memory_path);
  ASSERT_TRUE(memory.is_object());
  ASSERT_EQ(reports_.size(), 4u);
  const int64_t reported = std::max(reports_[1].peak_bytes, reports_[2].peak_bytes);
  const int64_t peak = memory["peak"]["bytes"].get<int64_t>();
  EXPECT_NEAR(static_cast<double>(peak), static_cast<double>(reported), 0.01 * reported);
  // Each step's peak, and what the peak was made of.
  ASSERT_EQ(memory["steps"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(memory["steps"][i]["step"].get<int64_t>(), i + 2);
    EXPECT_EQ(memory["steps"][i]["peak_bytes"].get<int64_t>(), reports_[i + 1].peak_bytes);
  }
  int64_t sum = 0;
  for (const auto& [component, bytes] : memory["peak"]["at_peak"].items()) {
    sum += bytes.get<int64_t>();
  }
  EXPECT_EQ(sum, peak);
  EXPECT_FALSE(memory["truncated"].get<bool>());
  EXPECT_EQ(memory["max_events"].get<int64_t>(), kMaxMemoryEvents);
  EXPECT_FALSE(memory["peak"]["scope"].get<std::string>().empty());
  // The largest blocks at the peak, largest first; the activations name their scope.
  const nlohmann::json& top = memory["peak"]["top_blocks"];
  ASSERT_TRUE(top.is_array());
  ASSERT_GT(top.size(), 0u);
  EXPECT_LE(top.size(), 10u);
  for (size_t i = 1; i < top.size(); ++i) {
    EXPECT_GE(top[i - 1]["bytes"].get<int64_t>(), top[i]["bytes"].get<int64_t>());
  }
  // The same record as the trace's counter track, within the trace's time span.
  const nlohmann::json trace = ReadJson(dir_.Path("profile/mem/rank-0.trace.json"));
  ASSERT_TRUE(trace.is_object());
  double first = 1e300, last = -1e300;
  int64_t counted_peak = 0;
  int64_t samples = 0;
  for (const nlohmann::json& event : trace["traceEvents"]) {
    if (event.value("ph", "") == "X" && event.value("name", "").rfind("step.", 0) == 0) {
      first = std::min(first, event["ts"].get<double>());
      last = std::max(last, event["ts"].get<double>() + event["dur"].get<double>());
    }
  }
  for (const nlohmann::json& event : trace["traceEvents"]) {
    if (event.value("ph", "") != "C" || event.value("name", "") != "memory (bytes)") continue;
    ++samples;
    int64_t sampled = 0;
    for (const auto& [component, bytes] : event["args"].items()) sampled += bytes.get<int64_t>();
    counted_peak = std::max(counted_peak, sampled);
    EXPECT_GE(event["ts"].get<double>(), first - 10000) << "10 ms before step 2";
    EXPECT_LE(event["ts"].get<double>(), last + 10000) << "10 ms after step 3";
  }
  EXPECT_GT(samples, 10);
  EXPECT_EQ(counted_peak, peak);
  // Every allocation and free of the two steps.
  const nlohmann::json& events = memory["events"];
  ASSERT_GT(events.size(), 10u);
  std::set<std::string> scopes;
  int64_t allocs = 0, frees = 0;
  for (const nlohmann::json& e : events) {
    scopes.insert(e["scope"].get<std::string>());
    (e["action"] == "alloc" ? allocs : frees) += 1;
  }
  EXPECT_GT(allocs, 0);
  EXPECT_GT(frees, 0);
  for (const char* scope : {"forward/block.0", "loss", "backward", "optimizer"}) {
    EXPECT_EQ(scopes.count(scope), 1u) << "no allocation in " << scope;
  }
}

TEST_F(ProfilerTest, BadRequestsAreAnsweredAndTrainingGoesOn) {
  spec_.train.steps = 6;
  std::filesystem::create_directories(dir_.Path("profile/taken"));
  dir_.Write("profile/taken/rank-0.trace.json", "{}");
  absl::StatusOr<TrainResult> result = Train(spec_, std::nullopt, [&](const StepReport& r) {
    switch (r.step) {
      case 1:
        Request("garbage");
        break;
      case 2:
        Request("../escape 2 0");
        break;
      case 3:
        Request("zero 0 0");
        break;
      case 4:
        Request("many 1000 0");
        break;
      case 5:
        Request("taken 1 0");  // this rank's files are there already
        break;
    }
  });
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(reports_.size(), 6u);
  ASSERT_EQ(outcomes_.size(), 5u);
  EXPECT_THAT(outcomes_[0].error, HasSubstr("not a profile request"));
  EXPECT_THAT(outcomes_[1].error, HasSubstr("capture_id"));
  EXPECT_THAT(outcomes_[2].error, HasSubstr("steps: 0"));
  EXPECT_THAT(outcomes_[3].error, HasSubstr("steps: 1000"));
  EXPECT_THAT(outcomes_[4].error, HasSubstr("rank-0.trace.json exists already"));
  for (const ProfileOutcome& o : outcomes_) {
    EXPECT_TRUE(o.files.empty());
    EXPECT_EQ(o.first_step, 0);
  }
  EXPECT_FALSE(std::filesystem::exists(dir_.Path("escape")));
}

TEST_F(ProfilerTest, TrainingEndingFirstClosesTheCaptureWithWhatItHas) {
  spec_.train.steps = 3;
  absl::StatusOr<TrainResult> result = Train(spec_, std::nullopt, [&](const StepReport& r) {
    if (r.step == 1) Request("long 5 1");
    if (r.step == 3) Request("late 1 0");  // no step left to profile
  });
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(outcomes_.size(), 2u);
  EXPECT_EQ(outcomes_[0].capture_id, "long");
  EXPECT_EQ(outcomes_[0].first_step, 2);
  EXPECT_EQ(outcomes_[0].last_step, 3);
  EXPECT_EQ(outcomes_[0].files.size(), 2u);
  EXPECT_THAT(outcomes_[0].error, HasSubstr("training finished after step 3, before step 6"));
  EXPECT_EQ(outcomes_[1].capture_id, "late");
  EXPECT_THAT(outcomes_[1].error, HasSubstr("before the capture could start"));
  const nlohmann::json memory = ReadJson(dir_.Path("profile/long/rank-0.memory.json"));
  ASSERT_TRUE(memory.is_object());
  EXPECT_EQ(memory["steps"].size(), 2u);
}

// --profile-steps: a request to start with, without a file.
TEST_F(ProfilerTest, AnInitialRequestProfilesTheFirstSteps) {
  absl::StatusOr<TrainResult> result = Train(spec_, ProfileRequest{"first", 1, false});
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(outcomes_.size(), 1u);
  EXPECT_EQ(outcomes_[0].first_step, 1);
  EXPECT_EQ(outcomes_[0].last_step, 1);
  EXPECT_EQ(outcomes_[0].error, "");
  const nlohmann::json trace = ReadJson(dir_.Path("profile/first/rank-0.trace.json"));
  ASSERT_TRUE(trace.is_object());
  EXPECT_EQ(SliceNames(trace).count("step.1"), 1u);
}

TEST(ProfileRequestTest, ChecksTheCaptureIdAndTheSteps) {
  EXPECT_TRUE(CheckProfileRequest({"a-Z_09", 1, false}).ok());
  EXPECT_TRUE(CheckProfileRequest({std::string(64, 'x'), kMaxProfileSteps, true}).ok());
  EXPECT_FALSE(CheckProfileRequest({"", 1, false}).ok());
  EXPECT_FALSE(CheckProfileRequest({std::string(65, 'x'), 1, false}).ok());
  EXPECT_FALSE(CheckProfileRequest({"a/b", 1, false}).ok());
  EXPECT_FALSE(CheckProfileRequest({"..", 1, false}).ok());
  EXPECT_FALSE(CheckProfileRequest({"ok", 0, false}).ok());
  EXPECT_FALSE(CheckProfileRequest({"ok", kMaxProfileSteps + 1, false}).ok());
}

}  // namespace
}  // namespace lathe
