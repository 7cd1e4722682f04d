#include "common/proto/job_spec_proto.h"

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/memory_components.h"
#include "common/proto/memory_breakdown.h"
#include "common/status_macros.h"

namespace lathe {
namespace {

// One enum's correspondence between the C++ value, the proto value and the spec's word.
template <typename T, typename P>
struct EnumPair {
  T value;
  P proto;
};

template <typename T, typename P, size_t N>
P ToProtoEnum(const EnumPair<T, P> (&pairs)[N], T value) {
  for (const auto& pair : pairs) {
    if (pair.value == value) return pair.proto;
  }
  return P{};
}

// UNSPECIFIED (0) is the default `fallback`; an unknown number is refused naming `field`.
template <typename T, typename P, size_t N>
absl::StatusOr<T> FromProtoEnum(const EnumPair<T, P> (&pairs)[N], P proto, T fallback,
                                absl::string_view source, absl::string_view field) {
  if (static_cast<int>(proto) == 0) return fallback;
  for (const auto& pair : pairs) {
    if (pair.proto == proto) return pair.value;
  }
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", field, ": unknown value ",
                                                 static_cast<int>(proto),
                                                 " (this build does not know it)"));
}

constexpr EnumPair<Method, v1::Method> kMethods[] = {
    {Method::kLora, v1::METHOD_LORA},
    {Method::kFull, v1::METHOD_FULL},
    {Method::kQLora, v1::METHOD_QLORA},
    {Method::kMezo, v1::METHOD_MEZO},
};
constexpr EnumPair<ScheduleKind, v1::ScheduleKind> kSchedules[] = {
    {ScheduleKind::kCosine, v1::SCHEDULE_KIND_COSINE},
    {ScheduleKind::kLinear, v1::SCHEDULE_KIND_LINEAR},
    {ScheduleKind::kConstant, v1::SCHEDULE_KIND_CONSTANT},
};
constexpr EnumPair<OptimizerKind, v1::Optimizer> kOptimizers[] = {
    {OptimizerKind::kAdamW, v1::OPTIMIZER_ADAMW},
    {OptimizerKind::kAdamW8bit, v1::OPTIMIZER_ADAMW_8BIT},
    {OptimizerKind::kAdafactor, v1::OPTIMIZER_ADAFACTOR},
    {OptimizerKind::kSgd, v1::OPTIMIZER_SGD},
};
constexpr EnumPair<Precision, v1::Precision> kPrecisions[] = {
    {Precision::kFp32, v1::PRECISION_FP32},
    {Precision::kBf16, v1::PRECISION_BF16},
    {Precision::kFp16, v1::PRECISION_FP16},
};
constexpr EnumPair<DeviceKind, v1::Device> kDevices[] = {
    {DeviceKind::kCpu, v1::DEVICE_CPU},
    {DeviceKind::kCuda, v1::DEVICE_CUDA},
};

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

  out.set_method(ToProtoEnum(kMethods, spec.method));

  v1::LoraSpec* lora = out.mutable_lora();
  lora->set_rank(spec.lora.rank);
  lora->set_alpha(spec.lora.alpha);
  lora->set_dropout(spec.lora.dropout);
  for (const std::string& target : spec.lora.targets) lora->add_targets(target);
  lora->set_targets_pattern(spec.lora.targets_pattern);
  for (const auto& [pattern, rank] : spec.lora.rank_pattern) {
    v1::LoraRankPattern* entry = lora->add_rank_pattern();
    entry->set_pattern(pattern);
    entry->set_rank(rank);
  }
  for (const auto& [pattern, alpha] : spec.lora.alpha_pattern) {
    v1::LoraAlphaPattern* entry = lora->add_alpha_pattern();
    entry->set_pattern(pattern);
    entry->set_alpha(alpha);
  }
  for (const std::string& module : spec.lora.modules_to_save) lora->add_modules_to_save(module);
  lora->set_use_rslora(spec.lora.use_rslora);
  lora->set_init_from(spec.lora.init_from);
  if (spec.method == Method::kMezo) {
    out.mutable_mezo()->set_trainable(ToProtoEnum(kMethods, spec.mezo.trainable));
    out.mutable_mezo()->set_eps(spec.mezo.eps);
  }

  const TrainSpec& t = spec.train;
  v1::TrainSpec* train = out.mutable_train();
  train->set_steps(t.steps);
  train->set_epochs(t.epochs);
  train->set_global_batch(t.global_batch);
  train->set_lr(t.lr);
  train->mutable_schedule()->set_kind(ToProtoEnum(kSchedules, t.schedule.kind));
  train->mutable_schedule()->set_warmup_steps(t.schedule.warmup_steps);
  train->set_optimizer(ToProtoEnum(kOptimizers, t.optimizer));
  train->set_adam_beta1(t.adam_beta1);
  train->set_adam_beta2(t.adam_beta2);
  train->set_adam_eps(t.adam_eps);
  train->set_weight_decay(t.weight_decay);
  train->set_sgd_momentum(t.sgd_momentum);
  train->set_sgd_nesterov(t.sgd_nesterov);
  train->set_adafactor_beta1(t.adafactor_beta1);
  train->set_adafactor_decay_rate(t.adafactor_decay_rate);
  train->set_adafactor_clip_threshold(t.adafactor_clip_threshold);
  train->set_adafactor_relative_step(t.adafactor_relative_step);
  train->set_paged_optimizer(t.paged_optimizer);
  train->set_max_grad_norm(t.max_grad_norm);
  train->set_precision(ToProtoEnum(kPrecisions, t.precision));
  train->set_seed(t.seed);
  train->set_checkpoint_every(t.checkpoint_every);
  train->set_keep_checkpoints(t.keep_checkpoints);
  train->set_eval_every(t.eval_every);
  train->set_max_nonfinite_steps(t.max_nonfinite_steps);

  v1::ResourcesSpec* resources = out.mutable_resources();
  resources->set_ranks(spec.resources.ranks);
  resources->set_device(ToProtoEnum(kDevices, spec.resources.device));
  // 0 means "not given" in JobSpec; a present 0 would read as an explicit (invalid) size.
  if (spec.resources.memory_per_rank != 0) {
    resources->set_memory_per_rank_bytes(spec.resources.memory_per_rank);
  }

  *out.mutable_strategy() = StrategySpecToProto(spec.strategy);

  out.set_priority(spec.priority);
  out.set_max_restarts(spec.max_restarts);
  out.set_output(spec.output);
  return out;
}

absl::StatusOr<JobSpec> JobSpecFromProto(const v1::JobSpec& in, absl::string_view source) {
  JobSpec spec;  // the defaults
  spec.name = in.name();
  spec.model.path = in.model().path();

  const v1::DataSpec& data = in.data();
  spec.data.train = data.train();
  spec.data.eval = data.eval();
  if (data.has_seq_len()) spec.data.seq_len = data.seq_len();
  if (data.has_pack()) spec.data.pack = data.pack();

  LATHE_ASSIGN_OR_RETURN(spec.method,
                         FromProtoEnum(kMethods, in.method(), spec.method, source, "method"));

  const v1::LoraSpec& lora = in.lora();
  if (lora.has_rank()) spec.lora.rank = lora.rank();
  if (lora.has_alpha()) spec.lora.alpha = lora.alpha();
  if (lora.has_dropout()) spec.lora.dropout = lora.dropout();
  if (lora.targets_size() > 0)
    spec.lora.targets.assign(lora.targets().begin(), lora.targets().end());
  if (!lora.targets_pattern().empty()) {
    spec.lora.targets.clear();
    spec.lora.targets_pattern = lora.targets_pattern();
  }
  for (const v1::LoraRankPattern& entry : lora.rank_pattern()) {
    spec.lora.rank_pattern.emplace_back(entry.pattern(), entry.rank());
  }
  for (const v1::LoraAlphaPattern& entry : lora.alpha_pattern()) {
    spec.lora.alpha_pattern.emplace_back(entry.pattern(), entry.alpha());
  }
  spec.lora.modules_to_save.assign(lora.modules_to_save().begin(), lora.modules_to_save().end());
  if (lora.has_use_rslora()) spec.lora.use_rslora = lora.use_rslora();
  spec.lora.init_from = lora.init_from();
  if (in.has_mezo()) {
    LATHE_ASSIGN_OR_RETURN(spec.mezo.trainable,
                           FromProtoEnum(kMethods, in.mezo().trainable(), spec.mezo.trainable,
                                         source, "mezo.trainable"));
    if (in.mezo().has_eps()) spec.mezo.eps = in.mezo().eps();
  }

  const v1::TrainSpec& train = in.train();
  TrainSpec& t = spec.train;
  if (train.has_steps()) t.steps = train.steps();
  if (train.has_epochs()) t.epochs = train.epochs();
  if (train.has_global_batch()) t.global_batch = train.global_batch();
  if (train.has_lr()) t.lr = train.lr();
  LATHE_ASSIGN_OR_RETURN(t.schedule.kind,
                         FromProtoEnum(kSchedules, train.schedule().kind(), t.schedule.kind, source,
                                       "train.schedule.kind"));
  if (train.schedule().has_warmup_steps()) {
    t.schedule.warmup_steps = train.schedule().warmup_steps();
  }
  LATHE_ASSIGN_OR_RETURN(t.optimizer, FromProtoEnum(kOptimizers, train.optimizer(), t.optimizer,
                                                    source, "train.optimizer"));
  if (train.has_adam_beta1()) t.adam_beta1 = train.adam_beta1();
  if (train.has_adam_beta2()) t.adam_beta2 = train.adam_beta2();
  if (train.has_adam_eps()) t.adam_eps = train.adam_eps();
  if (train.has_weight_decay()) t.weight_decay = train.weight_decay();
  if (train.has_sgd_momentum()) t.sgd_momentum = train.sgd_momentum();
  if (train.has_sgd_nesterov()) t.sgd_nesterov = train.sgd_nesterov();
  if (train.has_adafactor_beta1()) t.adafactor_beta1 = train.adafactor_beta1();
  if (train.has_adafactor_decay_rate()) t.adafactor_decay_rate = train.adafactor_decay_rate();
  if (train.has_adafactor_clip_threshold()) {
    t.adafactor_clip_threshold = train.adafactor_clip_threshold();
  }
  t.adafactor_relative_step = train.adafactor_relative_step();
  t.paged_optimizer = train.paged_optimizer();
  if (train.has_max_grad_norm()) t.max_grad_norm = train.max_grad_norm();
  LATHE_ASSIGN_OR_RETURN(t.precision, FromProtoEnum(kPrecisions, train.precision(), t.precision,
                                                    source, "train.precision"));
  if (train.has_seed()) t.seed = train.seed();
  if (train.has_checkpoint_every()) t.checkpoint_every = train.checkpoint_every();
  if (train.has_keep_checkpoints()) t.keep_checkpoints = train.keep_checkpoints();
  if (train.has_eval_every()) t.eval_every = train.eval_every();
  if (train.has_max_nonfinite_steps()) t.max_nonfinite_steps = train.max_nonfinite_steps();

  const v1::ResourcesSpec& resources = in.resources();
  if (resources.has_ranks()) spec.resources.ranks = resources.ranks();
  LATHE_ASSIGN_OR_RETURN(spec.resources.device,
                         FromProtoEnum(kDevices, resources.device(), spec.resources.device, source,
                                       "resources.device"));
  if (resources.has_memory_per_rank_bytes()) {
    if (resources.memory_per_rank_bytes() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": resources.memory_per_rank: must be > 0"));
    }
    spec.resources.memory_per_rank = resources.memory_per_rank_bytes();
  }

  spec.strategy = StrategySpecFromProto(in.strategy());

  if (in.has_priority()) spec.priority = in.priority();
  if (in.has_max_restarts()) spec.max_restarts = in.max_restarts();
  spec.output = in.output();
  LATHE_RETURN_IF_ERROR(ValidateJobSpec(spec, source));
  return spec;
}

v1::Strategy StrategySpecToProto(const StrategySpec& spec) {
  v1::Strategy out;
  if (spec.zero_stage) out.set_zero_stage(*spec.zero_stage);
  if (spec.offload_optimizer) out.set_offload_optimizer(*spec.offload_optimizer);
  if (spec.offload_params) out.set_offload_params(*spec.offload_params);
  if (spec.activation_checkpointing) {
    out.set_activation_checkpointing(*spec.activation_checkpointing);
  }
  if (spec.chunked_loss) out.set_chunked_loss(*spec.chunked_loss);
  if (spec.micro_batch) out.set_micro_batch(*spec.micro_batch);
  out.set_fused_kernels(spec.fused_kernels);
  return out;
}

StrategySpec StrategySpecFromProto(const v1::Strategy& in) {
  StrategySpec spec;
  if (in.has_zero_stage()) spec.zero_stage = in.zero_stage();
  if (in.has_offload_optimizer()) spec.offload_optimizer = in.offload_optimizer();
  if (in.has_offload_params()) spec.offload_params = in.offload_params();
  if (in.has_activation_checkpointing()) {
    spec.activation_checkpointing = in.activation_checkpointing();
  }
  if (in.has_chunked_loss()) spec.chunked_loss = in.chunked_loss();
  if (in.has_micro_batch()) spec.micro_batch = in.micro_batch();
  if (in.has_fused_kernels()) spec.fused_kernels = in.fused_kernels();
  return spec;
}

v1::Strategy StrategyToProto(const Strategy& strategy) {
  return StrategySpecToProto(AsSpec(strategy));
}

Strategy StrategyFromProto(const v1::Strategy& in) {
  Strategy s;
  s.zero_stage = in.zero_stage();
  s.offload_optimizer = in.offload_optimizer();
  s.offload_params = in.offload_params();
  s.activation_checkpointing = in.activation_checkpointing();
  s.chunked_loss = in.chunked_loss();
  s.micro_batch = in.micro_batch();
  s.fused_kernels = !in.has_fused_kernels() || in.fused_kernels();
  return s;
}

v1::Plan PlanToProto(const Plan& plan) {
  v1::Plan out;
  out.set_ranks(plan.ranks);
  out.set_device(ToProtoEnum(kDevices, plan.device));
  *out.mutable_strategy() = StrategyToProto(plan.strategy);
  out.set_gradient_accumulation(plan.gradient_accumulation);
  out.set_total_steps(plan.total_steps);
  out.set_precision(ToProtoEnum(kPrecisions, plan.precision));
  *out.mutable_predicted_memory() = MemoryBytesToProto(plan.predicted_memory);
  out.set_memory_correction(plan.memory_correction);
  out.set_calibration_key(plan.calibration_key);
  out.set_explanation(plan.explanation);
  if (plan.method) out.set_method(ToProtoEnum(kMethods, *plan.method));
  if (plan.optimizer) out.set_optimizer(ToProtoEnum(kOptimizers, *plan.optimizer));
  return out;
}

v1::MemoryBreakdown MemoryBytesToProto(const MemoryBytes& bytes) {
  v1::MemoryBreakdown memory;
  for (MemoryComponent c : kMemoryComponents) {
    SetComponentBytes(&memory, c, bytes.components[static_cast<int>(c)]);
  }
  memory.set_total(bytes.total);
  return memory;
}

absl::StatusOr<Plan> PlanFromProto(const v1::Plan& in, absl::string_view source) {
  Plan plan;
  plan.ranks = in.ranks();
  LATHE_ASSIGN_OR_RETURN(plan.device,
                         FromProtoEnum(kDevices, in.device(), plan.device, source, "plan.device"));
  plan.strategy = StrategyFromProto(in.strategy());
  plan.gradient_accumulation = in.gradient_accumulation();
  plan.total_steps = in.total_steps();
  LATHE_ASSIGN_OR_RETURN(plan.precision, FromProtoEnum(kPrecisions, in.precision(), plan.precision,
                                                       source, "plan.precision"));
  for (MemoryComponent c : kMemoryComponents) {
    plan.predicted_memory.components[static_cast<int>(c)] =
        ComponentBytes(in.predicted_memory(), c);
  }
  plan.predicted_memory.total = in.predicted_memory().total();
  if (in.method() != v1::METHOD_UNSPECIFIED) {
    LATHE_ASSIGN_OR_RETURN(
        plan.method, FromProtoEnum(kMethods, in.method(), Method::kLora, source, "plan.method"));
  }
  if (in.optimizer() != v1::OPTIMIZER_UNSPECIFIED) {
    LATHE_ASSIGN_OR_RETURN(plan.optimizer,
                           FromProtoEnum(kOptimizers, in.optimizer(), OptimizerKind::kAdamW, source,
                                         "plan.optimizer"));
  }
  plan.memory_correction = EffectiveCorrection(in.memory_correction());
  plan.calibration_key = in.calibration_key();
  plan.explanation = in.explanation();
  return plan;
}

}  // namespace lathe
