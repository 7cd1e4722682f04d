#include "common/proto/job_spec_proto.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "lathe/v1/job.pb.h"
#include "nlohmann/json.hpp"

namespace lathe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// Compares every field, so that a field the conversion forgets shows up by name.
void ExpectSameSpec(const JobSpec& actual, const JobSpec& expected) {
  EXPECT_EQ(actual.name, expected.name);
  EXPECT_EQ(actual.model.path, expected.model.path);
  EXPECT_EQ(actual.data.train, expected.data.train);
  EXPECT_EQ(actual.data.eval, expected.data.eval);
  EXPECT_EQ(actual.data.seq_len, expected.data.seq_len);
  EXPECT_EQ(actual.data.pack, expected.data.pack);
  EXPECT_EQ(actual.method, expected.method);
  EXPECT_EQ(actual.lora.rank, expected.lora.rank);
  EXPECT_EQ(actual.lora.alpha, expected.lora.alpha);
  EXPECT_EQ(actual.lora.dropout, expected.lora.dropout);
  EXPECT_EQ(actual.lora.targets, expected.lora.targets);
  EXPECT_EQ(actual.lora.use_rslora, expected.lora.use_rslora);
  EXPECT_EQ(actual.lora.init_from, expected.lora.init_from);
  EXPECT_EQ(actual.train.steps, expected.train.steps);
  EXPECT_EQ(actual.train.epochs, expected.train.epochs);
  EXPECT_EQ(actual.train.global_batch, expected.train.global_batch);
  EXPECT_EQ(actual.strategy.micro_batch, expected.strategy.micro_batch);
  EXPECT_EQ(actual.train.lr, expected.train.lr);
  EXPECT_EQ(actual.train.schedule.kind, expected.train.schedule.kind);
  EXPECT_EQ(actual.train.schedule.warmup_steps, expected.train.schedule.warmup_steps);
  EXPECT_EQ(actual.train.optimizer, expected.train.optimizer);
  EXPECT_EQ(actual.train.adam_beta1, expected.train.adam_beta1);
  EXPECT_EQ(actual.train.adam_beta2, expected.train.adam_beta2);
  EXPECT_EQ(actual.train.adam_eps, expected.train.adam_eps);
  EXPECT_EQ(actual.train.weight_decay, expected.train.weight_decay);
  EXPECT_EQ(actual.train.sgd_momentum, expected.train.sgd_momentum);
  EXPECT_EQ(actual.train.sgd_nesterov, expected.train.sgd_nesterov);
  EXPECT_EQ(actual.train.adafactor_beta1, expected.train.adafactor_beta1);
  EXPECT_EQ(actual.train.adafactor_decay_rate, expected.train.adafactor_decay_rate);
  EXPECT_EQ(actual.train.adafactor_clip_threshold, expected.train.adafactor_clip_threshold);
  EXPECT_EQ(actual.train.adafactor_relative_step, expected.train.adafactor_relative_step);
  EXPECT_EQ(actual.train.paged_optimizer, expected.train.paged_optimizer);
  EXPECT_EQ(actual.train.max_grad_norm, expected.train.max_grad_norm);
  EXPECT_EQ(actual.train.precision, expected.train.precision);
  EXPECT_EQ(actual.train.seed, expected.train.seed);
  EXPECT_EQ(actual.train.checkpoint_every, expected.train.checkpoint_every);
  EXPECT_EQ(actual.train.keep_checkpoints, expected.train.keep_checkpoints);
  EXPECT_EQ(actual.train.eval_every, expected.train.eval_every);
  EXPECT_EQ(actual.train.max_nonfinite_steps, expected.train.max_nonfinite_steps);
  EXPECT_EQ(actual.resources.ranks, expected.resources.ranks);
  EXPECT_EQ(actual.resources.device, expected.resources.device);
  EXPECT_EQ(actual.resources.memory_per_rank, expected.resources.memory_per_rank);
  EXPECT_EQ(actual.strategy.zero_stage, expected.strategy.zero_stage);
  EXPECT_EQ(actual.strategy.offload_optimizer, expected.strategy.offload_optimizer);
  EXPECT_EQ(actual.strategy.offload_params, expected.strategy.offload_params);
  EXPECT_EQ(actual.strategy.activation_checkpointing, expected.strategy.activation_checkpointing);
  EXPECT_EQ(actual.strategy.chunked_loss, expected.strategy.chunked_loss);
  EXPECT_EQ(actual.strategy.fused_kernels, expected.strategy.fused_kernels);
  EXPECT_EQ(actual.priority, expected.priority);
  EXPECT_EQ(actual.max_restarts, expected.max_restarts);
  EXPECT_EQ(actual.output, expected.output);
}

// Every field set, none at its default; doubles that have no short decimal form.
JobSpec FullSpec() {
  JobSpec spec;
  spec.name = "demo-lora";
  spec.model.path = "/models/qwen2.5-0.5b";
  spec.data.train = "/data/train.jsonl";
  spec.data.eval = "/data/eval \"quoted\".jsonl";
  spec.data.seq_len = 512;
  spec.data.pack = false;
  spec.method = Method::kQLora;
  spec.lora.rank = 8;
  spec.lora.alpha = 16.5;
  spec.lora.dropout = 0.1 / 3;
  spec.lora.targets = {"q_proj", "v_proj", "down_proj"};
  spec.lora.use_rslora = true;
  spec.lora.init_from = "/adapters/start";
  spec.train.steps = 1000;
  spec.train.global_batch = 64;
  spec.strategy.micro_batch = 4;
  spec.train.lr = 2.0e-4 / 3;
  spec.train.schedule.kind = ScheduleKind::kLinear;
  spec.train.schedule.warmup_steps = 50;
  spec.train.optimizer = OptimizerKind::kAdamW8bit;
  spec.train.adam_beta1 = 0.8;
  spec.train.adam_beta2 = 0.95;
  spec.train.adam_eps = 1.0e-6;
  spec.train.weight_decay = 0.01;
  spec.train.sgd_momentum = 0.9 / 7;
  spec.train.sgd_nesterov = true;
  spec.train.adafactor_beta1 = 0.5 / 3;
  spec.train.adafactor_decay_rate = -0.5 / 3;
  spec.train.adafactor_clip_threshold = 2.0 / 3;
  spec.train.adafactor_relative_step = true;
  spec.train.paged_optimizer = true;
  spec.train.max_grad_norm = 0.5;
  spec.train.precision = Precision::kBf16;
  spec.train.seed = UINT64_C(18446744073709551615);
  spec.train.checkpoint_every = 100;
  spec.train.keep_checkpoints = 5;
  spec.train.eval_every = 7;
  spec.train.max_nonfinite_steps = 4;
  spec.resources.ranks = 8;
  spec.resources.device = DeviceKind::kCuda;
  spec.resources.memory_per_rank = UINT64_C(80) << 30;
  spec.strategy.zero_stage = 3;
  spec.strategy.offload_optimizer = true;
  spec.strategy.offload_params = true;
  spec.strategy.activation_checkpointing = true;
  spec.strategy.chunked_loss = true;
  spec.strategy.fused_kernels = false;
  spec.priority = -2;
  spec.max_restarts = 5;
  spec.output = "/runs/demo-lora";
  return spec;
}

// Only what the spec requires.
v1::JobSpec MinimalProto() {
  v1::JobSpec proto;
  proto.set_name("minimal");
  proto.mutable_model()->set_path("/models/m");
  proto.mutable_data()->set_train("/data/t.jsonl");
  proto.mutable_train()->set_steps(10);
  proto.set_output("/runs/minimal");
  return proto;
}

TEST(JobSpecProtoTest, FullSpecRoundTripsThroughProtoAndJson) {
  const JobSpec spec = FullSpec();
  absl::StatusOr<JobSpec> converted = JobSpecFromProto(JobSpecToProto(spec), "spec");
  ASSERT_TRUE(converted.ok()) << converted.status();
  ExpectSameSpec(*converted, spec);

  const std::string json = JobSpecToJson(*converted);
  absl::StatusOr<JobSpec> parsed = ParseJobSpec(json, "spec");
  ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << json;
  ExpectSameSpec(*parsed, spec);
}

TEST(JobSpecProtoTest, MezoRoundTrips) {
  JobSpec spec = FullSpec();
  spec.method = Method::kMezo;
  spec.mezo.trainable = Method::kFull;
  spec.mezo.eps = 1e-2 / 3;
  spec.train.optimizer = OptimizerKind::kAdamW;
  spec.train.paged_optimizer = false;
  spec.train.precision = Precision::kBf16;
  absl::StatusOr<JobSpec> converted = JobSpecFromProto(JobSpecToProto(spec), "spec");
  ASSERT_TRUE(converted.ok()) << converted.status();
  EXPECT_EQ(converted->method, Method::kMezo);
  EXPECT_EQ(converted->mezo.trainable, Method::kFull);
  EXPECT_EQ(converted->mezo.eps, spec.mezo.eps);
}

TEST(JobSpecProtoTest, AutoSpecRoundTrips) {
  JobSpec spec;
  spec.name = "auto";
  spec.model.path = "/models/m";
  spec.data.train = "/data/t.jsonl";
  spec.train.epochs = 2;
  spec.output = "/runs/auto";
  absl::StatusOr<JobSpec> converted = JobSpecFromProto(JobSpecToProto(spec), "spec");
  ASSERT_TRUE(converted.ok()) << converted.status();
  ExpectSameSpec(*converted, spec);
}

TEST(JobSpecProtoTest, ToProtoSetsEveryOptionalScalar) {
  JobSpec spec;
  const v1::JobSpec proto = JobSpecToProto(spec);
  EXPECT_TRUE(proto.data().has_seq_len());
  EXPECT_TRUE(proto.data().has_pack());
  EXPECT_TRUE(proto.lora().has_rank());
  EXPECT_TRUE(proto.lora().has_alpha());
  EXPECT_TRUE(proto.lora().has_dropout());
  EXPECT_TRUE(proto.lora().has_use_rslora());
  EXPECT_EQ(proto.lora().targets_size(), 0);  // every projection of the model
  EXPECT_TRUE(proto.train().has_steps());
  EXPECT_TRUE(proto.train().has_epochs());
  EXPECT_TRUE(proto.train().has_global_batch());
  EXPECT_TRUE(proto.train().has_lr());
  EXPECT_TRUE(proto.train().schedule().has_warmup_steps());
  EXPECT_TRUE(proto.train().has_adam_beta1());
  EXPECT_TRUE(proto.train().has_adam_beta2());
  EXPECT_TRUE(proto.train().has_adam_eps());
  EXPECT_TRUE(proto.train().has_weight_decay());
  EXPECT_TRUE(proto.train().has_max_grad_norm());
  EXPECT_TRUE(proto.train().has_seed());
  EXPECT_TRUE(proto.train().has_checkpoint_every());
  EXPECT_TRUE(proto.resources().has_ranks());
  EXPECT_TRUE(proto.has_priority());
  EXPECT_TRUE(proto.has_max_restarts());
  EXPECT_EQ(proto.method(), v1::METHOD_LORA);
  EXPECT_EQ(proto.train().schedule().kind(), v1::SCHEDULE_KIND_COSINE);
  EXPECT_EQ(proto.train().optimizer(), v1::OPTIMIZER_ADAMW);
  EXPECT_EQ(proto.train().precision(), v1::PRECISION_FP32);
  EXPECT_EQ(proto.resources().device(), v1::DEVICE_CPU);
  // auto: every strategy field absent, the planner's.
  EXPECT_FALSE(proto.strategy().has_zero_stage());
  EXPECT_FALSE(proto.strategy().has_micro_batch());
  EXPECT_TRUE(proto.strategy().fused_kernels());
  // 0 means "not given" in JobSpec, so it stays absent.
  EXPECT_FALSE(proto.resources().has_memory_per_rank_bytes());
}

TEST(JobSpecProtoTest, JsonUsesTheYamlSchema) {
  JobSpec spec = FullSpec();
  nlohmann::json json = nlohmann::json::parse(JobSpecToJson(spec));
  EXPECT_EQ(json["method"], "qlora");
  EXPECT_EQ(json["train"]["optimizer"], "adamw8bit");
  EXPECT_EQ(json["train"]["precision"], "bf16");
  EXPECT_EQ(json["train"]["schedule"]["kind"], "linear");
  EXPECT_EQ(json["train"]["micro_batch"], 4);
  EXPECT_EQ(json["resources"]["device"], "cuda");
  ASSERT_TRUE(json["resources"]["memory_per_rank"].is_number_unsigned());
  EXPECT_EQ(json["resources"]["memory_per_rank"].get<uint64_t>(), UINT64_C(80) << 30);
  EXPECT_EQ(json["strategy"]["zero_stage"], 3);
  EXPECT_EQ(json["strategy"]["chunked_loss"], true);

  spec.strategy = StrategySpec();
  json = nlohmann::json::parse(JobSpecToJson(spec));
  EXPECT_EQ(json["strategy"], "auto");
  EXPECT_EQ(json["train"]["micro_batch"], "auto");
}

TEST(JobSpecProtoTest, AnAbsentStrategyIsAutoAndKeepsFusedKernels) {
  v1::JobSpec proto = MinimalProto();
  absl::StatusOr<JobSpec> spec = JobSpecFromProto(proto, "spec");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(IsAutomatic(spec->strategy));
  EXPECT_TRUE(spec->strategy.fused_kernels);

  proto.mutable_strategy()->set_fused_kernels(false);
  spec = JobSpecFromProto(proto, "spec");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(IsAutomatic(spec->strategy));
  EXPECT_FALSE(spec->strategy.fused_kernels);

  // A present field is fixed, an absent one the planner's.
  proto.mutable_strategy()->set_zero_stage(3);
  spec = JobSpecFromProto(proto, "spec");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_FALSE(IsAutomatic(spec->strategy));
  EXPECT_EQ(spec->strategy.zero_stage, 3);
  EXPECT_EQ(spec->strategy.offload_params, std::nullopt);
}

TEST(JobSpecProtoTest, RequiredFieldsOnlyGiveTheDocumentedDefaults) {
  absl::StatusOr<JobSpec> spec = JobSpecFromProto(MinimalProto(), "spec");
  ASSERT_TRUE(spec.ok()) << spec.status();
  JobSpec expected;
  expected.name = "minimal";
  expected.model.path = "/models/m";
  expected.data.train = "/data/t.jsonl";
  expected.train.steps = 10;
  expected.output = "/runs/minimal";
  ExpectSameSpec(*spec, expected);
  // The documented defaults themselves, not only JobSpec's initializers.
  EXPECT_EQ(spec->data.seq_len, 1024);
  EXPECT_TRUE(spec->data.pack);
  EXPECT_EQ(spec->method, Method::kLora);
  EXPECT_EQ(spec->lora.rank, 16);
  EXPECT_EQ(spec->lora.alpha, 32.0);
  EXPECT_TRUE(spec->lora.targets.empty());  // every projection of the model
  EXPECT_EQ(spec->train.global_batch, 8);
  EXPECT_EQ(spec->strategy.micro_batch, std::nullopt);  // auto
  EXPECT_EQ(spec->train.lr, 2e-4);
  EXPECT_EQ(spec->train.optimizer, OptimizerKind::kAdamW);
  EXPECT_EQ(spec->train.precision, Precision::kFp32);
  EXPECT_EQ(spec->resources.ranks, 1);
  EXPECT_EQ(spec->resources.device, DeviceKind::kCpu);
  EXPECT_EQ(spec->resources.memory_per_rank, 0u);
  EXPECT_TRUE(IsAutomatic(spec->strategy));
  EXPECT_EQ(spec->max_restarts, 3);
}

TEST(JobSpecProtoTest, AnAbsentMicroBatchIsAutoAndZeroIsRefused) {
  v1::JobSpec proto = MinimalProto();
  absl::StatusOr<JobSpec> spec = JobSpecFromProto(proto, "spec");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->strategy.micro_batch, std::nullopt);
  proto.mutable_strategy()->set_micro_batch(0);
  EXPECT_THAT(JobSpecFromProto(proto, "spec").status().message(),
              HasSubstr("spec: train.micro_batch: must be >= 1, got 0"));
}

struct BadProtoCase {
  const char* name;
  std::function<void(v1::JobSpec*)> mutate;
  const char* message;  // expected prefix
};

class JobSpecProtoBadValueTest : public ::testing::TestWithParam<BadProtoCase> {};

TEST_P(JobSpecProtoBadValueTest, IsInvalidArgumentNamingTheField) {
  v1::JobSpec proto = MinimalProto();
  GetParam().mutate(&proto);
  absl::StatusOr<JobSpec> spec = JobSpecFromProto(proto, "spec");
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << spec.status();
  EXPECT_THAT(std::string(spec.status().message()), StartsWith(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, JobSpecProtoBadValueTest,
    ::testing::Values(
        BadProtoCase{"NegativeLr", [](v1::JobSpec* p) { p->mutable_train()->set_lr(-1); },
                     "spec: train.lr: must be > 0, got -1"},
        BadProtoCase{"ZeroRank", [](v1::JobSpec* p) { p->mutable_lora()->set_rank(0); },
                     "spec: lora.rank: must be >= 1, got 0"},
        BadProtoCase{"UnknownTarget",
                     [](v1::JobSpec* p) { p->mutable_lora()->add_targets("qq_proj"); },
                     "spec: lora.targets[0]: unknown module \"qq_proj\""},
        BadProtoCase{"ZeroRanks", [](v1::JobSpec* p) { p->mutable_resources()->set_ranks(0); },
                     "spec: resources.ranks: must be >= 1, got 0"},
        BadProtoCase{"MissingModelPath", [](v1::JobSpec* p) { p->clear_model(); },
                     "spec: model.path: required field is missing"},
        BadProtoCase{"EmptyModelPath", [](v1::JobSpec* p) { p->mutable_model()->clear_path(); },
                     "spec: model.path: required field is missing"},
        BadProtoCase{"MissingName", [](v1::JobSpec* p) { p->clear_name(); },
                     "spec: name: required field is missing"},
        BadProtoCase{"MissingOutput", [](v1::JobSpec* p) { p->clear_output(); },
                     "spec: output: required field is missing"},
        BadProtoCase{"ZeroMemoryPerRank",
                     [](v1::JobSpec* p) { p->mutable_resources()->set_memory_per_rank_bytes(0); },
                     "spec: resources.memory_per_rank: must be > 0"},
        BadProtoCase{"UnknownMethod",
                     [](v1::JobSpec* p) { p->set_method(static_cast<v1::Method>(99)); },
                     "spec: method: unknown value 99"},
        BadProtoCase{"NanLr",
                     [](v1::JobSpec* p) {
                       p->mutable_train()->set_lr(std::numeric_limits<double>::quiet_NaN());
                     },
                     "spec: train.lr: must be finite, got nan"},
        BadProtoCase{"OffloadParamsBelowZero3",
                     [](v1::JobSpec* p) {
                       p->mutable_strategy()->set_zero_stage(2);
                       p->mutable_strategy()->set_offload_params(true);
                     },
                     "spec: strategy.offload_params: requires zero_stage 3"},
        BadProtoCase{"BothStepsAndEpochs",
                     [](v1::JobSpec* p) { p->mutable_train()->set_epochs(1); },
                     "spec: train.steps: exactly one of"}),
    [](const ::testing::TestParamInfo<BadProtoCase>& case_info) { return case_info.param.name; });

// Every plan field survives the proto.
TEST(PlanProtoTest, RoundTrips) {
  Plan plan;
  plan.ranks = 4;
  plan.device = DeviceKind::kCuda;
  plan.strategy.zero_stage = 3;
  plan.strategy.offload_optimizer = true;
  plan.strategy.offload_params = true;
  plan.strategy.activation_checkpointing = true;
  plan.strategy.chunked_loss = true;
  plan.strategy.fused_kernels = false;
  plan.strategy.micro_batch = 2;
  plan.gradient_accumulation = 8;
  plan.total_steps = 1000;
  plan.precision = Precision::kBf16;
  for (size_t i = 0; i < plan.predicted_memory.components.size(); ++i) {
    plan.predicted_memory.components[i] = (i + 1) << 20;
  }
  plan.predicted_memory.total = 99 << 20;
  plan.explanation = "because";
  absl::StatusOr<Plan> back = PlanFromProto(PlanToProto(plan), "task");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->ranks, plan.ranks);
  EXPECT_EQ(back->device, plan.device);
  EXPECT_EQ(back->strategy.zero_stage, plan.strategy.zero_stage);
  EXPECT_EQ(back->strategy.offload_optimizer, plan.strategy.offload_optimizer);
  EXPECT_EQ(back->strategy.offload_params, plan.strategy.offload_params);
  EXPECT_EQ(back->strategy.activation_checkpointing, plan.strategy.activation_checkpointing);
  EXPECT_EQ(back->strategy.chunked_loss, plan.strategy.chunked_loss);
  EXPECT_EQ(back->strategy.fused_kernels, plan.strategy.fused_kernels);
  EXPECT_EQ(back->strategy.micro_batch, plan.strategy.micro_batch);
  EXPECT_EQ(back->gradient_accumulation, plan.gradient_accumulation);
  EXPECT_EQ(back->total_steps, plan.total_steps);
  EXPECT_EQ(back->precision, plan.precision);
  EXPECT_EQ(back->predicted_memory.components, plan.predicted_memory.components);
  EXPECT_EQ(back->predicted_memory.total, plan.predicted_memory.total);
  EXPECT_EQ(back->explanation, plan.explanation);
  EXPECT_EQ(PlanToProto(plan).predicted_memory().activations(), 5u << 20);
  EXPECT_EQ(back->method, std::nullopt);  // the spec's
  EXPECT_EQ(back->optimizer, std::nullopt);
  plan.method = Method::kQLora;
  plan.optimizer = OptimizerKind::kAdamW8bit;
  back = PlanFromProto(PlanToProto(plan), "task");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->method, Method::kQLora);
  EXPECT_EQ(back->optimizer, OptimizerKind::kAdamW8bit);
}

TEST(PlanProtoTest, AnUnknownDeviceIsRefusedNamingTheField) {
  v1::Plan proto = PlanToProto(Plan());
  proto.set_device(static_cast<v1::Device>(7));
  absl::StatusOr<Plan> plan = PlanFromProto(proto, "task.json");
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(plan.status().message()), StartsWith("task.json: plan.device: unknown"));
}

TEST(JobSpecProtoTest, ErrorsNameTheGivenSource) {
  v1::JobSpec proto = MinimalProto();
  proto.mutable_train()->set_lr(-1);
  absl::StatusOr<JobSpec> spec = JobSpecFromProto(proto, "SubmitJob.spec");
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("SubmitJob.spec: train.lr:"));
}

}  // namespace
}  // namespace lathe
