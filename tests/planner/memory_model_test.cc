// The memory model's step timeline (planner/memory_model.h): what each phase holds, and a
// golden check that pins every estimate over a broad grid of jobs and strategies.
#include "planner/memory_model.h"

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "gtest/gtest.h"
#include "tests/testing/source_path.h"

namespace lathe {
namespace {

using testing::SourcePath;

// The dense models of tests/planner/data/configs (mixtral-8x7b's experts are not modelled).
const std::vector<std::string>& ConfigNames() {
  static const std::vector<std::string> kNames = {
      "gemma-2-9b",      "gemma-2b",      "llama-3.1-70b", "llama-3.1-8b", "llama-3.2-1b",
      "mistral-7b-v0.1", "phi-3-mini-4k", "qwen2.5-0.5b",  "qwen2.5-7b"};
  return kNames;
}

ModelShape Shape(const std::string& name) {
  const std::string path = SourcePath("tests/planner/data/configs/" + name + ".json");
  absl::StatusOr<std::string> text = ReadFile(path);
  EXPECT_TRUE(text.ok()) << text.status();
  absl::StatusOr<ModelShape> shape = ParseModelShape(*text, path);
  EXPECT_TRUE(shape.ok()) << shape.status();
  return shape.ok() ? *shape : ModelShape();
}

// A LoRA job of the spec's default rank and targets over 2,048 tokens, as a spec would give it.
JobShape BaseJob(const ModelShape& shape) {
  JobShape job;
  job.model = shape;
  const JobSpec spec;
  job.lora_rank = spec.lora.rank;
  job.lora_targets = spec.lora.targets;
  job.seq_len = 2048;
  return job;
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
                        StrategyPoint p;
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
                        StrategyPoint p;
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
            9 * 3 * (4 * 4 * 2 * 2 * 2 * 2 * 2 * 2 * 2 + 4 * 2 * 2 * 4 * 2 * 2 * 2 * 2 * 2));
  EXPECT_EQ(golden.h, 10680392598946150403u) << "recorded before the timeline refactor (issue #30)";
}

}  // namespace
}  // namespace lathe
