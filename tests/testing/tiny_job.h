// A small LoRA job the engine tests train: the tiny model (tiny_model.h) and a synthetic
// data set written under a temporary directory, and a spec that trains on them.
#ifndef LATHE_TESTS_TESTING_TINY_JOB_H_
#define LATHE_TESTS_TESTING_TINY_JOB_H_

#include "common/job_spec.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "worker/tools/synthetic.h"

namespace lathe::testing {

// Writes `config`'s model (weights of `dtype`) to <dir>/model and 64 records of 8-24 tokens
// to <dir>/train.jsonl, and returns a spec: LoRA rank 4, 4 steps of 4 sequences of 16
// tokens, lr 1e-2, output <dir>/out.
inline JobSpec TinyLoraJob(const TempDir& dir, const ModelConfig& config,
                           DType dtype = DType::kF32) {
  absl::Status written = WriteSyntheticModel(config, dtype, 1, 0, dir.Path("model"));
  EXPECT_TRUE(written.ok()) << written;
  SyntheticDataOptions data;
  data.vocab = config.vocab_size;
  data.records = 64;
  data.min_len = 8;
  data.max_len = 24;
  dir.Write("train.jsonl", SyntheticDataJsonl(data));
  JobSpec spec;
  spec.name = "t";
  spec.model.path = dir.Path("model");
  spec.data.train = dir.Path("train.jsonl");
  spec.data.seq_len = 16;
  spec.lora.rank = 4;
  spec.train.steps = 4;
  spec.train.global_batch = 4;
  spec.train.lr = 1e-2;
  spec.output = dir.Path("out");
  return spec;
}

}  // namespace lathe::testing

#endif  // LATHE_TESTS_TESTING_TINY_JOB_H_
