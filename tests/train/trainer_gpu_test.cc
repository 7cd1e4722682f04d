// The engine's numerical tests on CUDA (label gpu). They skip where libtorch has no CUDA or
// sees no GPU, as on CI; docs/training.md says what to run on a GPU machine.
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "common/file_util.h"
#include "gtest/gtest.h"
#include "tests/testing/default_plan.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tiny_job.h"
#include "tests/testing/tiny_model.h"
#include "worker/engine/causal_lm.h"
#include "worker/engine/memory_tracker.h"
#include "worker/train/trainer.h"

namespace lathe {
namespace {

using testing::TempDir;

class TrainerGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA: this libtorch has none or sees no GPU";
    spec_ = testing::TinyLoraJob(dir_, testing::TinyModelConfig(), DType::kBF16);
    spec_.train.steps = 6;
  }

  std::vector<StepReport> Reports(JobSpec spec, const std::string& output) {
    spec.output = dir_.Path(output);
    absl::StatusOr<std::unique_ptr<Trainer>> trainer =
        Trainer::Create(spec, testing::DefaultPlan(spec), {1});
    EXPECT_TRUE(trainer.ok()) << trainer.status();
    if (!trainer.ok()) return {};
    std::vector<StepReport> reports;
    absl::Status run = (*trainer)->Run([&](const StepReport& r) { reports.push_back(r); }).status();
    EXPECT_TRUE(run.ok()) << run;
    return reports;
  }

  TempDir dir_;
  JobSpec spec_;
};

TEST_F(TrainerGpuTest, Bf16OnCudaTracksTheCpuRun) {
  std::vector<StepReport> cpu = Reports(spec_, "cpu");
  JobSpec gpu_spec = spec_;
  gpu_spec.resources.device = DeviceKind::kCuda;
  gpu_spec.train.precision = Precision::kBf16;
  std::vector<StepReport> gpu = Reports(gpu_spec, "gpu");
  ASSERT_EQ(cpu.size(), gpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) {
    // bf16 activations: a few parts in a hundred, not more.
    EXPECT_NEAR(*gpu[i].loss, *cpu[i].loss, 0.05 * *cpu[i].loss) << "step " << i + 1;
    EXPECT_GT(gpu[i].peak_bytes, 0);
    EXPECT_GT(gpu[i].memory_at_peak[static_cast<int>(MemoryComponent::kActivations)], 0);
  }
  EXPECT_TRUE(std::filesystem::exists(dir_.Path("gpu/adapter/adapter_model.safetensors")));
}

TEST_F(TrainerGpuTest, CheckpointingOnCudaKeepsTheLosses) {
  JobSpec spec = spec_;
  spec.resources.device = DeviceKind::kCuda;
  spec.train.precision = Precision::kBf16;
  std::vector<StepReport> plain = Reports(spec, "plain");
  testing::FixStrategy(&spec.strategy);
  spec.strategy.activation_checkpointing = true;
  std::vector<StepReport> recomputed = Reports(spec, "recomputed");
  ASSERT_EQ(plain.size(), recomputed.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_NEAR(*plain[i].loss, *recomputed[i].loss, 1e-3 * *plain[i].loss) << i + 1;
    EXPECT_LT(recomputed[i].memory_at_peak[static_cast<int>(MemoryComponent::kActivations)],
              plain[i].memory_at_peak[static_cast<int>(MemoryComponent::kActivations)]);
  }
}

// Each optimizer with its state paged from pinned host memory trains exactly as with its
// state on the device, and reports no optimizer bytes on the device.
TEST_F(TrainerGpuTest, PagedOptimizerStateTrainsAsOnTheDevice) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdamW8bit,
                             OptimizerKind::kAdafactor, OptimizerKind::kSgd}) {
    SCOPED_TRACE(std::string(OptimizerKindName(kind)));
    JobSpec spec = spec_;
    spec.resources.device = DeviceKind::kCuda;
    spec.train.precision = Precision::kBf16;
    spec.train.optimizer = kind;
    spec.train.sgd_momentum = 0.9;
    const std::string name(OptimizerKindName(kind));
    std::vector<StepReport> resident = Reports(spec, name + "-resident");
    spec.train.paged_optimizer = true;
    std::vector<StepReport> paged = Reports(spec, name + "-paged");
    ASSERT_EQ(resident.size(), paged.size());
    for (size_t i = 0; i < paged.size(); ++i) {
      EXPECT_EQ(*paged[i].loss, *resident[i].loss) << i + 1;
      EXPECT_EQ(paged[i].memory_at_peak[static_cast<int>(MemoryComponent::kOptimizer)], 0);
    }
  }
}

// Profiling a CUDA step (worker/train/profiler.h): the trace holds the engine's scopes and
// the GPU's kernels; the memory timeline, from the caching allocator's history, peaks at the
// step's reported peak.
TEST_F(TrainerGpuTest, ProfilesCudaStepsWithTheAllocatorsHistory) {
  JobSpec spec = spec_;
  spec.resources.device = DeviceKind::kCuda;
  spec.train.precision = Precision::kBf16;
  spec.output = dir_.Path("profiled");
  TrainerOptions options;
  options.threads = 1;
  options.profile.dir = dir_.Path("profile");
  options.profile.initial = ProfileRequest{"gpu", 2, true};
  std::vector<ProfileOutcome> outcomes;
  options.profile.on_profile = [&](const ProfileOutcome& o) { outcomes.push_back(o); };
  absl::StatusOr<std::unique_ptr<Trainer>> trainer =
      Trainer::Create(spec, testing::DefaultPlan(spec), options);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  std::vector<StepReport> reports;
  absl::Status run = (*trainer)->Run([&](const StepReport& r) { reports.push_back(r); }).status();
  ASSERT_TRUE(run.ok()) << run;
  ASSERT_EQ(outcomes.size(), 1u);
  EXPECT_EQ(outcomes[0].error, "");
  EXPECT_EQ(outcomes[0].first_step, 1);
  EXPECT_EQ(outcomes[0].last_step, 2);
  ASSERT_EQ(outcomes[0].files.size(), 2u);

  absl::StatusOr<std::string> text = ReadFile(dir_.Path("profile/gpu/rank-0.trace.json"));
  ASSERT_TRUE(text.ok()) << text.status();
  const nlohmann::json trace = nlohmann::json::parse(*text, nullptr, false);
  ASSERT_TRUE(trace.is_object() && trace["traceEvents"].is_array());
  std::set<std::string> names;
  bool kernels = false;
  for (const nlohmann::json& event : trace["traceEvents"]) {
    names.insert(event.value("name", ""));
    kernels = kernels || event.value("cat", "") == "kernel";
  }
  for (const char* scope :
       {"step.1", "step.2", "forward/block.0", "loss", "backward", "optimizer"}) {
    EXPECT_EQ(names.count(scope), 1u) << "no slice named " << scope;
  }
  EXPECT_TRUE(kernels) << "no CUDA kernel in the trace";

  text = ReadFile(dir_.Path("profile/gpu/rank-0.memory.json"));
  ASSERT_TRUE(text.ok()) << text.status();
  const nlohmann::json memory = nlohmann::json::parse(*text, nullptr, false);
  ASSERT_TRUE(memory.is_object());
  EXPECT_EQ(memory["source"], "CUDA caching allocator history");
  ASSERT_GE(reports.size(), 2u);
  const int64_t reported = std::max(reports[0].peak_bytes, reports[1].peak_bytes);
  EXPECT_NEAR(memory["peak"]["bytes"].get<double>(), static_cast<double>(reported),
              0.01 * reported);
  EXPECT_GT(memory["events"].size(), 0u);
}

}  // namespace
}  // namespace lathe
