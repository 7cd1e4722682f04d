// The memory model's step timeline (planner/memory_model.h): what each phase holds, and a
// golden check that pins every estimate over a broad grid of jobs and strategies.
#include "planner/memory_model.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/flat_layout.h"
#include "common/flops.h"
#include "gtest/gtest.h"
#include "tests/planner/config_shapes.h"
#include "tests/testing/source_path.h"

namespace lathe {
namespace {

using testing::Shape;

// The dense models of tests/planner/data/configs (mixtral-8x7b's experts are not modelled).
const std::vector<std::string>& ConfigNames() {
  static const std::vector<std::string> kNames = {
      "gemma-2-9b",      "llama-3.1-70b", "llama-3.1-8b", "llama-3.2-1b",
      "mistral-7b-v0.1", "phi-3-mini-4k", "qwen2.5-0.5b", "qwen2.5-7b"};
  return kNames;
}

// A LoRA job of the spec's default rank and targets over 2,048 tokens, as a spec would give it.
JobShape BaseJob(const ModelShape& shape) {
  JobShape job;
  job.model = shape;
  const JobSpec spec;
  job.lora_rank = spec.lora.rank;
  job.lora_targets = LoraTargetsOn(shape, spec.lora.targets);  // every projection
  job.seq_len = 2048;
  return job;
}

uint64_t Bytes(const MemoryPhase* phase, MemoryComponent c) {
  EXPECT_NE(phase, nullptr);
  return phase == nullptr ? 0 : phase->bytes.components[static_cast<int>(c)];
}

std::vector<std::string> PhaseNames(const MemoryEstimate& m) {
  std::vector<std::string> names;
  for (const MemoryPhase& phase : m.timeline) names.push_back(phase.name);
  return names;
}

MemoryEstimate Estimate(const JobShape& job, const Strategy& p) {
  absl::StatusOr<MemoryEstimate> m = EstimateMemory(job, p);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *m : MemoryEstimate();
}

// Llama 3.1 8B, LoRA on 8 GPUs in bf16.
JobShape GpuJob() {
  JobShape job = BaseJob(Shape("llama-3.1-8b"));
  job.ranks = 8;
  job.device = DeviceKind::kCuda;
  job.precision = Precision::kBf16;
  return job;
}

TEST(MemoryTimelineTest, EachStageHasItsPhasesAndThePeakIsTheLargest) {
  JobShape job = GpuJob();
  const std::vector<std::string> kTrain = {"forward", "loss", "backward", "hand-over", "optimizer"};
  const std::vector<std::string> kAllReduce = {"forward",   "loss",       "backward",
                                               "hand-over", "all-reduce", "optimizer"};
  const std::vector<std::string> kReduce = {"forward",   "loss",   "backward",
                                            "hand-over", "reduce", "optimizer"};
  for (int64_t stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE(stage);
    Strategy p;
    p.zero_stage = stage;
    const MemoryEstimate m = Estimate(job, p);
    EXPECT_EQ(PhaseNames(m), stage == 0 ? kAllReduce : stage == 1 ? kTrain : kReduce);
    uint64_t largest = 0;
    for (const MemoryPhase& phase : m.timeline) {
      uint64_t sum = 0;
      for (uint64_t c : phase.bytes.components) sum += c;
      EXPECT_EQ(sum, phase.bytes.total) << phase.name;
      // A GPU's runtime allowance is in every phase.
      EXPECT_GE(Bytes(&phase, MemoryComponent::kOverhead), uint64_t{1} << 30) << phase.name;
      largest = std::max(largest, phase.bytes.total);
    }
    EXPECT_EQ(m.device.total, largest);
    // The peak is one phase's, named in words.
    bool found = false;
    for (const MemoryPhase& phase : m.timeline) {
      found |=
          phase.bytes.components == m.device.components && PhaseMoment(phase.name) == m.peak_phase;
    }
    EXPECT_TRUE(found) << m.peak_phase;
  }
  job.ranks = 1;
  EXPECT_EQ(PhaseNames(Estimate(job, Strategy())), kTrain);
  job.zeroth_order = true;
  EXPECT_EQ(PhaseNames(Estimate(job, Strategy())),
            (std::vector<std::string>{"forward", "loss", "perturbation"}));
}

TEST(MemoryTimelineTest, OnlyTheLossHoldsLogitsAndOnlyBackwardItsTransients) {
  const JobShape job = GpuJob();
  Strategy p;
  p.chunked_loss = false;
  const MemoryEstimate m = Estimate(job, p);
  EXPECT_EQ(Bytes(m.Phase(kPhaseForward), MemoryComponent::kLogits), 0u);
  EXPECT_GT(Bytes(m.Phase(kPhaseLoss), MemoryComponent::kLogits), 0u);
  EXPECT_EQ(Bytes(m.Phase(kPhaseBackward), MemoryComponent::kLogits), 0u);
  // No gradients before backward (one micro-batch a step), and none of the forward's
  // activations after it.
  EXPECT_EQ(Bytes(m.Phase(kPhaseForward), MemoryComponent::kGradients), 0u);
  EXPECT_GT(Bytes(m.Phase(kPhaseBackward), MemoryComponent::kGradients), 0u);
  EXPECT_EQ(Bytes(m.Phase(kPhaseOptimizer), MemoryComponent::kActivations), 0u);
}

// lora.modules_to_save: each copy is vocab x hidden trainable float32 elements of its unit
// (the embeddings' of unit 0, the LM head's of the head unit), with its gradient and AdamW's
// two moments, sharded as the stage shards any unit's trainable slice; the frozen base is
// unchanged. A trained head adds its weight gradient's FLOPs.
TEST(MemoryTimelineTest, ModulesToSaveAddTheirCopiesStatesAsTheStageShardsThem) {
  const JobShape without = GpuJob();
  JobShape with = without;
  with.saved.embed_tokens = with.saved.lm_head = true;
  const ModelShape& m = with.model;
  const int64_t copy = m.config.vocab_size * m.config.hidden_size;
  absl::StatusOr<std::vector<UnitElements>> plain =
      UnitsOf(m, without.method, without.lora_rank, without.lora_targets);
  absl::StatusOr<std::vector<UnitElements>> saved =
      UnitsOf(m, with.method, with.lora_rank, with.lora_targets, with.saved);
  ASSERT_TRUE(plain.ok() && saved.ok());
  EXPECT_EQ(saved->front().trainable, plain->front().trainable + copy);
  EXPECT_EQ(saved->back().trainable, plain->back().trainable + copy);
  EXPECT_EQ(saved->front().frozen, plain->front().frozen);
  EXPECT_EQ(saved->back().frozen, plain->back().frozen);
  for (int64_t stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE(stage);
    Strategy p;
    p.zero_stage = stage;
    const MemoryEstimate estimate_a = Estimate(without, p);
    const MemoryEstimate estimate_b = Estimate(with, p);
    // Backward holds the states alone; the optimizer step adds its temporaries, now of the
    // largest trainable tensor, a copy (or the largest unit slice it steps).
    const MemoryPhase* a = estimate_a.Phase(kPhaseBackward);
    const MemoryPhase* b = estimate_b.Phase(kPhaseBackward);
    EXPECT_GT(Bytes(estimate_b.Phase(kPhaseOptimizer), MemoryComponent::kOptimizer) -
                  Bytes(estimate_a.Phase(kPhaseOptimizer), MemoryComponent::kOptimizer),
              Bytes(b, MemoryComponent::kOptimizer) - Bytes(a, MemoryComponent::kOptimizer));
    // The elements of one rank's slices: whole at stage 0, 1/8 of each unit's otherwise.
    int64_t added = 2 * copy;
    if (stage > 0) {
      added = 0;
      for (size_t u : {size_t{0}, plain->size() - 1}) {
        added += ShardNumel((*saved)[u].trainable, with.ranks) -
                 ShardNumel((*plain)[u].trainable, with.ranks);
      }
    }
    EXPECT_EQ(Bytes(b, MemoryComponent::kOptimizer) - Bytes(a, MemoryComponent::kOptimizer),
              static_cast<uint64_t>(8 * added));
    EXPECT_EQ(Bytes(b, MemoryComponent::kWeights), Bytes(a, MemoryComponent::kWeights));
    // Masters: whole at stage 0, whole but padded to the shards at 1-2, a slice at 3.
    const int64_t masters = stage == 0 ? added : stage == 3 ? added : with.ranks * added;
    EXPECT_EQ(Bytes(b, MemoryComponent::kTrainable) - Bytes(a, MemoryComponent::kTrainable),
              static_cast<uint64_t>(4 * masters));
  }
  // The spec's names, through JobShapeOf.
  JobSpec spec;
  spec.lora.modules_to_save = {"model.embed_tokens"};
  const JobShape of = JobShapeOf(spec, m);
  EXPECT_TRUE(of.saved.embed_tokens);
  EXPECT_FALSE(of.saved.lm_head);
  // FLOPs per token: the head's weight gradient, 2 x vocab x hidden, for a trained LM head.
  ModelConfig config;
  config.model_type = "llama";
  config.vocab_size = 100;
  config.hidden_size = 16;
  config.intermediate_size = 32;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 2;
  config.num_key_value_heads = 2;
  config.head_dim = 8;
  JobSpec lora;
  const double base = TrainingFlopsPerToken(config, lora, 64, false);
  lora.lora.modules_to_save = {"embed_tokens"};
  EXPECT_EQ(TrainingFlopsPerToken(config, lora, 64, false), base);
  lora.lora.modules_to_save = {"lm_head"};
  EXPECT_EQ(TrainingFlopsPerToken(config, lora, 64, false), base + 2.0 * 100 * 16);
}

// ZeRO-3 holds the block running backward and prefetches the one below: two blocks gathered
// whole, where stage 2 gathers none (both have the same buckets in flight). As the head hands
// its gradients over, the head alone is gathered (with the final norm).
TEST(MemoryTimelineTest, ZeroThreesBackwardHoldsTwoGatheredBlocks) {
  const JobShape job = GpuJob();
  Strategy p;
  p.zero_stage = 2;
  const MemoryEstimate stage2 = Estimate(job, p);
  p.zero_stage = 3;
  const MemoryEstimate stage3 = Estimate(job, p);
  const uint64_t gathered = Bytes(stage3.Phase(kPhaseBackward), MemoryComponent::kCommBuffers) -
                            Bytes(stage2.Phase(kPhaseBackward), MemoryComponent::kCommBuffers);
  // A block's frozen bf16 weights, without its LoRA factors and norms.
  const uint64_t block = 2 * static_cast<uint64_t>(job.model.block.attention + job.model.block.mlp);
  EXPECT_GE(gathered, 2 * block);
  EXPECT_LT(gathered, 2 * block + block / 10);
  EXPECT_EQ(
      Bytes(stage3.Phase(kPhaseHandOver), MemoryComponent::kCommBuffers) -
          Bytes(stage2.Phase(kPhaseHandOver), MemoryComponent::kCommBuffers),
      2 * static_cast<uint64_t>((job.model.config.vocab_size + 1) * job.model.config.hidden_size));
  // The optimizer step gathers nothing.
  EXPECT_EQ(Bytes(stage3.Phase(kPhaseOptimizer), MemoryComponent::kCommBuffers), 0u);
}

// Offloaded on CUDA, the optimizer state and step leave the device for host memory.
TEST(MemoryTimelineTest, OffloadMovesTheOptimizerStepToTheHost) {
  JobShape job = GpuJob();
  job.method = Method::kFull;
  Strategy p;
  p.zero_stage = 2;
  const MemoryEstimate on_device = Estimate(job, p);
  p.offload_optimizer = true;
  const MemoryEstimate offloaded = Estimate(job, p);
  const uint64_t state = Bytes(on_device.Phase(kPhaseForward), MemoryComponent::kOptimizer);
  EXPECT_GT(Bytes(on_device.Phase(kPhaseOptimizer), MemoryComponent::kOptimizer), state);
  EXPECT_EQ(Bytes(offloaded.Phase(kPhaseOptimizer), MemoryComponent::kOptimizer), 0u);
  EXPECT_EQ(Bytes(offloaded.Phase(kPhaseForward), MemoryComponent::kOptimizer), 0u);
  EXPECT_GE(offloaded.host, on_device.host + state);
  // On the CPU there is nowhere to move it.
  job.device = DeviceKind::kCpu;
  EXPECT_EQ(Bytes(Estimate(job, p).Phase(kPhaseOptimizer), MemoryComponent::kOptimizer),
            Bytes(on_device.Phase(kPhaseOptimizer), MemoryComponent::kOptimizer));
}

// Checkpointing keeps each block's input instead of its insides: less at the end of the
// forward pass, and backward recomputes one block at a time.
TEST(MemoryTimelineTest, CheckpointingLowersTheForwardsActivations) {
  const JobShape job = GpuJob();
  Strategy p;
  const MemoryEstimate kept = Estimate(job, p);
  p.activation_checkpointing = true;
  const MemoryEstimate checkpointed = Estimate(job, p);
  const uint64_t forward = Bytes(kept.Phase(kPhaseForward), MemoryComponent::kActivations);
  EXPECT_LT(Bytes(checkpointed.Phase(kPhaseForward), MemoryComponent::kActivations), forward / 4);
  EXPECT_LT(Bytes(checkpointed.Phase(kPhaseBackward), MemoryComponent::kActivations),
            Bytes(kept.Phase(kPhaseBackward), MemoryComponent::kActivations));
  // Without checkpointing, backward's activations never exceed the forward's.
  EXPECT_LE(Bytes(kept.Phase(kPhaseBackward), MemoryComponent::kActivations), forward);
}

// With gradient accumulation the sized micro-batch starts with the earlier ones' gradients:
// whole at stage 0, slices at stage 2.
TEST(MemoryTimelineTest, AccumulationCarriesGradientsIntoTheForward) {
  JobShape job = GpuJob();
  job.global_batch = 64;
  for (int64_t stage : {0, 2}) {
    Strategy p;
    p.zero_stage = stage;
    const MemoryEstimate m = Estimate(job, p);
    EXPECT_GT(Bytes(m.Phase(kPhaseForward), MemoryComponent::kGradients), 0u) << stage;
  }
  Strategy p;
  const uint64_t whole = Bytes(Estimate(job, p).Phase(kPhaseForward), MemoryComponent::kGradients);
  p.zero_stage = 2;
  EXPECT_LT(Bytes(Estimate(job, p).Phase(kPhaseForward), MemoryComponent::kGradients), whole);
}

// FNV-1a over every estimate's numbers and peak phase, in the grid's order. To find what
// changed, LATHE_MEMORY_GOLDEN_DUMP=FILE writes the rows, one an estimate: diff them against
// the same run at the commit before.
struct GoldenHash {
  uint64_t h = 14695981039346656037ull;
  int64_t count = 0;
  std::ofstream* dump = nullptr;
  void Bytes(const void* data, size_t size) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < size; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  void Add(const absl::StatusOr<MemoryEstimate>& m) {
    ++count;
    std::string row;
    if (!m.ok()) {
      row = absl::StrCat("error ", m.status().ToString());
    } else {
      for (uint64_t c : m->device.components) absl::StrAppend(&row, c, " ");
      absl::StrAppend(&row, m->device.total, " ", m->host, " ", m->peak_phase);
    }
    Bytes(row.data(), row.size());
    if (dump != nullptr) *dump << row << "\n";
  }
};

// The grid: every config x lora/qlora/full x ZeRO 0-3 x offload (none, optimizer, params,
// both) x checkpointing x chunked loss x micro-batch 1/4 x ranks 1/8 x CPU/CUDA x fp32/bf16 x
// global batch (one micro-batch, 64 sequences); then, over configs x methods x stages x
// devices x ranks, the optimizers, paging, MeZO, unfused kernels and a short sequence.
TEST(MemoryModelGoldenTest, EveryEstimateOfTheGridIsUnchanged) {
  GoldenHash golden;
  std::ofstream dump;
  if (const char* path = std::getenv("LATHE_MEMORY_GOLDEN_DUMP"); path != nullptr) {
    dump.open(path);
    golden.dump = &dump;
  }
  const Method kMethods[] = {Method::kLora, Method::kQLora, Method::kFull};
  const DeviceKind kDevices[] = {DeviceKind::kCpu, DeviceKind::kCuda};
  for (const std::string& name : ConfigNames()) {
    const JobShape base = BaseJob(Shape(name));
    for (Method method : kMethods) {
      for (int64_t stage = 0; stage <= 3; ++stage) {
        for (int offload = 0; offload < 4; ++offload) {
          for (bool ckpt : {false, true}) {
            for (bool chunked : {true, false}) {
              for (int64_t micro : {1, 4}) {
                for (int64_t ranks : {1, 8}) {
                  for (DeviceKind device : kDevices) {
                    for (Precision precision : {Precision::kFp32, Precision::kBf16}) {
                      for (int64_t global : {0, 64}) {
                        JobShape job = base;
                        job.method = method;
                        job.ranks = ranks;
                        job.device = device;
                        job.precision = precision;
                        job.global_batch = global;
                        Strategy p;
                        p.zero_stage = stage;
                        p.offload_optimizer = (offload & 1) != 0;
                        p.offload_params = (offload & 2) != 0;
                        p.activation_checkpointing = ckpt;
                        p.chunked_loss = chunked;
                        p.micro_batch = micro;
                        golden.Add(EstimateMemory(job, p));
                      }
                    }
                  }
                }
              }
            }
          }
        }
      }
      OptimizerChoice adafactor, sgd;
      adafactor.kind = OptimizerKind::kAdafactor;
      adafactor.first_moment = false;
      sgd.kind = OptimizerKind::kSgd;
      sgd.weight_decay = sgd.nesterov = true;
      OptimizerChoice adam8;
      adam8.kind = OptimizerKind::kAdamW8bit;
      for (int64_t stage = 0; stage <= 3; ++stage) {
        for (DeviceKind device : kDevices) {
          for (int64_t ranks : {1, 8}) {
            for (const OptimizerChoice& optimizer : {OptimizerChoice(), adam8, adafactor, sgd}) {
              for (bool paged : {false, true}) {
                for (bool mezo : {false, true}) {
                  for (bool fused : {true, false}) {
                    for (int64_t seq : {256, 2048}) {
                      for (bool offload : {false, true}) {
                        JobShape job = base;
                        job.method = method;
                        job.ranks = ranks;
                        job.device = device;
                        job.precision = Precision::kBf16;
                        job.optimizer = optimizer;
                        job.paged_optimizer = paged;
                        job.zeroth_order = mezo;
                        job.seq_len = seq;
                        job.global_batch = 32;
                        Strategy p;
                        p.zero_stage = stage;
                        p.offload_optimizer = offload;
                        p.fused_kernels = fused;
                        p.micro_batch = 2;
                        golden.Add(EstimateMemory(job, p));
                      }
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(golden.count,
            8 * 3 * (4 * 4 * 2 * 2 * 2 * 2 * 2 * 2 * 2 + 4 * 2 * 2 * 4 * 2 * 2 * 2 * 2 * 2));
  // Recorded before the timeline refactor (issue #30); changed by #31's Gemma 2 (its fused or
  // unfused GeGLU, four norms, soft-caps: gemma-2-9b's estimates only; with those off the grid
  // hashes as before) and by #31's Phi-3 for phi-3-mini-4k alone, whose projections are now
  // the engine's four fused ones (qkv_proj, o_proj, gate_up_proj, down_proj: the default LoRA
  // targets, and one trainable tensor each in full fine-tuning) instead of seven separate ones
  // (checked: with phi3 read as llama, the grid's hash is Gemma's, 11442435261107408614).
  // Then #30 item 3 dropped gemma-2b (model_type gemma: the engine, and now the planner, which
  // reads config.json through the engine's parser, refuses it); every other row is as before
  // (checked: the rows dumped at e80efea without gemma-2b's equal these).
  EXPECT_EQ(golden.h, 8205543328040125548u);
}

}  // namespace
}  // namespace lathe
