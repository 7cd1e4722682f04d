// The strategy search and the memory model's structure (coordinator/planner/planner.h,
// memory_model.h). The model's numbers against the engine are bench/planner_accuracy.py's.
#include "coordinator/planner/planner.h"

#include <string>

#include "common/file_util.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/source_path.h"
#include "tests/testing/status_matchers.h"

namespace lathe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::SourcePath;

constexpr uint64_t kGiB = uint64_t{1} << 30;

ModelShape Shape(const std::string& name) {
  const std::string path = SourcePath("tests/coordinator/data/configs/" + name + ".json");
  absl::StatusOr<std::string> text = ReadFile(path);
  EXPECT_TRUE(text.ok()) << text.status();
  absl::StatusOr<ModelShape> shape = ParseModelShape(*text, path);
  EXPECT_TRUE(shape.ok()) << shape.status();
  return *shape;
}

JobSpec Spec(const std::string& yaml) {
  absl::StatusOr<JobSpec> spec = ParseJobSpec(
      "name: t\nmodel: {path: /m}\ndata: {train: /d.jsonl, seq_len: 2048}\noutput: /o\n" + yaml +
          (yaml.find("train:") == std::string::npos ? "train: {steps: 10}\n" : ""),
      "spec.yaml");
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

PlanOptions Options(absl::string_view kind, uint64_t memory) {
  PlanOptions options;
  options.rates = *DefaultRates(kind);
  options.rates.memory_bytes = memory;
  return options;
}

JobShape Job(const ModelShape& shape, const JobSpec& spec) { return JobShapeOf(spec, shape); }

MemoryEstimate Estimate(const JobShape& job, const StrategyPoint& point) {
  absl::StatusOr<MemoryEstimate> m = EstimateMemory(job, point);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *m : MemoryEstimate();
}

PlanResult MustPlan(const JobSpec& spec, const ModelShape& shape, const PlanOptions& options) {
  absl::StatusOr<PlanResult> result = PlanJob(spec, shape, options);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *result : PlanResult();
}

uint64_t Component(const MemoryEstimate& m, MemoryComponent c) {
  return m.device.components[static_cast<int>(c)];
}

TEST(MemoryModelTest, ComponentsSumToTheTotal) {
  const JobShape job = Job(Shape("llama-3.1-8b"), Spec("resources: {ranks: 4, device: cuda}\n"));
  for (int64_t stage : {0, 1, 2, 3}) {
    for (bool ckpt : {false, true}) {
      MemoryEstimate m = Estimate(job, {stage, false, false, ckpt, true, true, 2});
      uint64_t sum = 0;
      for (uint64_t c : m.device.components) sum += c;
      EXPECT_EQ(sum, m.device.total) << "stage " << stage;
    }
  }
}

TEST(MemoryModelTest, EachTechniqueCutsWhatItShould) {
  const JobShape job = Job(Shape("llama-3.1-8b"), Spec("resources: {ranks: 8, device: cuda}\n"));
  const StrategyPoint plain{0, false, false, false, true, true, 4};
  MemoryEstimate base = Estimate(job, plain);
  StrategyPoint p = plain;
  p.activation_checkpointing = true;
  MemoryEstimate ckpt = Estimate(job, p);
  EXPECT_LT(ckpt.device.total, base.device.total);
  p = plain;
  p.zero_stage = 3;
  MemoryEstimate zero3 = Estimate(job, p);
  // LoRA's frozen base, sharded over 8 ranks: 16 GB of bf16 weights become 2 GB.
  EXPECT_LT(Component(zero3, MemoryComponent::kWeights),
            Component(base, MemoryComponent::kWeights) / 7);
  EXPECT_GT(Component(zero3, MemoryComponent::kCommBuffers), 0u);
  p = plain;
  p.micro_batch = 1;
  MemoryEstimate small = Estimate(job, p);
  EXPECT_LT(Component(small, MemoryComponent::kActivations),
            Component(base, MemoryComponent::kActivations));
  p.chunked_loss = false;
  MemoryEstimate logits = Estimate(job, p);
  EXPECT_GT(Component(logits, MemoryComponent::kLogits),
            Component(small, MemoryComponent::kLogits));
}

TEST(MemoryModelTest, OptimizerOffloadMovesStatesToTheHostOnCuda) {
  const JobShape job =
      Job(Shape("llama-3.2-1b"), Spec("method: full\nresources: {ranks: 2, device: cuda}\n"));
  MemoryEstimate on_device = Estimate(job, {2, false, false, false, true, true, 1});
  MemoryEstimate offloaded = Estimate(job, {2, true, false, false, true, true, 1});
  EXPECT_EQ(Component(offloaded, MemoryComponent::kOptimizer), 0u);
  EXPECT_GT(offloaded.host, 0u);
  EXPECT_LT(offloaded.device.total, on_device.device.total);
}

TEST(PlannerTest, PicksTheFastestThatFitsAndSaysWhyTheOthersLost) {
  // A 1B LoRA job on one CPU rank with plenty of memory: nothing to shard, no need to
  // recompute, the largest micro-batch is fastest.
  const JobSpec spec = Spec("train: {steps: 10, global_batch: 8}\n");
  PlanResult result = MustPlan(spec, Shape("llama-3.2-1b"), Options("cpu", 256 * kGiB));
  EXPECT_EQ(result.plan.zero_stage, 0);
  EXPECT_FALSE(result.plan.activation_checkpointing);
  EXPECT_EQ(result.plan.micro_batch, 8);
  EXPECT_EQ(result.plan.gradient_accumulation, 1);
  EXPECT_GT(result.plan.predicted_memory.total, 0u);
  EXPECT_THAT(result.plan.explanation, HasSubstr("planner: ZeRO-0"));
  ASSERT_GT(result.candidates.size(), 1u);
  EXPECT_EQ(result.candidates[0].verdict, "chosen");
  for (size_t i = 1; i < result.candidates.size(); ++i) {
    EXPECT_THAT(result.candidates[i].verdict, HasSubstr("slower")) << i;
  }
}

TEST(PlannerTest, TightMemoryClimbsTheLadder) {
  // Llama-3.1-8B LoRA, bf16, 4 GPUs of 24 GiB: 16 GB of frozen weights do not fit one rank
  // with the activations of 2048 tokens unless something gives.
  const JobSpec spec = Spec(
      "train: {steps: 10, global_batch: 16, precision: bf16}\n"
      "resources: {ranks: 4, device: cuda}\n");
  PlanOptions options = Options("h100", 24 * kGiB);
  options.max_zero_stage = 3;
  PlanResult result = MustPlan(spec, Shape("llama-3.1-8b"), options);
  EXPECT_TRUE(result.plan.zero_stage == 3 || result.plan.activation_checkpointing);
  EXPECT_LE(result.plan.predicted_memory.total, static_cast<uint64_t>(24 * kGiB * 0.9));
  bool some_did_not_fit = false;
  for (const Candidate& c : result.candidates) {
    if (!c.fits) {
      some_did_not_fit = true;
      EXPECT_THAT(c.verdict, HasSubstr("does not fit"));
    }
  }
  EXPECT_TRUE(some_did_not_fit);
}

TEST(PlannerTest, FieldsTheSpecFixesAreHonoured) {
  const JobSpec spec = Spec(
      "train: {steps: 10, global_batch: 16, micro_batch: 2}\n"
      "resources: {ranks: 4, device: cpu}\n"
      "strategy: {zero_stage: 2, activation_checkpointing: auto}\n");
  PlanResult result = MustPlan(spec, Shape("qwen2.5-0.5b"), Options("cpu", 64 * kGiB));
  EXPECT_EQ(result.plan.zero_stage, 2);
  EXPECT_EQ(result.plan.micro_batch, 2);
  EXPECT_EQ(result.plan.gradient_accumulation, 2);
  bool both = false;
  for (const Candidate& c : result.candidates) {
    EXPECT_EQ(c.point.zero_stage, 2);
    EXPECT_EQ(c.point.micro_batch, 2);
    both = both || c.point.activation_checkpointing;
  }
  EXPECT_TRUE(both) << "activation_checkpointing: auto is searched";
  EXPECT_EQ(result.candidates.size(), 2u);
}

TEST(PlannerTest, NothingFitsSaysTheSmallestBreakdownAndWhatWouldFit) {
  const JobSpec spec = Spec(
      "method: full\ntrain: {steps: 10, global_batch: 8}\n"
      "resources: {ranks: 1, device: cpu}\n");
  absl::StatusOr<PlanResult> result =
      PlanJob(spec, Shape("llama-3.1-8b"), Options("cpu", 24 * kGiB));
  EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(result.status().message(),
              AllOf(HasSubstr("nothing fits: the smallest configuration (ZeRO-0, "
                              "checkpointing, micro-batch 1) needs"),
                    HasSubstr("trainable"), HasSubstr("optimizer"),
                    HasSubstr("21.6 GiB (24.0 GiB less 10% headroom)"),
                    HasSubstr("it would fit with"), HasSubstr("ranks (ZeRO-3")));
}

TEST(PlannerTest, SeventyBillionOnEightGpus) {
  const JobSpec spec = Spec(
      "train: {steps: 10, global_batch: 64, precision: bf16}\n"
      "resources: {ranks: 8, device: cuda}\n");
  PlanOptions options = Options("h100", 80 * kGiB);
  options.max_zero_stage = 3;
  PlanResult result = MustPlan(spec, Shape("llama-3.1-70b"), options);
  // 141 GB of bf16 weights: one rank cannot hold them, ZeRO-3 must shard them.
  EXPECT_EQ(result.plan.zero_stage, 3);
  EXPECT_GT(result.tokens_per_second, 0);
  // Stages x optimizer offload x parameter offload (ZeRO-3) x checkpointing x 8 micro-batches.
  EXPECT_EQ(result.candidates.size(), (1 + 2 + 2 + 4) * 2 * 4u);
}

}  // namespace
}  // namespace lathe
