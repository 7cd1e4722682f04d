// The strategy search and the memory model's structure (planner/planner.h,
// memory_model.h). The model's numbers against the engine are bench/planner_accuracy.py's.
#include "planner/planner.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/planner/config_shapes.h"
#include "tests/testing/source_path.h"
#include "tests/testing/status_matchers.h"

namespace lathe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::Shape;

constexpr uint64_t kGiB = uint64_t{1} << 30;

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

MemoryEstimate Estimate(const JobShape& job, const Strategy& point) {
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
  const Strategy plain{0, false, false, false, true, true, 4};
  MemoryEstimate base = Estimate(job, plain);
  Strategy p = plain;
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

// What attention keeps follows what runs (common/plan.h's FusedAttention): libtorch's fused
// attention keeps a log-sum-exp per query row (activations linear in the sequence), the
// explicit softmax its T x T probabilities (more than linear). Fused attention runs on CUDA,
// and on the CPU from 384 tokens; unfused kernels always take the explicit softmax.
TEST(MemoryModelTest, AttentionMemoryFollowsWhatRuns) {
  struct Case {
    const char* device;
    int64_t seq_len;
    bool fused;
    double more_than;  // the activations' growth on doubling the sequence; 0: linear (2x)
  };
  // Measured: 3.10 for 2048 tokens unfused, 2.18 for 128 (the T x T part still small there).
  for (const Case& c :
       {Case{"cuda", 256, true, 0}, Case{"cuda", 2048, false, 2.2}, Case{"cpu", 512, true, 0},
        Case{"cpu", 128, true, 2.1}, Case{"cpu", 2048, false, 2.2}}) {
    SCOPED_TRACE(absl::StrCat(c.device, " ", c.seq_len, c.fused ? " fused" : " unfused"));
    JobShape job = Job(Shape("llama-3.2-1b"),
                       Spec(absl::StrCat("resources: {ranks: 1, device: ", c.device, "}\n")));
    job.seq_len = c.seq_len;
    JobShape longer = job;
    longer.seq_len *= 2;
    Strategy p;
    p.fused_kernels = c.fused;
    const double growth =
        static_cast<double>(Component(Estimate(longer, p), MemoryComponent::kActivations)) /
        static_cast<double>(Component(Estimate(job, p), MemoryComponent::kActivations));
    if (c.more_than == 0) {
      EXPECT_NEAR(growth, 2.0, 0.01);
    } else {
      EXPECT_GT(growth, c.more_than);
    }
  }
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

TEST(MemoryModelTest, EachOptimizersStateFollowsItsFormula) {
  // Full fine-tuning of a 1B model (tied embeddings, 128256 x 2048).
  const ModelShape shape = Shape("llama-3.2-1b");
  absl::StatusOr<std::vector<TrainableShape>> shapes = TrainableShapes(shape, Method::kFull, 0, {});
  ASSERT_TRUE(shapes.ok()) << shapes.status();
  uint64_t params = 0;
  for (const TrainableShape& t : *shapes) {
    uint64_t n = 1;
    for (int64_t d : t.dims) n *= static_cast<uint64_t>(d);
    params += n;
  }
  EXPECT_EQ(params, static_cast<uint64_t>(shape.total_params()));
  auto state = [&](const std::string& train) {
    const JobSpec spec = Spec("method: full\ntrain: {steps: 10, " + train + "}\n");
    return static_cast<uint64_t>(OptimizerStateBytes(*shapes, OptimizerChoiceOf(spec.train)));
  };
  const uint64_t embeddings = uint64_t{128256} * 2048;
  const uint64_t rest = params - embeddings;
  EXPECT_EQ(state("optimizer: adamw"), 8 * params);
  // 8 bits: float32 moments for the embeddings, 2 bytes per element (and 8 per block of
  // 2048, padding included) for the rest.
  EXPECT_GT(state("optimizer: adamw8bit"), 8 * embeddings + 2 * rest);
  EXPECT_LT(state("optimizer: adamw8bit"), 8 * embeddings + 2 * rest + rest / 100);
  // Adafactor without a first moment: rows and columns, and the norms whole.
  EXPECT_LT(state("optimizer: adafactor"), params / 100);
  EXPECT_EQ(state("optimizer: adafactor, adafactor_beta1: 0.9") - state("optimizer: adafactor"),
            4 * params);
  EXPECT_EQ(state("optimizer: sgd"), 0u);
  EXPECT_EQ(state("optimizer: sgd, sgd_momentum: 0.9"), 4 * params);
}

TEST(MemoryModelTest, PagedOptimizerStateLivesInHostMemoryOnCuda) {
  const ModelShape shape = Shape("llama-3.2-1b");
  const Strategy point{0, false, false, false, true, true, 1};
  for (const char* device : {"cuda", "cpu"}) {
    SCOPED_TRACE(device);
    const std::string resources = absl::StrCat("resources: {device: ", device, "}\n");
    const MemoryEstimate resident = Estimate(Job(shape, Spec("method: full\n" + resources)), point);
    const MemoryEstimate paged = Estimate(
        Job(shape, Spec("method: full\n" + resources +
                        "train: {steps: 10, optimizer: adamw8bit, paged_optimizer: true}\n")),
        point);
    if (std::string(device) == "cuda") {
      EXPECT_GT(paged.host, 0u);
      EXPECT_LT(paged.device.total, resident.device.total);
    } else {
      EXPECT_EQ(paged.host, 0u);  // host and device memory are one
    }
  }
}

TEST(MemoryModelTest, QLoraStoresTheProjectionsInHalfAByte) {
  const ModelShape shape = Shape("llama-3.1-8b");
  const Strategy point{0, false, false, false, true, true, 1};
  const MemoryEstimate lora =
      Estimate(Job(shape, Spec("train: {steps: 10, precision: bf16}\n")), point);
  const MemoryEstimate qlora =
      Estimate(Job(shape, Spec("method: qlora\ntrain: {steps: 10, precision: bf16}\n")), point);
  const int64_t projections =
      shape.config.num_hidden_layers * (shape.block.attention + shape.block.mlp);
  EXPECT_EQ(
      Component(lora, MemoryComponent::kWeights) - Component(qlora, MemoryComponent::kWeights),
      static_cast<uint64_t>(2 * projections - Nf4Bytes(projections)));
  EXPECT_EQ(Component(qlora, MemoryComponent::kTrainable),
            Component(lora, MemoryComponent::kTrainable));
}

TEST(PlannerTest, WhenNothingFitsAutoChoosesEightBitStateThenQLoraAndSaysWhy) {
  // Full fine-tuning of 1B on one 20 GiB GPU: AdamW's float32 state does not fit, 8-bit
  // AdamW's does.
  const ModelShape shape = Shape("llama-3.2-1b");
  PlanResult plan = MustPlan(Spec("method: full\nresources: {device: cuda}\n"
                                  "train: {steps: 10, global_batch: 1, precision: bf16}\n"),
                             shape, Options("h100", 20 * kGiB));
  EXPECT_EQ(plan.plan.optimizer, OptimizerKind::kAdamW8bit);
  EXPECT_EQ(plan.plan.method, std::nullopt);
  EXPECT_THAT(plan.plan.explanation,
              HasSubstr("nothing fits with the spec's method full and optimizer adamw; with "
                        "8-bit AdamW state it does"));
  // LoRA on 8B in 12 GiB: 16 GB of bf16 weights never fit; QLoRA's do.
  plan = MustPlan(
      Spec("resources: {device: cuda}\ntrain: {steps: 10, global_batch: 1, precision: bf16}\n"),
      Shape("llama-3.1-8b"), Options("h100", 12 * kGiB));
  EXPECT_EQ(plan.plan.method, Method::kQLora);
  EXPECT_THAT(plan.plan.explanation, HasSubstr("with QLoRA's 4-bit frozen projections it does"));
  // An explicit strategy is what it says: nothing is chosen for it.
  absl::StatusOr<PlanResult> fixed = PlanJob(
      Spec("resources: {device: cuda}\ntrain: {steps: 10, global_batch: 1, precision: bf16}\n"
           "strategy: {zero_stage: 0}\n"),
      Shape("llama-3.1-8b"), Options("h100", 12 * kGiB));
  EXPECT_EQ(fixed.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(PlannerTest, ALoraJobThatDoesNotFitHearsOfQLora) {
  // 8B LoRA in bf16 on a 16 GiB GPU, its strategy fixed: the weights alone (16 GB) do not fit.
  const JobSpec spec = Spec(
      "resources: {device: cuda}\ntrain: {steps: 10, precision: bf16}\nstrategy: "
      "{zero_stage: 0}\n");
  absl::StatusOr<PlanResult> plan =
      PlanJob(spec, Shape("llama-3.1-8b"), Options("h100", 16 * kGiB));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(plan.status().message(), HasSubstr("method qlora (4-bit NF4 frozen projections"));
}

TEST(MemoryModelTest, MezoKeepsNoGradientsNoOptimizerStateNoActivations) {
  const ModelShape shape = Shape("llama-3.1-8b");
  const Strategy point{0, false, false, false, true, true, 1};
  for (const char* trainable : {"lora", "full"}) {
    SCOPED_TRACE(trainable);
    const std::string method = std::string(trainable) == "lora" ? "" : "method: full\n";
    const MemoryEstimate first_order = Estimate(Job(shape, Spec(method)), point);
    const MemoryEstimate mezo = Estimate(
        Job(shape, Spec(absl::StrCat("method: mezo\nmezo: {trainable: ", trainable, "}\n"))),
        point);
    EXPECT_EQ(Component(mezo, MemoryComponent::kGradients), 0u);
    EXPECT_LT(Component(mezo, MemoryComponent::kActivations),
              Component(first_order, MemoryComponent::kActivations));
    EXPECT_EQ(Component(mezo, MemoryComponent::kTrainable),
              Component(first_order, MemoryComponent::kTrainable));
    EXPECT_LT(mezo.device.total, first_order.device.total);
  }
}

TEST(PlannerTest, EveryOptimizersStateShards) {
  // Full fine-tuning of a 1B model on four CPU ranks with 12 GiB each: replicated, even
  // Adafactor's and 8-bit AdamW's state does not fit beside the weights and gradients; with
  // ZeRO each rank keeps a quarter of the per-element state (Adafactor's first moment; its
  // factored statistics stay whole on every rank).
  const ModelShape shape = Shape("llama-3.2-1b");
  for (const std::string optimizer : {"adamw", "adafactor", "adamw8bit", "sgd"}) {
    SCOPED_TRACE(optimizer);
    const JobSpec spec = Spec(
        "method: full\nresources: {ranks: 4}\ntrain: {steps: 10, "
        "global_batch: 4, optimizer: " +
        optimizer + ", sgd_momentum: 0.9, adafactor_beta1: 0.9}\n");
    const PlanResult plan = MustPlan(spec, shape, Options("cpu", 12 * kGiB));
    EXPECT_GT(plan.plan.strategy.zero_stage, 0);
    Strategy replicated{0, false, false, false, true, true, 1};
    Strategy sharded = replicated;
    sharded.zero_stage = 3;
    const uint64_t whole =
        Component(Estimate(Job(shape, spec), replicated), MemoryComponent::kOptimizer);
    const uint64_t quarter =
        Component(Estimate(Job(shape, spec), sharded), MemoryComponent::kOptimizer);
    EXPECT_LT(quarter, whole / 3);
  }
}

TEST(PlannerTest, PicksTheFastestThatFitsAndSaysWhyTheOthersLost) {
  // A 1B LoRA job on one CPU rank with plenty of memory: nothing to shard, no need to
  // recompute, the largest micro-batch is fastest.
  const JobSpec spec = Spec("train: {steps: 10, global_batch: 8}\n");
  PlanResult result = MustPlan(spec, Shape("llama-3.2-1b"), Options("cpu", 256 * kGiB));
  EXPECT_EQ(result.plan.strategy.zero_stage, 0);
  EXPECT_FALSE(result.plan.strategy.activation_checkpointing);
  EXPECT_EQ(result.plan.strategy.micro_batch, 8);
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
  PlanResult result = MustPlan(spec, Shape("llama-3.1-8b"), options);
  EXPECT_TRUE(result.plan.strategy.zero_stage == 3 ||
              result.plan.strategy.activation_checkpointing);
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
  EXPECT_EQ(result.plan.strategy.zero_stage, 2);
  EXPECT_EQ(result.plan.strategy.micro_batch, 2);
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

// Issue #32: full fine-tuning of an 8B model on one H100 ended "...; it would fit with "
// and nothing after it. Where nothing would help, that is said, and so is why sharding and
// offload were left out on cuda.
TEST(PlannerTest, NothingFitsSaysSoWhenNoChangeWouldHelp) {
  const JobSpec spec = Spec(
      "method: full\ntrain: {steps: 10, global_batch: 8}\n"
      "resources: {ranks: 1, device: cuda}\n");
  PlanOptions options = Options("h100", 80 * kGiB);
  options.limits.max_zero_stage = 0;  // an engine without sharding or offload
  options.limits.offload = false;
  options.without_sharding_because = "this engine runs ZeRO and offload on cpu only";
  absl::StatusOr<PlanResult> result = PlanJob(spec, Shape("llama-3.1-8b"), options);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(result.status().message(),
              AllOf(HasSubstr("; neither more ranks nor a shorter sequence would make it fit"),
                    HasSubstr("(sharding and offload were not tried: this engine runs ZeRO and "
                              "offload on cpu only)"),
                    Not(HasSubstr("fit with"))));
}

TEST(PlannerTest, SeventyBillionOnEightGpus) {
  const JobSpec spec = Spec(
      "train: {steps: 10, global_batch: 64, precision: bf16}\n"
      "resources: {ranks: 8, device: cuda}\n");
  PlanOptions options = Options("h100", 80 * kGiB);
  PlanResult result = MustPlan(spec, Shape("llama-3.1-70b"), options);
  // 141 GB of bf16 weights: one rank cannot hold them, ZeRO-3 must shard them.
  EXPECT_EQ(result.plan.strategy.zero_stage, 3);
  EXPECT_GT(result.tokens_per_second, 0);
  // Stages x optimizer offload x parameter offload (ZeRO-3) x checkpointing x 8 micro-batches.
  EXPECT_EQ(result.candidates.size(), (1 + 2 + 2 + 4) * 2 * 4u);
}

// --- closing the loop (calibration.h) -----------------------------------------------

TEST(CalibrationTest, TheCorrectionIsTheMeanOfTheLatestRatios) {
  MemoryCalibration calibration;
  EXPECT_EQ(calibration.Lookup("k").samples, 0);
  EXPECT_EQ(calibration.Lookup("k").factor, 1.0);
  calibration.Record("k", 100, 110);
  calibration.Record("k", 100, 130);
  EXPECT_DOUBLE_EQ(calibration.Lookup("k").factor, 1.2);
  EXPECT_EQ(calibration.Lookup("k").samples, 2);
  // Nothing that cannot be a measurement of the prediction.
  calibration.Record("k", 100, 0);
  calibration.Record("k", 0, 100);
  calibration.Record("k", 100, 500);
  calibration.Record("", 100, 100);
  EXPECT_EQ(calibration.Lookup("k").samples, 2);
  EXPECT_EQ(calibration.All().size(), 1u);
  // Only the latest kWindow count.
  for (size_t i = 0; i < MemoryCalibration::kWindow; ++i) calibration.Record("k", 100, 90);
  EXPECT_DOUBLE_EQ(calibration.Lookup("k").factor, 0.9);
  EXPECT_EQ(calibration.Lookup("k").samples, static_cast<int64_t>(MemoryCalibration::kWindow));
}

TEST(CalibrationTest, KeysSeparateStrategiesAndPoolsButNotMicroBatches) {
  const JobShape job = Job(Shape("llama-3.1-8b"), Spec("resources: {ranks: 4, device: cuda}\n"));
  const Strategy a{2, false, false, true, true, true, 1};
  Strategy b = a;
  b.micro_batch = 4;
  EXPECT_EQ(CalibrationKey(job, a, "h100"), CalibrationKey(job, b, "h100"));
  EXPECT_EQ(CalibrationKey(job, a, "h100"),
            "llama h4096 L32 i14336 a32/8 d128 v128256 | lora r16 q,k,v,o,gate,up,down | fp32 | "
            "ZeRO-2 ckpt fused | 4 x h100");
  b = a;
  b.zero_stage = 3;
  EXPECT_NE(CalibrationKey(job, a, "h100"), CalibrationKey(job, b, "h100"));
  EXPECT_NE(CalibrationKey(job, a, "h100"), CalibrationKey(job, a, "h200"));
}

TEST(CalibrationTest, PlansApplyWhatEarlierAttemptsMeasured) {
  const JobSpec spec = Spec("train: {steps: 10, global_batch: 8}\n");
  const ModelShape shape = Shape("llama-3.2-1b");
  PlanOptions options = Options("cpu", 256 * kGiB);
  const PlanResult before = MustPlan(spec, shape, options);
  EXPECT_EQ(before.plan.memory_correction, 1.0);
  ASSERT_FALSE(before.plan.calibration_key.empty());

  // The chosen configuration measured 1.5x its prediction.
  MemoryCalibration calibration;
  calibration.Record(before.plan.calibration_key, before.plan.predicted_memory.total,
                     before.plan.predicted_memory.total * 3 / 2);
  options.calibration = &calibration;
  const PlanResult after = MustPlan(spec, shape, options);
  EXPECT_NEAR(after.plan.memory_correction, 1.5, 1e-9);
  EXPECT_NEAR(static_cast<double>(after.candidates[0].peak),
              1.5 * static_cast<double>(before.plan.predicted_memory.total), 2);
  EXPECT_THAT(after.plan.explanation,
              HasSubstr("the memory model's estimate x 1.500, learned from 1 measured attempt"));

  // With a budget between the model's peak and the corrected one, that configuration no
  // longer fits: the planner turns to one that does.
  options.rates.memory_bytes =
      static_cast<uint64_t>(static_cast<double>(before.plan.predicted_memory.total) * 1.3 / 0.9);
  const PlanResult tight = MustPlan(spec, shape, options);
  EXPECT_FALSE(tight.plan.calibration_key == before.plan.calibration_key &&
               tight.plan.strategy.micro_batch == before.plan.strategy.micro_batch);
  EXPECT_LE(tight.candidates[0].peak, options.rates.memory_bytes * 9 / 10);
  options.calibration = nullptr;
  EXPECT_EQ(MustPlan(spec, shape, options).plan.strategy.micro_batch,
            before.plan.strategy.micro_batch);
}

// --- device pools (device_pools.h) ----------------------------------------------------

TEST(DevicePoolsTest, AFileOverridesTheDefaultsAndAddsPools) {
  absl::StatusOr<DevicePools> pools = ParseDevicePools(
      R"({"cpu": {"flops": 1.2e11},
          "a100": {"flops": 1.2e14, "half_saturation_tokens": 1024,
                   "link_bytes_per_s": 2.4e11, "host_link_bytes_per_s": 2.5e10}})",
      "rates.json");
  ASSERT_TRUE(pools.ok()) << pools.status();
  EXPECT_EQ(pools->at("cpu").flops, 1.2e11);
  EXPECT_EQ(pools->at("cpu").link_bytes_per_s, DefaultRates("cpu")->link_bytes_per_s);
  EXPECT_EQ(pools->at("a100").flops, 1.2e14);
  EXPECT_EQ(pools->at("h100").flops, DefaultRates("h100")->flops);
  EXPECT_EQ(PoolOf(*pools, true, "NVIDIA A100-SXM4-80GB"), "a100");
  EXPECT_EQ(PoolOf(*pools, true, "NVIDIA H200"), "h200");
  EXPECT_EQ(PoolOf(*pools, true, "NVIDIA L4"), "h100");
  EXPECT_EQ(PoolOf(*pools, false, "cpu"), "cpu");
}

TEST(DevicePoolsTest, BadFilesNameTheFieldOnOneLine) {
  const std::pair<const char*, const char*> cases[] = {
      {"[1]", "rates.json: expected a JSON object of device pools"},
      {"{", "rates.json: expected a JSON object of device pools"},
      {R"({"cpu": 3})", "rates.json: cpu: expected an object of rates"},
      {R"({"cpu": {"flops": -1}})", "rates.json: cpu.flops: must be > 0, got -1"},
      {R"({"cpu": {"tflops": 1}})", "rates.json: cpu.tflops: unknown field"},
      {R"({"a100": {"flops": 1e14}})",
       "rates.json: a100.half_saturation_tokens: required for a pool without defaults"},
      {R"({"A100": {}})", "rates.json: \"A100\": a pool name must be lower case"},
  };
  for (const auto& [text, message] : cases) {
    absl::StatusOr<DevicePools> pools = ParseDevicePools(text, "rates.json");
    EXPECT_EQ(pools.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(pools.status().message(), HasSubstr(message)) << text;
  }
}

}  // namespace
}  // namespace lathe
