#include "common/job_spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace lathe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kSource[] = "job.yaml";

// Every field given, none at its default.
constexpr char kFullYaml[] = R"yaml(
name: demo-lora
model: {path: /models/qwen2.5-0.5b}
data: {train: /data/train.jsonl, eval: /data/eval.jsonl, seq_len: 512, pack: false}
method: qlora
lora:
  rank: 8
  alpha: 16
  dropout: 0.05
  targets: [q_proj, v_proj, down_proj]
  use_rslora: true
  init_from: /adapters/start
train:
  steps: 1000
  global_batch: 64
  micro_batch: 4
  lr: 2.0e-4
  schedule: {kind: linear, warmup_steps: 50}
  optimizer: adamw8bit
  adam_beta1: 0.8
  adam_beta2: 0.95
  adam_eps: 1.0e-6
  weight_decay: 0.01
  sgd_momentum: 0.5
  sgd_nesterov: true
  adafactor_beta1: 0.25
  adafactor_decay_rate: -0.5
  adafactor_clip_threshold: 2
  adafactor_relative_step: true
  paged_optimizer: true
  max_grad_norm: 0.5
  precision: bf16
  seed: 1234
  checkpoint_every: 100
resources: {ranks: 8, device: cuda, memory_per_rank: 80GiB}
strategy:
  zero_stage: 3
  offload_optimizer: true
  offload_params: true
  activation_checkpointing: true
  chunked_loss: true
priority: -2
max_restarts: 5
output: /runs/demo-lora
)yaml";

// The same spec in JSON, tab-indented.
constexpr char kFullJson[] = R"json({
	"name": "demo-lora",
	"model": {"path": "/models/qwen2.5-0.5b"},
	"data": {"train": "/data/train.jsonl", "eval": "/data/eval.jsonl", "seq_len": 512,
	         "pack": false},
	"method": "qlora",
	"lora": {"rank": 8, "alpha": 16, "dropout": 0.05,
	         "targets": ["q_proj", "v_proj", "down_proj"], "use_rslora": true,
	         "init_from": "/adapters/start"},
	"train": {
		"steps": 1000, "global_batch": 64, "micro_batch": 4, "lr": 2.0e-4,
		"schedule": {"kind": "linear", "warmup_steps": 50},
		"optimizer": "adamw8bit", "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_eps": 1.0e-6,
		"weight_decay": 0.01, "sgd_momentum": 0.5, "sgd_nesterov": true, "adafactor_beta1": 0.25,
		"adafactor_decay_rate": -0.5, "adafactor_clip_threshold": 2, "adafactor_relative_step": true, "paged_optimizer": true,
		"max_grad_norm": 0.5, "precision": "bf16", "seed": 1234,
		"checkpoint_every": 100
	},
	"resources": {"ranks": 8, "device": "cuda", "memory_per_rank": "80GiB"},
	"strategy": {"zero_stage": 3, "offload_optimizer": true, "offload_params": true,
	             "activation_checkpointing": true, "chunked_loss": true},
	"priority": -2,
	"max_restarts": 5,
	"output": "/runs/demo-lora"
}
)json";

// A full example, comments included.
constexpr char kDesignExample[] = R"yaml(
name: demo-lora
model: {path: /models/qwen2.5-0.5b}          # HF dir: config.json + *.safetensors (+ index)
data:  {train: /data/train.jsonl, seq_len: 1024, pack: true}  # lines {"input_ids": [...]} or {"text": "..."}
method: lora                                 # lora | full | qlora
lora:  {rank: 16, alpha: 32, dropout: 0.0, targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}
train:
  steps: 1000              # or epochs
  global_batch: 64         # sequences per optimizer step
  micro_batch: auto        # or a number
  lr: 2.0e-4
  schedule: {kind: cosine, warmup_steps: 50}   # cosine | linear | constant
  optimizer: adamw         # adamw | adamw8bit | adafactor | sgd
  weight_decay: 0.0
  max_grad_norm: 1.0
  precision: bf16          # fp32 | bf16 | fp16 (dynamic loss scaling)
  seed: 0
  checkpoint_every: 100
resources: {ranks: 8, device: cuda, memory_per_rank: 80GiB}   # device: cpu | cuda
strategy: auto             # or {zero_stage: 3, offload_optimizer: true, offload_params: false,
                           #     activation_checkpointing: true, chunked_loss: true}
priority: 0
max_restarts: 3
output: /runs/demo-lora
)yaml";

JobSpec MustParse(const std::string& text) {
  absl::StatusOr<JobSpec> spec = ParseJobSpec(text, kSource);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? *spec : JobSpec();
}

void ExpectFullSpec(const JobSpec& spec) {
  EXPECT_EQ(spec.name, "demo-lora");
  EXPECT_EQ(spec.model.path, "/models/qwen2.5-0.5b");
  EXPECT_EQ(spec.data.train, "/data/train.jsonl");
  EXPECT_EQ(spec.data.eval, "/data/eval.jsonl");
  EXPECT_EQ(spec.data.seq_len, 512);
  EXPECT_FALSE(spec.data.pack);
  EXPECT_EQ(spec.method, Method::kQLora);
  EXPECT_EQ(spec.lora.rank, 8);
  EXPECT_EQ(spec.lora.alpha, 16.0);
  EXPECT_EQ(spec.lora.dropout, 0.05);
  EXPECT_THAT(spec.lora.targets, ElementsAre("q_proj", "v_proj", "down_proj"));
  EXPECT_TRUE(spec.lora.use_rslora);
  EXPECT_EQ(spec.lora.init_from, "/adapters/start");
  EXPECT_EQ(spec.train.steps, 1000);
  EXPECT_EQ(spec.train.epochs, 0);
  EXPECT_EQ(spec.train.global_batch, 64);
  EXPECT_EQ(spec.strategy.micro_batch, 4);
  EXPECT_EQ(spec.train.lr, 2.0e-4);
  EXPECT_EQ(spec.train.schedule.kind, ScheduleKind::kLinear);
  EXPECT_EQ(spec.train.schedule.warmup_steps, 50);
  EXPECT_EQ(spec.train.optimizer, OptimizerKind::kAdamW8bit);
  EXPECT_EQ(spec.train.adam_beta1, 0.8);
  EXPECT_EQ(spec.train.adam_beta2, 0.95);
  EXPECT_EQ(spec.train.adam_eps, 1.0e-6);
  EXPECT_EQ(spec.train.weight_decay, 0.01);
  EXPECT_EQ(spec.train.sgd_momentum, 0.5);
  EXPECT_TRUE(spec.train.sgd_nesterov);
  EXPECT_EQ(spec.train.adafactor_beta1, 0.25);
  EXPECT_EQ(spec.train.adafactor_decay_rate, -0.5);
  EXPECT_EQ(spec.train.adafactor_clip_threshold, 2.0);
  EXPECT_TRUE(spec.train.adafactor_relative_step);
  EXPECT_TRUE(spec.train.paged_optimizer);
  EXPECT_EQ(spec.train.max_grad_norm, 0.5);
  EXPECT_EQ(spec.train.precision, Precision::kBf16);
  EXPECT_EQ(spec.train.seed, 1234u);
  EXPECT_EQ(spec.train.checkpoint_every, 100);
  EXPECT_EQ(spec.resources.ranks, 8);
  EXPECT_EQ(spec.resources.device, DeviceKind::kCuda);
  EXPECT_EQ(spec.resources.memory_per_rank, uint64_t{80} << 30);
  EXPECT_FALSE(IsAutomatic(spec.strategy));
  EXPECT_EQ(spec.strategy.zero_stage, 3);
  EXPECT_EQ(spec.strategy.offload_optimizer, true);
  EXPECT_EQ(spec.strategy.offload_params, true);
  EXPECT_EQ(spec.strategy.activation_checkpointing, true);
  EXPECT_EQ(spec.strategy.chunked_loss, true);
  EXPECT_EQ(spec.priority, -2);
  EXPECT_EQ(spec.max_restarts, 5);
  EXPECT_EQ(spec.output, "/runs/demo-lora");
}

TEST(JobSpecTest, ParsesFullYaml) { ExpectFullSpec(MustParse(kFullYaml)); }

TEST(JobSpecTest, ParsesFullJson) { ExpectFullSpec(MustParse(kFullJson)); }

TEST(JobSpecTest, ParsesDesignExample) {
  JobSpec spec = MustParse(kDesignExample);
  EXPECT_EQ(spec.method, Method::kLora);
  EXPECT_EQ(spec.lora.targets.size(), 7u);
  EXPECT_EQ(spec.strategy.micro_batch, std::nullopt);  // auto
  EXPECT_EQ(spec.train.schedule.kind, ScheduleKind::kCosine);
  EXPECT_EQ(spec.train.precision, Precision::kBf16);
  EXPECT_TRUE(IsAutomatic(spec.strategy));
  EXPECT_EQ(spec.resources.memory_per_rank, uint64_t{80} << 30);
}

TEST(JobSpecTest, Defaults) {
  JobSpec spec = MustParse(R"(
name: minimal
model: {path: /m}
data: {train: /d.jsonl}
train: {epochs: 2}
output: /out
)");
  const JobSpec defaults;
  EXPECT_EQ(spec.data.eval, "");
  EXPECT_EQ(spec.data.seq_len, 1024);
  EXPECT_TRUE(spec.data.pack);
  EXPECT_EQ(spec.method, Method::kLora);
  EXPECT_EQ(spec.lora.rank, 16);
  EXPECT_EQ(spec.lora.alpha, 32.0);
  EXPECT_EQ(spec.lora.dropout, 0.0);
  EXPECT_TRUE(spec.lora.targets.empty());  // every projection of the model
  EXPECT_FALSE(spec.lora.use_rslora);
  EXPECT_EQ(spec.lora.init_from, "");
  EXPECT_EQ(spec.train.steps, 0);
  EXPECT_EQ(spec.train.epochs, 2);
  EXPECT_EQ(spec.train.global_batch, 8);
  EXPECT_EQ(spec.strategy.micro_batch, std::nullopt);
  EXPECT_EQ(spec.train.lr, 2.0e-4);
  EXPECT_EQ(spec.train.schedule.kind, ScheduleKind::kCosine);
  EXPECT_EQ(spec.train.schedule.warmup_steps, 0);
  EXPECT_EQ(spec.train.optimizer, OptimizerKind::kAdamW);
  EXPECT_EQ(spec.train.adam_beta1, 0.9);
  EXPECT_EQ(spec.train.adam_beta2, 0.999);
  EXPECT_EQ(spec.train.adam_eps, 1e-8);
  EXPECT_EQ(spec.train.weight_decay, 0.0);
  EXPECT_EQ(spec.train.max_grad_norm, 1.0);
  EXPECT_EQ(spec.train.precision, Precision::kFp32);
  EXPECT_EQ(spec.train.seed, 0u);
  EXPECT_EQ(spec.train.checkpoint_every, 0);
  EXPECT_EQ(spec.resources.ranks, 1);
  EXPECT_EQ(spec.resources.device, DeviceKind::kCpu);
  EXPECT_EQ(spec.resources.memory_per_rank, 0u);
  EXPECT_TRUE(IsAutomatic(spec.strategy));
  EXPECT_EQ(spec.strategy.zero_stage, defaults.strategy.zero_stage);
  EXPECT_EQ(spec.priority, 0);
  EXPECT_EQ(spec.max_restarts, 3);
}

constexpr char kMinimalPrefix[] = "name: t\nmodel: {path: /m}\ndata: {train: /d}\noutput: /o\n";

TEST(JobSpecTest, ParsesMezoAndItsTrainableWeights) {
  JobSpec spec = MustParse(std::string(kMinimalPrefix) +
                           "method: mezo\nmezo: {trainable: full, eps: 1.0e-2}\n"
                           "train: {steps: 10}\n");
  EXPECT_EQ(spec.method, Method::kMezo);
  EXPECT_EQ(spec.mezo.trainable, Method::kFull);
  EXPECT_EQ(spec.mezo.eps, 1e-2);
  EXPECT_TRUE(TrainsFullWeights(spec));
  EXPECT_FALSE(TrainsLora(spec));
  // The defaults: over LoRA, eps 1e-3; and it survives the JSON form.
  spec = MustParse(std::string(kMinimalPrefix) + "method: mezo\ntrain: {steps: 10}\n");
  EXPECT_EQ(spec.mezo.trainable, Method::kLora);
  EXPECT_EQ(spec.mezo.eps, 1e-3);
  EXPECT_TRUE(TrainsLora(spec));
  const std::string json = JobSpecToJson(spec);
  EXPECT_THAT(json, HasSubstr(R"("mezo":{"trainable":"lora","eps":0.001})"));
  EXPECT_EQ(MustParse(json).mezo.eps, 1e-3);
  EXPECT_THAT(JobSpecToJson(MustParse(std::string(kMinimalPrefix) + "train: {steps: 1}\n")),
              Not(HasSubstr("mezo")));
}

// rank_pattern and alpha_pattern keep the spec's order, through the JSON form too.
TEST(JobSpecTest, ParsesRankAndAlphaPatterns) {
  const JobSpec spec = MustParse(std::string(kMinimalPrefix) +
                                 "lora: {rank_pattern: {q_proj: 4, 'layers\\.1\\..*': 2}, "
                                 "alpha_pattern: {down_proj: 3.5}}\ntrain: {steps: 1}\n");
  using Rank = std::pair<std::string, int64_t>;
  using Alpha = std::pair<std::string, double>;
  EXPECT_THAT(spec.lora.rank_pattern, ElementsAre(Rank{"q_proj", 4}, Rank{R"(layers\.1\..*)", 2}));
  EXPECT_THAT(spec.lora.alpha_pattern, ElementsAre(Alpha{"down_proj", 3.5}));
  const std::string json = JobSpecToJson(spec);
  EXPECT_THAT(json, HasSubstr(R"("rank_pattern":{"q_proj":4,"layers\\.1\\..*":2})"));
  EXPECT_THAT(json, HasSubstr(R"("alpha_pattern":{"down_proj":3.5})"));
  const JobSpec again = MustParse(json);
  EXPECT_EQ(again.lora.rank_pattern, spec.lora.rank_pattern);
  EXPECT_EQ(again.lora.alpha_pattern, spec.lora.alpha_pattern);
}

// modules_to_save keeps the spec's names and order (adapter_config.json writes them as given),
// through the JSON form too; "model.embed_tokens" names the embeddings as PEFT's suffix does.
TEST(JobSpecTest, ParsesModulesToSave) {
  const JobSpec spec =
      MustParse(std::string(kMinimalPrefix) +
                "lora: {modules_to_save: [lm_head, model.embed_tokens]}\ntrain: {steps: 1}\n");
  EXPECT_THAT(spec.lora.modules_to_save, ElementsAre("lm_head", "model.embed_tokens"));
  const std::string json = JobSpecToJson(spec);
  EXPECT_THAT(json, HasSubstr(R"("modules_to_save":["lm_head","model.embed_tokens"])"));
  EXPECT_EQ(MustParse(json).lora.modules_to_save, spec.lora.modules_to_save);
}

// PEFT's options that Lathe lacks, written at their defaults, say what Lathe does anyway.
TEST(JobSpecTest, AcceptsUnsupportedPeftOptionsLeftOff) {
  const JobSpec spec = MustParse(
      std::string(kMinimalPrefix) +
      "lora: {use_dora: false, fan_in_fan_out: false, init_lora_weights: true, bias: none, "
      "layers_to_transform: null, layers_pattern: ~, lora_bias: false, megatron_config: null, "
      "loftq_config: {}, layer_replication: []}\ntrain: {steps: 1}\n");
  EXPECT_EQ(JobSpecToJson(spec),
            JobSpecToJson(MustParse(std::string(kMinimalPrefix) + "train: {steps: 1}\n")));
}

// lora.targets as PEFT's target_modules: a list of names or full-name suffixes, "all-linear",
// or a regular expression; the string forms survive the JSON form and replace the list.
TEST(JobSpecTest, ParsesLoraTargetForms) {
  JobSpec spec = MustParse(std::string(kMinimalPrefix) +
                           "lora: {targets: [self_attn.q_proj, model.layers.1.mlp.up_proj]}\n"
                           "train: {steps: 1}\n");
  EXPECT_THAT(spec.lora.targets, ElementsAre("self_attn.q_proj", "model.layers.1.mlp.up_proj"));
  EXPECT_EQ(spec.lora.targets_pattern, "");
  for (const std::string pattern :
       {"all-linear", "ALL-Linear", R"(.*\.layers\.(0|1)\.self_attn\.(q|v)_proj)"}) {
    SCOPED_TRACE(pattern);
    spec = MustParse(std::string(kMinimalPrefix) + "lora: {targets: '" + pattern +
                     "'}\ntrain: {steps: 1}\n");
    EXPECT_EQ(spec.lora.targets_pattern, pattern);
    EXPECT_TRUE(spec.lora.targets.empty());
    const std::string json = JobSpecToJson(spec);
    EXPECT_THAT(json, HasSubstr(absl::StrCat("\"targets\":", nlohmann::json(pattern).dump())));
    const JobSpec again = MustParse(json);
    EXPECT_EQ(again.lora.targets_pattern, pattern);
    EXPECT_TRUE(again.lora.targets.empty());
  }
}

// JobSpecToJson writes every field, and ParseJobSpec reads it back to the same spec.
TEST(JobSpecTest, JsonFormRoundTrips) {
  for (const char* text : {kFullYaml, kFullJson, kMinimalPrefix}) {
    std::string source = text;
    if (source == kMinimalPrefix) source += "train: {epochs: 2}\n";
    const JobSpec spec = MustParse(source);
    const std::string json = JobSpecToJson(spec);
    EXPECT_EQ(json.find('\n'), std::string::npos) << json;
    absl::StatusOr<JobSpec> again = ParseJobSpec(json, "round-trip");
    ASSERT_TRUE(again.ok()) << again.status() << "\n" << json;
    EXPECT_EQ(JobSpecToJson(*again), json);
  }
  const JobSpec full = MustParse(kFullYaml);
  const std::string json = JobSpecToJson(full);
  EXPECT_THAT(json, HasSubstr(R"("method":"qlora")"));
  EXPECT_THAT(json, HasSubstr(R"("micro_batch":4)"));
  EXPECT_THAT(json, HasSubstr(R"("memory_per_rank":85899345920)"));
  EXPECT_THAT(json, HasSubstr(R"("zero_stage":3)"));
  const std::string minimal =
      JobSpecToJson(MustParse(std::string(kMinimalPrefix) + "train: {epochs: 2}\n"));
  EXPECT_THAT(minimal, HasSubstr(R"("micro_batch":"auto")"));
  EXPECT_THAT(minimal, HasSubstr(R"("memory_per_rank":null)"));
  EXPECT_THAT(minimal, HasSubstr(R"("strategy":"auto")"));
  EXPECT_THAT(minimal, Not(HasSubstr("init_from")));
}

TEST(JobSpecTest, StrategyAutoVersusMap) {
  JobSpec automatic =
      MustParse(std::string(kMinimalPrefix) + "train: {steps: 1}\nstrategy: auto\n");
  EXPECT_TRUE(IsAutomatic(automatic.strategy));

  JobSpec quoted =
      MustParse(std::string(kMinimalPrefix) + "train: {steps: 1}\nstrategy: \"auto\"\n");
  EXPECT_TRUE(IsAutomatic(quoted.strategy));

  JobSpec map = MustParse(std::string(kMinimalPrefix) +
                          "train: {steps: 1}\nstrategy: {zero_stage: 2, chunked_loss: true}\n");
  EXPECT_FALSE(IsAutomatic(map.strategy));
  EXPECT_EQ(map.strategy.zero_stage, 2);
  EXPECT_EQ(map.strategy.chunked_loss, true);
  EXPECT_EQ(map.strategy.offload_optimizer, false);
  EXPECT_EQ(map.strategy.offload_params, false);
  EXPECT_EQ(map.strategy.activation_checkpointing, false);
  EXPECT_TRUE(map.strategy.fused_kernels);
  EXPECT_TRUE(quoted.strategy.fused_kernels);
  JobSpec unfused = MustParse(std::string(kMinimalPrefix) +
                              "train: {steps: 1}\nstrategy: {fused_kernels: false}\n");
  EXPECT_FALSE(unfused.strategy.fused_kernels);

  // An empty map still fixes the strategy: ZeRO-0, nothing offloaded.
  JobSpec empty = MustParse(std::string(kMinimalPrefix) + "train: {steps: 1}\nstrategy: {}\n");
  EXPECT_FALSE(IsAutomatic(empty.strategy));
  EXPECT_EQ(empty.strategy.zero_stage, 0);
}

TEST(JobSpecTest, StrategyFieldsLeftToThePlanner) {
  JobSpec partial = MustParse(std::string(kMinimalPrefix) +
                              "train: {steps: 1}\nresources: {ranks: 2}\n"
                              "strategy: {zero_stage: auto, offload_params: true, "
                              "activation_checkpointing: auto}\n");
  EXPECT_FALSE(IsAutomatic(partial.strategy));
  EXPECT_EQ(partial.strategy.zero_stage, std::nullopt);  // the planner's
  EXPECT_EQ(partial.strategy.activation_checkpointing, std::nullopt);
  EXPECT_EQ(partial.strategy.offload_optimizer, false);  // left out: fixed at its default
  EXPECT_EQ(partial.strategy.offload_params, true);      // the planner then needs ZeRO-3
  // Round trip through the JSON form keeps the auto fields.
  absl::StatusOr<JobSpec> back = ParseJobSpec(JobSpecToJson(partial), "spec.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->strategy.zero_stage, std::nullopt);
  EXPECT_EQ(back->strategy.activation_checkpointing, std::nullopt);
  EXPECT_EQ(back->strategy.offload_params, true);

  absl::StatusOr<JobSpec> bad = ParseJobSpec(
      std::string(kMinimalPrefix) + "train: {steps: 1}\nstrategy: {fused_kernels: auto}\n",
      "spec.yaml");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("strategy.fused_kernels"));
}

TEST(JobSpecTest, MicroBatchAndMemoryForms) {
  JobSpec spec = MustParse(std::string(kMinimalPrefix) +
                           "train: {steps: 1, global_batch: 12, micro_batch: 3}\n"
                           "resources: {ranks: 2, memory_per_rank: 1073741824}\n");
  EXPECT_EQ(spec.strategy.micro_batch, 3);
  EXPECT_EQ(spec.resources.memory_per_rank, uint64_t{1} << 30);

  spec = MustParse(std::string(kMinimalPrefix) +
                   "train: {steps: 1, micro_batch: auto}\nresources: {memory_per_rank: 1.5GB}\n");
  EXPECT_EQ(spec.strategy.micro_batch, std::nullopt);
  EXPECT_EQ(spec.resources.memory_per_rank, 1500000000u);

  // strategy: auto leaves the micro-batch as train.micro_batch says.
  spec = MustParse(std::string(kMinimalPrefix) +
                   "train: {steps: 1, global_batch: 12, micro_batch: 3}\nstrategy: auto\n");
  EXPECT_TRUE(IsAutomatic(spec.strategy));
  EXPECT_EQ(spec.strategy.micro_batch, 3);
}

TEST(JobSpecTest, AMapWithEveryFieldAutoIsStrategyAuto) {
  const JobSpec spec = MustParse(std::string(kMinimalPrefix) +
                                 "train: {steps: 1}\nstrategy: {zero_stage: auto, "
                                 "offload_optimizer: auto, offload_params: auto, "
                                 "activation_checkpointing: auto, chunked_loss: auto}\n");
  EXPECT_TRUE(IsAutomatic(spec.strategy));
  EXPECT_THAT(JobSpecToJson(spec), HasSubstr(R"("strategy":"auto")"));
}

TEST(JobSpecTest, SeedTakesTheFullUnsignedRange) {
  JobSpec spec =
      MustParse(std::string(kMinimalPrefix) + "train: {steps: 1, seed: 18446744073709551615}\n");
  EXPECT_EQ(spec.train.seed, 18446744073709551615u);
}

TEST(JobSpecTest, EnumNames) {
  EXPECT_EQ(MethodName(Method::kLora), "lora");
  EXPECT_EQ(MethodName(Method::kFull), "full");
  EXPECT_EQ(MethodName(Method::kQLora), "qlora");
  EXPECT_EQ(ScheduleKindName(ScheduleKind::kCosine), "cosine");
  EXPECT_EQ(ScheduleKindName(ScheduleKind::kLinear), "linear");
  EXPECT_EQ(ScheduleKindName(ScheduleKind::kConstant), "constant");
  EXPECT_EQ(OptimizerKindName(OptimizerKind::kAdamW), "adamw");
  EXPECT_EQ(OptimizerKindName(OptimizerKind::kAdamW8bit), "adamw8bit");
  EXPECT_EQ(OptimizerKindName(OptimizerKind::kAdafactor), "adafactor");
  EXPECT_EQ(OptimizerKindName(OptimizerKind::kSgd), "sgd");
  EXPECT_EQ(PrecisionName(Precision::kFp32), "fp32");
  EXPECT_EQ(PrecisionName(Precision::kBf16), "bf16");
  EXPECT_EQ(PrecisionName(Precision::kFp16), "fp16");
  EXPECT_EQ(DeviceKindName(DeviceKind::kCpu), "cpu");
  EXPECT_EQ(DeviceKindName(DeviceKind::kCuda), "cuda");
}

// A valid spec with the top-level sections in `overrides` replaced (an empty value removes
// the section).
std::string SpecWith(const std::map<std::string, std::string>& overrides) {
  std::map<std::string, std::string> sections = {
      {"name", "t"},    {"model", "{path: /m}"},  {"data", "{train: /d}"},
      {"output", "/o"}, {"train", "{steps: 10}"},
  };
  for (const auto& [key, value] : overrides) sections[key] = value;
  std::string text;
  for (const auto& [key, value] : sections) {
    if (!value.empty()) text += key + ": " + value + "\n";
  }
  return text;
}

struct ErrorCase {
  std::map<std::string, std::string> overrides;
  std::string message;  // a fragment of the expected message
};

TEST(JobSpecTest, RejectsBadFields) {
  const std::vector<ErrorCase> cases = {
      // Required fields.
      {{{"name", ""}}, "job.yaml: name: required field is missing"},
      {{{"model", ""}}, "job.yaml: model.path: required field is missing"},
      {{{"model", "{}"}}, "job.yaml: model.path: required field is missing"},
      {{{"model", "{path: ''}"}}, "job.yaml: model.path: must not be empty"},
      {{{"data", ""}}, "job.yaml: data.train: required field is missing"},
      {{{"data", "{seq_len: 8}"}}, "job.yaml: data.train: required field is missing"},
      {{{"output", ""}}, "job.yaml: output: required field is missing"},
      {{{"output", "~"}}, "job.yaml: output: expected a string, got null"},
      // Unknown fields, at every level.
      {{{"outptu", "/x"}}, "job.yaml: outptu: unknown field"},
      {{{"model", "{path: /m, revision: main}"}}, "job.yaml: model.revision: unknown field"},
      {{{"data", "{train: /d, seqlen: 8}"}}, "job.yaml: data.seqlen: unknown field"},
      {{{"lora", "{rnak: 8}"}}, "job.yaml: lora.rnak: unknown field"},
      // PEFT's options that Lathe lacks, on: not supported.
      {{{"lora", "{use_dora: true}"}},
       "job.yaml: lora.use_dora: PEFT's use_dora is not supported by Lathe, got true"},
      {{{"lora", "{fan_in_fan_out: true}"}}, "job.yaml: lora.fan_in_fan_out: PEFT's"},
      {{{"lora", "{init_lora_weights: gaussian}"}},
       "job.yaml: lora.init_lora_weights: PEFT's init_lora_weights is not supported by Lathe, "
       "got \"gaussian\""},
      {{{"lora", "{init_lora_weights: false}"}}, "job.yaml: lora.init_lora_weights: PEFT's"},
      {{{"lora", "{bias: all}"}},
       "job.yaml: lora.bias: PEFT's bias is not supported by Lathe, got \"all\""},
      {{{"lora", "{layers_to_transform: [0, 1]}"}},
       "job.yaml: lora.layers_to_transform: PEFT's layers_to_transform is not supported by "
       "Lathe, got a list"},
      {{{"lora", "{layers_pattern: layers}"}}, "job.yaml: lora.layers_pattern: PEFT's"},
      {{{"lora", "{lora_bias: true}"}}, "job.yaml: lora.lora_bias: PEFT's"},
      {{{"lora", "{megatron_config: {a: 1}}"}}, "job.yaml: lora.megatron_config: PEFT's"},
      {{{"lora", "{loftq_config: {loftq_bits: 4}}"}}, "job.yaml: lora.loftq_config: PEFT's"},
      {{{"lora", "{layer_replication: [[0, 2]]}"}}, "job.yaml: lora.layer_replication: PEFT's"},
      {{{"lora", "{use_dora: 'false'}"}}, "job.yaml: lora.use_dora: PEFT's"},
      {{{"train", "{steps: 10, lrr: 0.1}"}}, "job.yaml: train.lrr: unknown field"},
      {{{"train", "{steps: 10, schedule: {kind: cosine, warmup: 5}}"}},
       "job.yaml: train.schedule.warmup: unknown field"},
      {{{"resources", "{gpus: 8}"}}, "job.yaml: resources.gpus: unknown field"},
      {{{"strategy", "{zero: 3}"}}, "job.yaml: strategy.zero: unknown field"},
      {{{"train", "{steps: 10, steps: 20}"}}, "job.yaml: train.steps: given more than once"},
      // Wrong types.
      {{{"train", "{steps: 10, lr: abc}"}}, "job.yaml: train.lr: expected a number, got \"abc\""},
      {{{"train", "{steps: 10, lr: '2e-4'}"}},
       "job.yaml: train.lr: expected a number, got \"2e-4\""},
      {{{"train", "{steps: 10, lr: [1]}"}}, "job.yaml: train.lr: expected a number, got a list"},
      {{{"train", "{steps: 1.5}"}}, "job.yaml: train.steps: expected an integer, got 1.5"},
      {{{"train", "{steps: 99999999999999999999}"}},
       "job.yaml: train.steps: 99999999999999999999 is out of range"},
      // Sizes are bounded: none of them may size an absurd allocation or overflow.
      {{{"train", "{steps: 9223372036854775807}"}},
       "job.yaml: train.steps: must be <= 1000000000, got 9223372036854775807"},
      {{{"train", "{steps: 10, global_batch: 1000000000}"}},
       "job.yaml: train.global_batch: must be <= 1048576, got 1000000000"},
      {{{"lora", "{rank: 1000000000}"}}, "job.yaml: lora.rank: must be <= 65536, got 1000000000"},
      {{{"data", "{train: /d, seq_len: 100000000}"}},
       "job.yaml: data.seq_len: must be <= 1048576, got 100000000"},
      {{{"resources", "{ranks: 100000}"}},
       "job.yaml: resources.ranks: must be <= 4096, got 100000"},
      {{{"max_restarts", "1000"}}, "job.yaml: max_restarts: must be <= 100, got 1000"},
      {{{"output", "/" + std::string(5000, 'x')}},
       "job.yaml: output: must be at most 4096 bytes, got 5001"},
      {{{"train", "{steps: 10, micro_batch: fast}"}},
       "job.yaml: train.micro_batch: expected an integer or \"auto\", got \"fast\""},
      {{{"data", "{train: /d, pack: yes}"}},
       "job.yaml: data.pack: expected true or false, got \"yes\""},
      {{{"data", "{train: [a, b]}"}}, "job.yaml: data.train: expected a string, got a list"},
      {{{"data", "/d"}}, "job.yaml: data: expected a map, got \"/d\""},
      {{{"lora", "{targets: {q_proj: 1}}"}},
       "job.yaml: lora.targets: expected a list or a string (all-linear or a regular "
       "expression), got a map"},
      {{{"lora", "{targets: '(q|v_proj'}"}},
       "job.yaml: lora.targets: \"(q|v_proj\" is not a regular expression: "},
      {{{"lora", "{targets: ''}"}}, "job.yaml: lora.targets: must not be empty"},
      {{{"lora", "{targets: [q_proj, {a: 1}]}"}},
       "job.yaml: lora.targets[1]: expected a string, got a map"},
      {{{"strategy", "manual"}}, "job.yaml: strategy: expected \"auto\" or a map, got \"manual\""},
      {{{"strategy", "{offload_optimizer: 1}"}},
       "job.yaml: strategy.offload_optimizer: expected true or false, got 1"},
      {{{"priority", "high"}}, "job.yaml: priority: expected an integer, got \"high\""},
      {{{"resources", "{memory_per_rank: [1]}"}},
       "job.yaml: resources.memory_per_rank: expected a byte size such as 80GiB, got a list"},
      // Unknown enum values.
      {{{"method", "prefix"}},
       "job.yaml: method: unknown value \"prefix\" (expected one of: lora, full, qlora, mezo)"},
      {{{"train", "{steps: 10, schedule: {kind: step}}"}},
       "job.yaml: train.schedule.kind: unknown value \"step\" (expected one of: cosine, linear, "
       "constant)"},
      {{{"train", "{steps: 10, optimizer: adam}"}},
       "job.yaml: train.optimizer: unknown value \"adam\" (expected one of: adamw, adamw8bit, "
       "adafactor, sgd)"},
      {{{"train", "{steps: 10, precision: fp8}"}},
       "job.yaml: train.precision: unknown value \"fp8\" (expected one of: fp32, bf16, fp16)"},
      {{{"resources", "{device: tpu}"}},
       "job.yaml: resources.device: unknown value \"tpu\" (expected one of: cpu, cuda)"},
      // Ranges.
      {{{"name", "\"has space\""}},
       "job.yaml: name: \"has space\" must be 1 to 63 characters from A-Z a-z 0-9 . _ -"},
      {{{"name", std::string(64, 'a')}}, "job.yaml: name: "},
      {{{"name", "a/b"}}, "job.yaml: name: \"a/b\" must be 1 to 63 characters"},
      {{{"lora", "{rank: 0}"}}, "job.yaml: lora.rank: must be >= 1, got 0"},
      {{{"lora", "{alpha: 0}"}}, "job.yaml: lora.alpha: must be > 0, got 0"},
      {{{"lora", "{alpha: -1.5}"}}, "job.yaml: lora.alpha: must be > 0, got -1.5"},
      {{{"lora", "{dropout: 1.0}"}}, "job.yaml: lora.dropout: must be in [0, 1), got 1"},
      {{{"lora", "{dropout: -0.1}"}}, "job.yaml: lora.dropout: must be in [0, 1), got -0.1"},
      {{{"lora", "{targets: []}"}}, "job.yaml: lora.targets: must not be empty"},
      {{{"lora", "{targets: [q_proj, k_proj, qproj]}"}},
       "job.yaml: lora.targets[2]: unknown module \"qproj\" (expected one of: q_proj, k_proj, "
       "v_proj, qkv_proj, o_proj, gate_proj, up_proj, gate_up_proj, down_proj)"},
      {{{"lora", "{targets: [self_attn.qproj]}"}},
       "job.yaml: lora.targets[0]: unknown module \"self_attn.qproj\""},
      {{{"lora", "{targets: [q_proj, v_proj, q_proj]}"}},
       "job.yaml: lora.targets[2]: duplicate \"q_proj\""},
      {{{"lora", "{init_from: ''}"}}, "job.yaml: lora.init_from: must not be empty"},
      {{{"lora", "{modules_to_save: lm_head}"}},
       "job.yaml: lora.modules_to_save: expected a list, got \"lm_head\""},
      {{{"lora", "{modules_to_save: [lm_head, q_proj]}"}},
       "job.yaml: lora.modules_to_save: \"q_proj\" is not a module Lathe trains whole "
       "(embed_tokens, model.embed_tokens or lm_head)"},
      {{{"lora", "{modules_to_save: [head]}"}},
       "job.yaml: lora.modules_to_save: \"head\" is not a module Lathe trains whole"},
      {{{"method", "full"}, {"lora", "{modules_to_save: [lm_head]}"}},
       "job.yaml: lora.modules_to_save: only with method lora or qlora, not full"},
      {{{"lora", "{rank_pattern: [q_proj]}"}},
       "job.yaml: lora.rank_pattern: expected a map, got a list"},
      {{{"lora", "{rank_pattern: {q_proj: 2.5}}"}},
       "job.yaml: lora.rank_pattern.q_proj: expected an integer, got 2.5"},
      {{{"lora", "{rank_pattern: {q_proj: 0}}"}},
       "job.yaml: lora.rank_pattern.q_proj: must be >= 1, got 0"},
      {{{"lora", "{rank_pattern: {'(q': 4}}"}},
       "job.yaml: lora.rank_pattern: key \"(q\" is not a regular expression"},
      {{{"lora", "{alpha_pattern: {q_proj: fast}}"}},
       "job.yaml: lora.alpha_pattern.q_proj: expected a number, got \"fast\""},
      {{{"lora", "{alpha_pattern: {q_proj: 0}}"}},
       "job.yaml: lora.alpha_pattern.q_proj: must be > 0, got 0"},
      {{{"lora", "{alpha_pattern: {q_proj: 1, q_proj: 2}}"}}, "job.yaml: lora.alpha_pattern"},
      {{{"data", "{train: /d, seq_len: 1}"}}, "job.yaml: data.seq_len: must be >= 2, got 1"},
      {{{"train", "{steps: 10, lr: 0}"}}, "job.yaml: train.lr: must be > 0, got 0"},
      {{{"train", "{steps: 10, lr: -1e-4}"}}, "job.yaml: train.lr: must be > 0, got -0.0001"},
      {{{"train", "{steps: 10, lr: .inf}"}}, "job.yaml: train.lr: must be finite, got .inf"},
      {{{"train", "{steps: 10, lr: .nan}"}}, "job.yaml: train.lr: must be finite, got .nan"},
      {{{"train", "{steps: 10, lr: 1e999}"}}, "job.yaml: train.lr: 1e999 is out of range"},
      {{{"train", "{steps: 10, schedule: {warmup_steps: -1}}"}},
       "job.yaml: train.schedule.warmup_steps: must be >= 0, got -1"},
      {{{"train", "{steps: 10, schedule: {warmup_steps: 10}}"}},
       "job.yaml: train.schedule.warmup_steps: must be < train.steps 10, got 10"},
      {{{"train", "{steps: 10, weight_decay: -0.1}"}},
       "job.yaml: train.weight_decay: must be >= 0, got -0.1"},
      {{{"train", "{steps: 10, max_grad_norm: -1}"}},
       "job.yaml: train.max_grad_norm: must be >= 0, got -1"},
      {{{"train", "{steps: 10, global_batch: 0}"}},
       "job.yaml: train.global_batch: must be >= 1, got 0"},
      {{{"train", "{steps: 10, micro_batch: 0}"}},
       "job.yaml: train.micro_batch: must be >= 1, got 0"},
      {{{"train", "{steps: 10, global_batch: 12, micro_batch: 4}"}, {"resources", "{ranks: 2}"}},
       "job.yaml: train.micro_batch: 4 does not divide train.global_batch 12 over 2 ranks"},
      {{{"train", "{steps: 10, global_batch: 4, micro_batch: 8}"}},
       "job.yaml: train.micro_batch: 8 does not divide train.global_batch 4 over 1 rank"},
      {{{"train", "{steps: 10, global_batch: 6}"}, {"resources", "{ranks: 4}"}},
       "job.yaml: train.global_batch: 6 is not divisible by resources.ranks 4"},
      {{{"train", "{global_batch: 8}"}},
       "job.yaml: train.steps: exactly one of train.steps and train.epochs must be > 0, got "
       "neither"},
      {{{"train", ""}}, "job.yaml: train.steps: exactly one of train.steps and train.epochs"},
      {{{"train", "{steps: 10, epochs: 1}"}},
       "job.yaml: train.steps: exactly one of train.steps and train.epochs must be > 0, got both"},
      {{{"train", "{steps: -5}"}}, "job.yaml: train.steps: must be >= 0, got -5"},
      {{{"train", "{epochs: -1}"}}, "job.yaml: train.epochs: must be >= 0, got -1"},
      {{{"train", "{steps: 10, adam_beta1: 1}"}},
       "job.yaml: train.adam_beta1: must be in [0, 1), got 1"},
      {{{"train", "{steps: 10, adam_beta2: -0.5}"}},
       "job.yaml: train.adam_beta2: must be in [0, 1), got -0.5"},
      {{{"train", "{steps: 10, adam_eps: 0}"}}, "job.yaml: train.adam_eps: must be > 0, got 0"},
      {{{"method", "lora"}, {"mezo", "{eps: 1.0e-3}"}}, "job.yaml: mezo: is for method: mezo only"},
      {{{"method", "mezo"}, {"mezo", "{eps: 0}"}}, "job.yaml: mezo.eps: must be > 0, got 0"},
      {{{"method", "mezo"}, {"mezo", "{trainable: qlora}"}}, "job.yaml: mezo.trainable: "},
      {{{"method", "mezo"}, {"mezo", "{eps: 1.0e-3, sigma: 2}"}},
       "job.yaml: mezo.sigma: unknown field"},
      {{{"method", "mezo"}, {"train", "{steps: 10, optimizer: sgd}"}},
       "job.yaml: train.optimizer: sgd: method mezo has its own update"},
      {{{"method", "mezo"}, {"train", "{steps: 10, precision: fp16}"}},
       "job.yaml: train.precision: fp16 does not go with method mezo"},
      {{{"train", "{steps: 10, sgd_momentum: 1}"}},
       "job.yaml: train.sgd_momentum: must be in [0, 1), got 1"},
      {{{"train", "{steps: 10, optimizer: sgd, sgd_nesterov: true}"}},
       "job.yaml: train.sgd_nesterov: needs train.sgd_momentum > 0"},
      {{{"train", "{steps: 10, sgd_nesterov: maybe}"}}, "job.yaml: train.sgd_nesterov: "},
      {{{"train", "{steps: 10, adafactor_relative_step: 2}"}},
       "job.yaml: train.adafactor_relative_step: "},
      {{{"train", "{steps: 10, adafactor_beta1: -0.1}"}},
       "job.yaml: train.adafactor_beta1: must be in [0, 1), got -0.1"},
      {{{"train", "{steps: 10, adafactor_decay_rate: 0}"}},
       "job.yaml: train.adafactor_decay_rate: must be in [-1, 0), got 0"},
      {{{"train", "{steps: 10, adafactor_clip_threshold: 0}"}},
       "job.yaml: train.adafactor_clip_threshold: must be > 0, got 0"},
      {{{"train", "{steps: 10, checkpoint_every: -1}"}},
       "job.yaml: train.checkpoint_every: must be >= 0, got -1"},
      {{{"train", "{steps: 10, keep_checkpoints: 0}"}},
       "job.yaml: train.keep_checkpoints: must be >= 1, got 0"},
      {{{"train", "{steps: 10, eval_every: -2}"}},
       "job.yaml: train.eval_every: must be >= 0, got -2"},
      {{{"train", "{steps: 10, max_nonfinite_steps: 0}"}},
       "job.yaml: train.max_nonfinite_steps: must be >= 1, got 0"},
      {{{"train", "{steps: 10, seed: -1}"}},
       "job.yaml: train.seed: must be a non-negative integer, got -1"},
      {{{"train", "{steps: 10, seed: 0.5}"}},
       "job.yaml: train.seed: expected a non-negative integer, got 0.5"},
      {{{"resources", "{ranks: 0}"}}, "job.yaml: resources.ranks: must be >= 1, got 0"},
      {{{"resources", "{memory_per_rank: 80GB/s}"}},
       "job.yaml: resources.memory_per_rank: invalid byte size \"80GB/s\": unknown unit"},
      {{{"resources", "{memory_per_rank: -1GiB}"}},
       "job.yaml: resources.memory_per_rank: invalid byte size \"-1GiB\": negative"},
      {{{"resources", "{memory_per_rank: 0}"}}, "job.yaml: resources.memory_per_rank: must be > 0"},
      {{{"strategy", "{zero_stage: 4}"}},
       "job.yaml: strategy.zero_stage: must be 0, 1, 2 or 3, got 4"},
      {{{"strategy", "{zero_stage: -1}"}},
       "job.yaml: strategy.zero_stage: must be 0, 1, 2 or 3, got -1"},
      {{{"strategy", "{zero_stage: 2, offload_params: true}"}},
       "job.yaml: strategy.offload_params: requires zero_stage 3, got zero_stage 2"},
      {{{"max_restarts", "-1"}}, "job.yaml: max_restarts: must be >= 0, got -1"},
  };
  for (const ErrorCase& c : cases) {
    const std::string text = SpecWith(c.overrides);
    SCOPED_TRACE(text);
    absl::StatusOr<JobSpec> spec = ParseJobSpec(text, kSource);
    ASSERT_FALSE(spec.ok());
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(spec.status().message()), HasSubstr(c.message));
    EXPECT_THAT(std::string(spec.status().message()), Not(HasSubstr("\n")));
  }
}

TEST(JobSpecTest, RejectsBadJson) {
  absl::StatusOr<JobSpec> spec = ParseJobSpec(
      R"({"name": "t", "model": {"path": "/m"}, "data": {"train": "/d"}, "output": "/o",
          "train": {"steps": "10"}})",
      "job.json");
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()),
              HasSubstr("job.json: train.steps: expected an integer, got \"10\""));

  spec = ParseJobSpec(
      R"({"name": "t", "model": {"path": "/m"}, "data": {"train": "/d"}, "output": "/o",
          "train": {"steps": 10, "lrr": 0.1}})",
      "job.json");
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()),
              HasSubstr("job.json: train.lrr: unknown field"));
}

TEST(JobSpecTest, RejectsMalformedDocuments) {
  struct Case {
    std::string text;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"", "job.yaml: empty job spec"},
      {"# only a comment\n", "job.yaml: empty job spec"},
      {"- a\n- b\n", "job.yaml: expected a map at the top level, got a list"},
      {"just text\n", "job.yaml: expected a map at the top level, got \"just text\""},
      {"name: t\ntrain: {steps: [1\n", "job.yaml: line 3, column 1: invalid YAML: "},
      {"name: a: b\n", "job.yaml: line 1, column 8: invalid YAML: illegal map value"},
      // yaml-cpp reads the empty entry as a null key.
      {"{\"name\": \"t\",, }", "job.yaml: field names must be strings, got null"},
      {"\"\": 1\n", "job.yaml: \"\": unknown field"},
      {"name: t\nname: u\n", "job.yaml: name: given more than once"},
      // Found by fuzz/job_spec_fuzzer: yaml-cpp's message ends with the byte it stopped at.
      {"name: \"a\\\x01\"\n", "invalid YAML: unknown escape character: \\x01"},
      {"name: \"a\\\xff\"\n", "invalid YAML: unknown escape character: \\xff"},
      // Found by fuzz/job_spec_fuzzer: unknown keys were shown as they are.
      {"data: {\"tr\\tain\": /d}\n", "job.yaml: data.\"tr\\tain\": unknown field"},
      {"data: {\"tr\\nain\": /d}\n", "job.yaml: data.\"tr\\nain\": unknown field"},
      {std::string(50, 'k') + ": 1\n",
       "job.yaml: \"" + std::string(40, 'k') + "...\": unknown field"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    absl::StatusOr<JobSpec> spec = ParseJobSpec(c.text, kSource);
    ASSERT_FALSE(spec.ok());
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(spec.status().message()), HasSubstr(c.message));
    // One line of printable ASCII, whatever bytes the document holds.
    for (char ch : spec.status().message()) {
      EXPECT_TRUE(ch >= 0x20 && ch < 0x7f) << "byte " << static_cast<int>(ch);
    }
  }
}

TEST(JobSpecTest, MultiLineValueStaysOnOneLineInMessage) {
  absl::StatusOr<JobSpec> spec = ParseJobSpec(
      std::string(kMinimalPrefix) + "train:\n  steps: 10\n  lr: |\n    two\n    lines\n", kSource);
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(spec.status().message()),
            "job.yaml: train.lr: expected a number, got \"two\\nlines\\n\"");
}

TEST(JobSpecTest, LoadsFromFile) {
  const std::filesystem::path path =
      std::filesystem::path(::testing::TempDir()) / "job_spec_test_load.yaml";
  {
    std::ofstream out(path);
    out << kFullYaml;
  }
  absl::StatusOr<JobSpec> spec = LoadJobSpec(path.string());
  ASSERT_TRUE(spec.ok()) << spec.status();
  ExpectFullSpec(*spec);

  {
    std::ofstream out(path);
    out << "name: t\n";
  }
  spec = LoadJobSpec(path.string());
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()),
              HasSubstr(path.string() + ": model.path: required field is missing"));
  std::filesystem::remove(path);
}

TEST(JobSpecTest, LoadReportsMissingFile) {
  const std::string path = ::testing::TempDir() + "/job_spec_test_no_such_file.yaml";
  absl::StatusOr<JobSpec> spec = LoadJobSpec(path);
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("job_spec_test_no_such_file.yaml"));
}

TEST(ByteSizeTest, ParsesUnits) {
  struct Case {
    std::string text;
    uint64_t bytes;
  };
  const std::vector<Case> cases = {
      {"0", 0},
      {"1024", 1024},
      {"512B", 512},
      {"2KB", 2000},
      {"2kB", 2000},
      {"3MB", 3000000},
      {"1.5GB", 1500000000},
      {"2TB", 2000000000000},
      {"4KiB", 4096},
      {"0.5KiB", 512},
      {"1MiB", 1048576},
      {"80GiB", uint64_t{80} << 30},
      {"1.25GiB", (uint64_t{5} << 30) / 4},
      {"2TiB", uint64_t{2} << 40},
      {" 80 GiB ", uint64_t{80} << 30},
      {".5KB", 500},
      {"18446744073709551615", 18446744073709551615u},
      {"16777215TiB", uint64_t{16777215} << 40},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    absl::StatusOr<uint64_t> bytes = ParseByteSize(c.text);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    EXPECT_EQ(*bytes, c.bytes);
  }
}

TEST(ByteSizeTest, RejectsBadSizes) {
  struct Case {
    std::string text;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"", "invalid byte size \"\": empty"},
      {"   ", "empty"},
      {"-1", "invalid byte size \"-1\": negative"},
      {"-1GiB", "negative"},
      {"GiB", "expected a number"},
      {"80XB",
       "invalid byte size \"80XB\": unknown unit \"XB\" (expected B, KB, MB, GB, TB, "
       "KiB, MiB, GiB or TiB)"},
      {"80gib", "unknown unit \"gib\""},
      {"80 GiB extra", "unknown unit"},
      {"1.GiB", "expected digits after the decimal point"},
      {"1e9", "unknown unit \"e9\""},
      {"1.5B", "not a whole number of bytes"},
      {"0.3", "not a whole number of bytes"},
      {"18446744073709551616", "overflows 64 bits"},
      {"16777216TiB", "overflows 64 bits"},
      {"99999999999999999999999", "overflows 64 bits"},
      {"1.0000000000000000001KB", "too many decimal places"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    absl::StatusOr<uint64_t> bytes = ParseByteSize(c.text);
    ASSERT_FALSE(bytes.ok());
    EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(bytes.status().message()), HasSubstr(c.message));
  }
}

}  // namespace
}  // namespace lathe
