#include "common/proto/job_spec_proto.h"

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "lathe/v1/job.pb.h"
#include "nlohmann/json.hpp"

namespace lathe {
namespace {

using Json = nlohmann::ordered_json;

v1::Method ToProto(Method method) {
  switch (method) {
    case Method::kLora:
      return v1::METHOD_LORA;
    case Method::kFull:
      return v1::METHOD_FULL;
    case Method::kQLora:
      return v1::METHOD_QLORA;
  }
  return v1::METHOD_UNSPECIFIED;
}

v1::ScheduleKind ToProto(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kCosine:
      return v1::SCHEDULE_KIND_COSINE;
    case ScheduleKind::kLinear:
      return v1::SCHEDULE_KIND_LINEAR;
    case ScheduleKind::kConstant:
      return v1::SCHEDULE_KIND_CONSTANT;
  }
  return v1::SCHEDULE_KIND_UNSPECIFIED;
}

v1::Optimizer ToProto(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW:
      return v1::OPTIMIZER_ADAMW;
    case OptimizerKind::kAdamW8bit:
      return v1::OPTIMIZER_ADAMW_8BIT;
    case OptimizerKind::kAdafactor:
      return v1::OPTIMIZER_ADAFACTOR;
    case OptimizerKind::kSgd:
      return v1::OPTIMIZER_SGD;
  }
  return v1::OPTIMIZER_UNSPECIFIED;
}

v1::Precision ToProto(Precision precision) {
  switch (precision) {
    case Precision::kFp32:
      return v1::PRECISION_FP32;
    case Precision::kBf16:
      return v1::PRECISION_BF16;
    case Precision::kFp16:
      return v1::PRECISION_FP16;
  }
  return v1::PRECISION_UNSPECIFIED;
}

v1::Device ToProto(DeviceKind device) {
  switch (device) {
    case DeviceKind::kCpu:
      return v1::DEVICE_CPU;
    case DeviceKind::kCuda:
      return v1::DEVICE_CUDA;
  }
  return v1::DEVICE_UNSPECIFIED;
}

// The YAML spelling of a proto enum value. A value this build does not know (proto3 enums
// are open) is written as its number, so that ParseJobSpec rejects it naming the field
// instead of it being dropped silently.
Json MethodJson(v1::Method method) {
  switch (method) {
    case v1::METHOD_LORA:
      return std::string(MethodName(Method::kLora));
    case v1::METHOD_FULL:
      return std::string(MethodName(Method::kFull));
    case v1::METHOD_QLORA:
      return std::string(MethodName(Method::kQLora));
    default:
      return static_cast<int>(method);
  }
}

Json ScheduleKindJson(v1::ScheduleKind kind) {
  switch (kind) {
    case v1::SCHEDULE_KIND_COSINE:
      return std::string(ScheduleKindName(ScheduleKind::kCosine));
    case v1::SCHEDULE_KIND_LINEAR:
      return std::string(ScheduleKindName(ScheduleKind::kLinear));
    case v1::SCHEDULE_KIND_CONSTANT:
      return std::string(ScheduleKindName(ScheduleKind::kConstant));
    default:
      return static_cast<int>(kind);
  }
}

Json OptimizerJson(v1::Optimizer optimizer) {
  switch (optimizer) {
    case v1::OPTIMIZER_ADAMW:
      return std::string(OptimizerKindName(OptimizerKind::kAdamW));
    case v1::OPTIMIZER_ADAMW_8BIT:
      return std::string(OptimizerKindName(OptimizerKind::kAdamW8bit));
    case v1::OPTIMIZER_ADAFACTOR:
      return std::string(OptimizerKindName(OptimizerKind::kAdafactor));
    case v1::OPTIMIZER_SGD:
      return std::string(OptimizerKindName(OptimizerKind::kSgd));
    default:
      return static_cast<int>(optimizer);
  }
}

Json PrecisionJson(v1::Precision precision) {
  switch (precision) {
    case v1::PRECISION_FP32:
      return std::string(PrecisionName(Precision::kFp32));
    case v1::PRECISION_BF16:
      return std::string(PrecisionName(Precision::kBf16));
    case v1::PRECISION_FP16:
      return std::string(PrecisionName(Precision::kFp16));
    default:
      return static_cast<int>(precision);
  }
}

Json DeviceJson(v1::Device device) {
  switch (device) {
    case v1::DEVICE_CPU:
      return std::string(DeviceKindName(DeviceKind::kCpu));
    case v1::DEVICE_CUDA:
      return std::string(DeviceKindName(DeviceKind::kCuda));
    default:
      return static_cast<int>(device);
  }
}

// Sets `object[key]` to `value` unless the value is empty, so that an empty sub-message
// leaves its key out and the parser applies the defaults (or names the missing field).
void PutUnlessEmpty(Json* object, const char* key, Json value) {
  if (!value.empty()) (*object)[key] = std::move(value);
}

Json ModelJson(const v1::ModelSpec& model) {
  Json out = Json::object();
  if (!model.path().empty()) out["path"] = model.path();
  return out;
}

Json DataJson(const v1::DataSpec& data) {
  Json out = Json::object();
  if (!data.train().empty()) out["train"] = data.train();
  if (!data.eval().empty()) out["eval"] = data.eval();
  if (data.has_seq_len()) out["seq_len"] = data.seq_len();
  if (data.has_pack()) out["pack"] = data.pack();
  return out;
}

Json LoraJson(const v1::LoraSpec& lora) {
  Json out = Json::object();
  if (lora.has_rank()) out["rank"] = lora.rank();
  if (lora.has_alpha()) out["alpha"] = lora.alpha();
  if (lora.has_dropout()) out["dropout"] = lora.dropout();
  if (lora.targets_size() > 0) {
    Json targets = Json::array();
    for (const std::string& target : lora.targets()) targets.push_back(target);
    out["targets"] = std::move(targets);
  }
  if (lora.has_use_rslora()) out["use_rslora"] = lora.use_rslora();
  if (!lora.init_from().empty()) out["init_from"] = lora.init_from();
  return out;
}

Json TrainJson(const v1::TrainSpec& train) {
  Json out = Json::object();
  if (train.has_steps()) out["steps"] = train.steps();
  if (train.has_epochs()) out["epochs"] = train.epochs();
  if (train.has_global_batch()) out["global_batch"] = train.global_batch();
  // 0 is the proto's spelling of "auto", which is also the default.
  if (train.has_micro_batch() && train.micro_batch() != 0) {
    out["micro_batch"] = train.micro_batch();
  }
  if (train.has_lr()) out["lr"] = train.lr();
  if (train.has_schedule()) {
    const v1::ScheduleSpec& schedule = train.schedule();
    Json schedule_json = Json::object();
    if (schedule.kind() != v1::SCHEDULE_KIND_UNSPECIFIED) {
      schedule_json["kind"] = ScheduleKindJson(schedule.kind());
    }
    if (schedule.has_warmup_steps()) schedule_json["warmup_steps"] = schedule.warmup_steps();
    PutUnlessEmpty(&out, "schedule", std::move(schedule_json));
  }
  if (train.optimizer() != v1::OPTIMIZER_UNSPECIFIED) {
    out["optimizer"] = OptimizerJson(train.optimizer());
  }
  if (train.has_adam_beta1()) out["adam_beta1"] = train.adam_beta1();
  if (train.has_adam_beta2()) out["adam_beta2"] = train.adam_beta2();
  if (train.has_adam_eps()) out["adam_eps"] = train.adam_eps();
  if (train.has_weight_decay()) out["weight_decay"] = train.weight_decay();
  if (train.has_max_grad_norm()) out["max_grad_norm"] = train.max_grad_norm();
  if (train.precision() != v1::PRECISION_UNSPECIFIED) {
    out["precision"] = PrecisionJson(train.precision());
  }
  if (train.has_seed()) out["seed"] = train.seed();
  if (train.has_checkpoint_every()) out["checkpoint_every"] = train.checkpoint_every();
  if (train.has_keep_checkpoints()) out["keep_checkpoints"] = train.keep_checkpoints();
  if (train.has_eval_every()) out["eval_every"] = train.eval_every();
  if (train.has_max_nonfinite_steps()) out["max_nonfinite_steps"] = train.max_nonfinite_steps();
  return out;
}

Json ResourcesJson(const v1::ResourcesSpec& resources) {
  Json out = Json::object();
  if (resources.has_ranks()) out["ranks"] = resources.ranks();
  if (resources.device() != v1::DEVICE_UNSPECIFIED) {
    out["device"] = DeviceJson(resources.device());
  }
  if (resources.has_memory_per_rank_bytes()) {
    out["memory_per_rank"] = resources.memory_per_rank_bytes();
  }
  return out;
}

Json StrategyJson(const v1::JobSpec& spec) {
  if (!spec.has_strategy() || spec.strategy().automatic()) return "auto";
  const v1::StrategySpec& strategy = spec.strategy();
  Json out = Json::object();
  out["zero_stage"] = strategy.zero_stage();
  out["offload_optimizer"] = strategy.offload_optimizer();
  out["offload_params"] = strategy.offload_params();
  out["activation_checkpointing"] = strategy.activation_checkpointing();
  out["chunked_loss"] = strategy.chunked_loss();
  if (strategy.has_fused_kernels()) out["fused_kernels"] = strategy.fused_kernels();
  return out;
}

}  // namespace

v1::JobSpec JobSpecToProto(const JobSpec& spec) {
  v1::JobSpec out;
  out.set_name(spec.name);
  out.mutable_model()->set_path(spec.model.path);

  v1::DataSpec* data = out.mutable_data();
  data->set_train(spec.data.train);
  data->set_eval(spec.data.eval);
  data->set_seq_len(spec.data.seq_len);
  data->set_pack(spec.data.pack);

  out.set_method(ToProto(spec.method));

  v1::LoraSpec* lora = out.mutable_lora();
  lora->set_rank(spec.lora.rank);
  lora->set_alpha(spec.lora.alpha);
  lora->set_dropout(spec.lora.dropout);
  for (const std::string& target : spec.lora.targets) lora->add_targets(target);
  lora->set_use_rslora(spec.lora.use_rslora);
  lora->set_init_from(spec.lora.init_from);

  v1::TrainSpec* train = out.mutable_train();
  train->set_steps(spec.train.steps);
  train->set_epochs(spec.train.epochs);
  train->set_global_batch(spec.train.global_batch);
  train->set_micro_batch(spec.train.micro_batch);
  train->set_lr(spec.train.lr);
  train->mutable_schedule()->set_kind(ToProto(spec.train.schedule.kind));
  train->mutable_schedule()->set_warmup_steps(spec.train.schedule.warmup_steps);
  train->set_optimizer(ToProto(spec.train.optimizer));
  train->set_adam_beta1(spec.train.adam_beta1);
  train->set_adam_beta2(spec.train.adam_beta2);
  train->set_adam_eps(spec.train.adam_eps);
  train->set_weight_decay(spec.train.weight_decay);
  train->set_max_grad_norm(spec.train.max_grad_norm);
  train->set_precision(ToProto(spec.train.precision));
  train->set_seed(spec.train.seed);
  train->set_checkpoint_every(spec.train.checkpoint_every);
  train->set_keep_checkpoints(spec.train.keep_checkpoints);
  train->set_eval_every(spec.train.eval_every);
  train->set_max_nonfinite_steps(spec.train.max_nonfinite_steps);

  v1::ResourcesSpec* resources = out.mutable_resources();
  resources->set_ranks(spec.resources.ranks);
  resources->set_device(ToProto(spec.resources.device));
  // 0 means "not given" in JobSpec; a present 0 would read as an explicit (invalid) size.
  if (spec.resources.memory_per_rank != 0) {
    resources->set_memory_per_rank_bytes(spec.resources.memory_per_rank);
  }

  v1::StrategySpec* strategy = out.mutable_strategy();
  strategy->set_automatic(spec.strategy.automatic);
  strategy->set_zero_stage(spec.strategy.zero_stage);
  strategy->set_offload_optimizer(spec.strategy.offload_optimizer);
  strategy->set_offload_params(spec.strategy.offload_params);
  strategy->set_activation_checkpointing(spec.strategy.activation_checkpointing);
  strategy->set_chunked_loss(spec.strategy.chunked_loss);
  strategy->set_fused_kernels(spec.strategy.fused_kernels);

  out.set_priority(spec.priority);
  out.set_max_restarts(spec.max_restarts);
  out.set_output(spec.output);
  return out;
}

std::string JobSpecProtoToJson(const v1::JobSpec& spec) {
  Json out = Json::object();
  if (!spec.name().empty()) out["name"] = spec.name();
  if (spec.has_model()) PutUnlessEmpty(&out, "model", ModelJson(spec.model()));
  if (spec.has_data()) PutUnlessEmpty(&out, "data", DataJson(spec.data()));
  if (spec.method() != v1::METHOD_UNSPECIFIED) out["method"] = MethodJson(spec.method());
  if (spec.has_lora()) PutUnlessEmpty(&out, "lora", LoraJson(spec.lora()));
  if (spec.has_train()) PutUnlessEmpty(&out, "train", TrainJson(spec.train()));
  if (spec.has_resources()) PutUnlessEmpty(&out, "resources", ResourcesJson(spec.resources()));
  out["strategy"] = StrategyJson(spec);
  if (spec.has_priority()) out["priority"] = spec.priority();
  if (spec.has_max_restarts()) out["max_restarts"] = spec.max_restarts();
  if (!spec.output().empty()) out["output"] = spec.output();
  // Replace rather than throw on invalid UTF-8: the parser then reports the odd value by
  // field, and this function stays total.
  return out.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

absl::StatusOr<JobSpec> JobSpecFromProto(const v1::JobSpec& spec, absl::string_view source) {
  return ParseJobSpec(JobSpecProtoToJson(spec), source);
}

}  // namespace lathe
