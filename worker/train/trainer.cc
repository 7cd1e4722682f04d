#include "worker/train/trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/capabilities.h"
#include "common/file_util.h"
#include "common/flops.h"
#include "common/lora_targets.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "kernels/ops/matmul.h"
#include "nlohmann/json.hpp"
#include "worker/comm/communicator.h"
#include "worker/comm/cuda_communicator.h"
#include "worker/engine/causal_lm.h"
#include "worker/engine/evaluation.h"
#include "worker/engine/loss_scaler.h"
#include "worker/engine/lr_schedule.h"
#include "worker/engine/memory_tracker.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/peak_flops.h"
#include "worker/engine/profile_scope.h"
#include "worker/engine/text_record_encoder.h"
#include "worker/shard/sharded_model.h"
#include "worker/train/mezo.h"

namespace lathe {
namespace {

namespace fs = std::filesystem;

// What the engine cannot run (the same list the coordinator checks at submit), a plan that
// does not fit the spec, and what this process cannot do.
absl::Status CheckSupported(const JobSpec& spec, const Plan& plan, const TrainerOptions& options) {
  LATHE_RETURN_IF_ERROR(CheckEngineSupports(spec));
  LATHE_RETURN_IF_ERROR(CheckPlanRunsSpec(spec, plan, "plan"));
  if (options.world_size != plan.ranks) {
    return absl::InvalidArgumentError(absl::StrCat("resources.ranks: ", plan.ranks,
                                                   " but this trainer was started with world size ",
                                                   options.world_size));
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", options.rank, " is outside world size ", options.world_size));
  }
  if (options.world_size > 1 &&
      (options.comm == nullptr || options.comm->world_size() != options.world_size ||
       options.comm->rank() != options.rank)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "resources.ranks: ", plan.ranks,
        ": several ranks need a communicator for this rank (start the trainer through a worker "
        "agent)"));
  }
  if (plan.device == DeviceKind::kCuda && !at::hasCUDA()) {
    return absl::FailedPreconditionError(
        "resources.device: cuda: this worker's libtorch has no CUDA support or sees no GPU");
  }
  // A CUDA job's collectives take device memory (NCCL, or a host backend staged through the
  // host: worker/comm/cuda_communicator.h); a CPU job's take host memory.
  const CommMemory memory =
      plan.device == DeviceKind::kCuda ? CommMemory::kCuda : CommMemory::kHost;
  if (options.world_size > 1 && options.comm->memory() != memory) {
    return absl::FailedPreconditionError(absl::StrCat(
        "resources.device: ", DeviceKindName(plan.device), ": this rank's communicator takes ",
        memory == CommMemory::kCuda ? "host" : "device", " memory"));
  }
  return absl::OkStatus();
}

// The output directory must not hold a finished run (the same check as at submit) and must
// be creatable.
absl::Status CheckOutput(const std::string& output) {
  LATHE_RETURN_IF_ERROR(CheckNoFinishedRun(output));
  fs::path existing = fs::absolute(output);
  while (!fs::exists(existing) && existing.has_parent_path() &&
         existing != existing.parent_path()) {
    existing = existing.parent_path();
  }
  if (!fs::is_directory(existing)) {
    return absl::InvalidArgumentError(
        absl::StrCat("output: ", output, ": ", existing.string(), " is not a directory"));
  }
  if (access(existing.c_str(), W_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("output: ", output, ": ", existing.string(), " is not writable"));
  }
  return absl::OkStatus();
}

// The hyperparameters of SGD and Adafactor (none for the AdamWs, so that their checkpoints
// written before these optimizers existed still resume).
std::string OptimizerFingerprint(const TrainSpec& t) {
  switch (t.optimizer) {
    case OptimizerKind::kSgd:
      return absl::StrCat(",", t.sgd_momentum, ",", t.sgd_nesterov);
    case OptimizerKind::kAdafactor:
      return absl::StrCat(",", t.adafactor_beta1, ",", t.adafactor_decay_rate, ",",
                          t.adafactor_clip_threshold, t.adafactor_relative_step ? ",relative" : "");
    default:
      return "";
  }
}

// The CPU kernel's products so far, by type.
std::array<ProductTally, kNumProductTypes> ProductTotals() {
  std::array<ProductTally, kNumProductTypes> totals;
  for (auto type : {ProductType::kFloat32, ProductType::kBFloat16}) {
    const kernels::ProductsSoFar so_far = kernels::CpuProductsSoFar(type == ProductType::kBFloat16);
    totals[static_cast<int>(type)] = {so_far.flops, so_far.seconds};
  }
  return totals;
}

// A function returning the seconds since its previous call (since its creation at first),
// and adding the CPU kernel's products since then to `phase` of `products` (none: nowhere).
auto Laps(PhaseProducts& products) {
  return [&products, clock = std::chrono::steady_clock::now(),
          before = ProductTotals()](std::optional<ProductPhase> phase = std::nullopt) mutable {
    const auto now = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(now - clock).count();
    clock = now;
    const std::array<ProductTally, kNumProductTypes> totals = ProductTotals();
    if (phase) {
      for (int t = 0; t < kNumProductTypes; ++t) {
        ProductTally& tally = products[static_cast<int>(*phase)][t];
        tally.flops += totals[t].flops - before[t].flops;
        tally.seconds += totals[t].seconds - before[t].seconds;
      }
    }
    before = totals;
    return seconds;
  };
}

std::string MezoFingerprint(const JobSpec& spec) {
  if (spec.method != Method::kMezo) return "";
  return absl::StrCat("|mezo=", MethodName(spec.mezo.trainable), ",", spec.mezo.eps);
}

// The LoRA options added after the fingerprint's first form: written only when given, so
// that a spec without them keeps its fingerprint (and its checkpoints).
std::string LoraOptionsFingerprint(const LoraSpec& l) {
  std::string out;
  if (!l.targets_pattern.empty()) absl::StrAppend(&out, "|targets_pattern=", l.targets_pattern);
  for (const auto& [key, rank] : l.rank_pattern) {
    absl::StrAppend(&out, "|rank_pattern=", key, "=", rank);
  }
  for (const auto& [key, alpha] : l.alpha_pattern) {
    absl::StrAppend(&out, "|alpha_pattern=", key, "=", alpha);
  }
  if (!l.modules_to_save.empty()) {
    absl::StrAppend(&out, "|modules_to_save=", absl::StrJoin(l.modules_to_save, "+"));
  }
  return out;
}

// Identifies what decides a run's trajectory, so that a checkpoint is only resumed by the
// run it belongs to. Not included: output, ranks and micro-batch (the update is the same).
std::string SpecFingerprint(const JobSpec& spec) {
  const TrainSpec& t = spec.train;
  const LoraSpec& l = spec.lora;
  return Sha256Hex(absl::StrCat(
      "model=", spec.model.path, "|train=", spec.data.train, "|seq_len=", spec.data.seq_len,
      "|pack=", spec.data.pack, "|method=", MethodName(spec.method), "|lora=", l.rank, ",", l.alpha,
      ",", l.dropout, ",", absl::StrJoin(l.targets, "+"), ",", l.use_rslora, ",", l.init_from,
      LoraOptionsFingerprint(l), "|steps=", t.steps, "|epochs=", t.epochs,
      "|global_batch=", t.global_batch, "|lr=", t.lr,
      "|schedule=", ScheduleKindName(t.schedule.kind), ",", t.schedule.warmup_steps,
      "|optimizer=", OptimizerKindName(t.optimizer), ",", t.adam_beta1, ",", t.adam_beta2, ",",
      t.adam_eps, ",", t.weight_decay, OptimizerFingerprint(t), MezoFingerprint(spec),
      "|clip=", t.max_grad_norm, "|precision=", PrecisionName(t.precision), "|seed=", t.seed));
}

// The CPU generator that dropout draws from, as bytes, and back.
std::string CpuRngState() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  at::Tensor state = generator.get_state();
  return std::string(static_cast<const char*>(state.data_ptr()), state.numel());
}

void SetCpuRngState(const std::string& bytes) {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  at::Tensor state = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(state.data_ptr(), bytes.data(), bytes.size());
  generator.set_state(state);
}

int64_t PeakRssBytes() {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

// Right-pads `sequences` into [batch, longest] id and label tensors.
std::pair<at::Tensor, at::Tensor> Collate(const std::vector<Sequence>& sequences) {
  size_t longest = 0;
  for (const Sequence& s : sequences) longest = std::max(longest, s.input_ids.size());
  const int64_t batch = static_cast<int64_t>(sequences.size());
  at::Tensor ids = at::zeros({batch, static_cast<int64_t>(longest)}, at::kLong);
  at::Tensor labels = at::full({batch, static_cast<int64_t>(longest)}, kIgnoreLabel, at::kLong);
  for (int64_t b = 0; b < batch; ++b) {
    const Sequence& s = sequences[b];
    std::copy(s.input_ids.begin(), s.input_ids.end(), ids[b].data_ptr<int64_t>());
    std::copy(s.labels.begin(), s.labels.end(), labels[b].data_ptr<int64_t>());
  }
  return {ids, labels};
}

// How the model holds weights and computes for `plan` (docs/training.md, "Precision").
ModelOptions ModelOptionsFor(const Plan& plan) {
  ModelOptions options;
  switch (plan.precision) {
    case Precision::kFp32:
      options.weight_dtype = at::kFloat;
      break;
    case Precision::kBf16:
      options.weight_dtype = at::kBFloat16;
      break;
    case Precision::kFp16:
      options.weight_dtype = at::kHalf;
      break;
  }
  const bool cuda = plan.device == DeviceKind::kCuda;
  options.device = cuda ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  // On the CPU, low-precision weights are widened as they are used and the products run in
  // float32: libtorch 1.13, when this was decided, had no fp16 CPU matmul, and its bf16 one
  // ran ~50x slower than float32 on this project's machines (docs/training.md).
  options.compute_dtype = cuda ? options.weight_dtype : at::kFloat;
  options.activation_checkpointing = plan.strategy.activation_checkpointing;
  options.fused_kernels = plan.strategy.fused_kernels;
  // The fused linear cross-entropy is the chunked loss.
  options.chunked_loss = plan.strategy.chunked_loss;
  // ZeRO-3: each rank copies its slices out of the mapped files (worker/shard).
  options.keep_mapped = plan.strategy.zero_stage == 3;
  return options;
}

// %g, but NaN without its sign bit ("nan", never "-nan").
std::string NumberText(double x) { return std::isnan(x) ? "nan" : absl::StrFormat("%g", x); }

// A result with a non-finite value is never exported as a success: FAILED_PRECONDITION (a
// user error: the run diverged, retrying cannot help) naming the tensor.
absl::Status CheckFinite(const std::string& name, const at::Tensor& tensor) {
  if (!tensor.is_floating_point() || at::isfinite(tensor).all().item<bool>()) {
    return absl::OkStatus();
  }
  const int64_t bad = (~at::isfinite(tensor)).sum().item<int64_t>();
  return absl::FailedPreconditionError(absl::StrCat(
      "the trained weights hold non-finite values (", bad, " of ", tensor.numel(), " in ", name,
      "), so nothing was exported; the run diverged: lower train.lr or check the data"));
}

PeftAdapterConfig AdapterConfigOf(const JobSpec& spec, const std::vector<LoraTarget>& targets) {
  PeftAdapterConfig adapter;
  adapter.base_model_name_or_path = spec.model.path;
  adapter.r = spec.lora.rank;
  adapter.lora_alpha = spec.lora.alpha;
  adapter.rank_pattern = spec.lora.rank_pattern;
  adapter.alpha_pattern = spec.lora.alpha_pattern;
  adapter.lora_dropout = spec.lora.dropout;
  adapter.use_rslora = spec.lora.use_rslora;
  adapter.modules_to_save = spec.lora.modules_to_save;  // as given, as PEFT writes it
  SetPeftTargetModules(spec.lora, targets, &adapter);
  return adapter;
}

int64_t CountTargets(const Sequence& s) {
  int64_t n = 0;
  for (size_t i = 1; i < s.labels.size(); ++i) n += s.labels[i] != kIgnoreLabel;
  return n;
}

}  // namespace

Trainer::~Trainer() = default;

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const JobSpec& given, const Plan& plan,
                                                         const TrainerOptions& options) {
  LATHE_RETURN_IF_ERROR(CheckSupported(given, plan, options));
  // The method and optimizer the planner chose, when it chose them (strategy: auto).
  JobSpec spec = WithPlannedTechniques(given, plan);
  at::set_num_threads(options.threads > 0 ? options.threads
                                          : static_cast<int>(std::thread::hardware_concurrency()));
  std::unique_ptr<Trainer> trainer(new Trainer());
  trainer->spec_ = spec;
  trainer->plan_ = plan;
  trainer->options_ = options;

  absl::StatusOr<ModelConfig> config = LoadModelConfig(spec.model.path);
  if (!config.ok()) return Annotate(config.status(), "model.path");
  trainer->model_config_ = *config;
  if (TrainsLora(spec) && spec.lora.targets.empty() && spec.lora.targets_pattern.empty()) {
    // The spec's default, every projection of the model, as their names: the same modules,
    // and the fingerprint of a Llama-family spec stays the one its default's seven names gave.
    spec.lora.targets = ProjectionModules(*config);
    trainer->spec_.lora.targets = spec.lora.targets;
  }
  if (spec.data.seq_len > config->max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("data.seq_len: ", spec.data.seq_len,
                                                   " exceeds the model's max_position_embeddings ",
                                                   config->max_position_embeddings));
  }
  // Text, chat and instruction records are tokenised with the model's tokenizer.json.
  TextRecordEncoder text_encoder(spec.model.path, *config);
  LATHE_ASSIGN_OR_RETURN(
      trainer->train_data_,
      TokenDataset::Load(spec.data.train, "data.train", config->vocab_size, &text_encoder));
  if (!spec.data.eval.empty()) {
    LATHE_ASSIGN_OR_RETURN(
        trainer->eval_data_,
        TokenDataset::Load(spec.data.eval, "data.eval", config->vocab_size, &text_encoder));
  }
  LATHE_RETURN_IF_ERROR(CheckOutput(spec.output));

  const TrainSpec& train = spec.train;
  if (plan.total_steps == 0) {  // train.epochs: the data decides
    SequenceSampler sampler(&*trainer->train_data_, spec.data.seq_len, spec.data.pack, train.seed);
    trainer->plan_.total_steps =
        std::max<int64_t>(1, train.epochs * sampler.SequencesPerEpoch() / train.global_batch);
  }
  trainer->model_flops_per_token_ =
      TrainingFlopsPerToken(*config, spec, spec.data.seq_len, /*recompute=*/false);

  const ModelOptions model_options = ModelOptionsFor(plan);
  MemoryTracker* tracker = MemoryTracker::Install();
  const int64_t weights_before = tracker->Snapshot().of(MemoryComponent::kWeights).current_bytes;
  absl::StatusOr<std::unique_ptr<CausalLm>> model;
  {
    const bool full = TrainsFullWeights(spec);
    MemoryScope scope(full ? MemoryComponent::kTrainable : MemoryComponent::kWeights);
    model = CausalLm::Load(spec.model.path, *config, /*trainable_base=*/full, model_options);
  }
  if (!model.ok()) return Annotate(model.status(), "model.path");
  trainer->model_ = *std::move(model);
  trainer->peak_flops_ = PeakFlopsFor(model_options.device, plan.precision, options.peak_flops);
  trainer->products_ = kernels::ProductsBackend(model_options.device);
  if (!TrainsFullWeights(spec) && model_options.device.is_cpu() && !model_options.keep_mapped) {
    const int64_t loaded =
        tracker->Snapshot().of(MemoryComponent::kWeights).current_bytes - weights_before;
    const int64_t stored = ParameterCount(*config) * c10::elementSize(model_options.weight_dtype);
    trainer->mapped_weight_bytes_ = std::max<int64_t>(0, stored - loaded);
  }
  if (spec.method == Method::kQLora) {
    // The projections' frozen weights become NF4; the dense ones are released.
    int64_t nf4_bytes = 0;
    {
      MemoryScope scope(MemoryComponent::kWeights);
      nf4_bytes = trainer->model_->QuantizeProjections();
    }
    if (model_options.device.is_cpu() && !model_options.keep_mapped) {
      // What stays mapped: the weights left dense, less what of them was copied.
      int64_t projections = 0;
      for (const std::string& module : ProjectionModules(*config)) {
        const ProjectionShape shape = ProjectionShapeOf(*config, module);
        projections += config->num_hidden_layers * shape.in_features * shape.out_features;
      }
      const int64_t dense = (ParameterCount(*config) - projections) *
                            static_cast<int64_t>(c10::elementSize(model_options.weight_dtype));
      const int64_t loaded = tracker->Snapshot().of(MemoryComponent::kWeights).current_bytes -
                             weights_before - nf4_bytes;
      trainer->mapped_weight_bytes_ = std::max<int64_t>(0, dense - loaded);
    }
  }
  MemoryScope trainable_scope(MemoryComponent::kTrainable);
  if (TrainsLora(spec)) {
    // The model's own projections: the spec's default (none named) is every one of them.
    LATHE_RETURN_IF_ERROR(MatchLoraTargets(spec.lora, *config).status());
    LATHE_RETURN_IF_ERROR(
        Annotate(ResolveModulesToSave(spec.lora.modules_to_save).status(), "lora.modules_to_save"));
    if (spec.lora.init_from.empty()) {
      trainer->model_->InitLora(spec.lora, train.seed);
    } else {
      LATHE_RETURN_IF_ERROR(trainer->model_->LoadLora(spec.lora, spec.lora.init_from));
    }
  }

  if (plan.strategy.zero_stage > 0) {
    Communicator* comm = options.comm;
    if (comm == nullptr) {
      if (plan.device == DeviceKind::kCuda) {
        LATHE_ASSIGN_OR_RETURN(trainer->own_comm_, MakeCudaSingleRankCommunicator({}));
      } else {
        trainer->own_comm_ = MakeSingleRankCommunicator();
      }
      comm = trainer->own_comm_.get();
    }
    ShardOptions shard;
    shard.strategy = plan.strategy;
    shard.prefetch = options.prefetch;
    shard.train = train;
    LATHE_ASSIGN_OR_RETURN(trainer->sharded_,
                           ShardedModel::Create(trainer->model_.get(), comm, shard));
  }

  // Resume from the newest valid checkpoint of this run, if any.
  trainer->submitted_spec_ = options.submitted_spec ? *options.submitted_spec : spec;
  trainer->spec_fingerprint_ = SpecFingerprint(trainer->submitted_spec_);
  trainer->checkpoints_ = std::make_unique<CheckpointStore>(
      (fs::path(spec.output) / "checkpoints").string(), train.keep_checkpoints,
      CheckpointFence{options.job_id, options.generation});
  if (options.rank == 0) LATHE_RETURN_IF_ERROR(Annotate(trainer->checkpoints_->Claim(), "output"));
  LATHE_ASSIGN_OR_RETURN(trainer->resume_,
                         trainer->checkpoints_->LoadNewest(&trainer->skipped_checkpoints_));
  if (trainer->resume_) {
    const LoadedCheckpoint& checkpoint = *trainer->resume_;
    if (checkpoint.state.spec_fingerprint != trainer->spec_fingerprint_) {
      return absl::FailedPreconditionError(
          absl::StrCat("output: ", checkpoint.dir,
                       " is a checkpoint of a job with another spec; use a new output directory"));
    }
    if (checkpoint.state.step > trainer->plan_.total_steps) {
      return absl::FailedPreconditionError(absl::StrCat(
          "output: ", checkpoint.dir, " is past the last step ", trainer->plan_.total_steps));
    }
    if (trainer->sharded_) return trainer;  // Run restores the slices
    if (checkpoint.state.shard_world > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "output: ", checkpoint.dir, " was written by a sharded run (strategy.zero_stage 1-3); ",
          "resume it with strategy.zero_stage 1, 2 or 3"));
    }
    at::NoGradGuard no_grad;
    for (NamedParameter& p : trainer->model_->TrainableParameters()) {
      const TensorView* view = checkpoint.trainable->Find(p.name);
      if (view == nullptr ||
          view->shape != std::vector<int64_t>(p.tensor.sizes().begin(), p.tensor.sizes().end())) {
        return absl::DataLossError(absl::StrCat(checkpoint.trainable->path(), ": tensor \"", p.name,
                                                "\" is missing or has another shape"));
      }
      LATHE_ASSIGN_OR_RETURN(at::Tensor saved,
                             TensorFromFile({view, checkpoint.trainable}, at::kFloat, false));
      p.tensor.copy_(saved);
    }
  }
  return trainer;
}

absl::StatusOr<TrainResult> Trainer::Run(
    const std::function<void(const StepReport&)>& on_step,
    const std::function<void(int64_t step, const std::string& dir)>& on_checkpoint) {
  const TrainSpec& train = spec_.train;
  SequenceSampler sampler(&*train_data_, spec_.data.seq_len, spec_.data.pack, train.seed);
  MemoryTracker* tracker = MemoryTracker::Install();
  std::unique_ptr<Optimizer> optimizer;  // sharded_ holds its own
  const bool mezo = spec_.method == Method::kMezo;
  if (!sharded_) {
    MemoryScope scope(MemoryComponent::kOptimizer);
    TrainSpec with = train;
    if (mezo) {  // no optimizer state: a plain SGD stands in for the checkpoint's (empty) one
      with.optimizer = OptimizerKind::kSgd;
      with.sgd_momentum = 0.0;
    }
    optimizer = MakeOptimizer(model_->TrainableParameters(), with);
  }
  Optimizer* replicated = optimizer.get();
  const std::vector<NamedParameter> mezo_params =
      mezo ? MezoOrder(model_->TrainableParameters()) : std::vector<NamedParameter>();
  LossScaler scaler(/*enabled=*/train.precision == Precision::kFp16);
  NonFiniteSteps nonfinite;
  model_->set_training(true);
  TrainResult result;
  result.steps = plan_.total_steps;
  int64_t first_step = 0;
  {
    // Dropout draws from the CPU generator: seed it so a run is reproducible from its spec.
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_current_seed(train.seed);
  }
  if (resume_) {
    const TrainingState& state = resume_->state;
    LATHE_RETURN_IF_ERROR(Annotate(sampler.Restore(state.cursor), resume_->dir));
    if (sharded_) {
      LATHE_RETURN_IF_ERROR(sharded_->Restore(*resume_));
    } else {
      LATHE_RETURN_IF_ERROR(optimizer->RestoreState(resume_->optimizer, state.optimizer_steps));
    }
    SetCpuRngState(state.rng_state);
    scaler.Restore(state.loss_scale);
    nonfinite = {state.skipped_steps, state.consecutive_nonfinite};
    first_step = state.step;
    result.resumed_from_step = first_step;
    result.final_loss = state.last_loss;
    resume_.reset();  // the mapped files are no longer needed
  }
  int64_t timed_tokens = 0;
  double timed_seconds = 0.0;
  int64_t timed_steps = 0;
  const auto start = std::chrono::steady_clock::now();
  const at::Device device = model_->options().device;
  const int cuda_device = device.has_index() ? device.index() : 0;
  // Closes a capture still open when Run returns early (an error, a stop).
  StepProfiler profiler(options_.profile, options_.rank, device, mapped_weight_bytes_, tracker);
  for (int64_t step = first_step; step < plan_.total_steps; ++step) {
    const auto step_start = std::chrono::steady_clock::now();
    tracker->ResetPeaks();
    if (device.is_cuda()) ResetCudaPeak(cuda_device);
    profiler.BeforeStep(step + 1);
    // Until the step and its checkpoint are done (reset before profiler.AfterStep).
    std::optional<ProfileScope> step_scope;
    step_scope.emplace("step", step + 1);
    StepReport report;
    report.step = step + 1;
    report.steps = plan_.total_steps;
    report.lr = LearningRate(train.schedule, train.lr, step, plan_.total_steps);
    std::vector<Sequence> batch;
    {
      ProfileScope scope("data/batch");
      for (int64_t i = 0; i < train.global_batch; ++i) {
        batch.push_back(sampler.Next());
        report.tokens += static_cast<int64_t>(batch.back().input_ids.size());
      }
    }
    try {
      LATHE_RETURN_IF_ERROR(mezo ? TrainZerothOrder(batch, mezo_params, report)
                                 : TrainOn(batch, replicated, scaler, report));
    } catch (const c10::Error& e) {
      // A collective that failed inside forward or backward keeps its own code.
      if (sharded_ && !sharded_->error().ok()) {
        return Annotate(sharded_->error(), absl::StrCat("training step ", step + 1));
      }
      return StatusFromTorchError(e, absl::StrCat("training step ", step + 1));
    }
    if (report.skipped) {
      ++nonfinite.skipped;
      if (++nonfinite.consecutive >= train.max_nonfinite_steps) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "training step %d: the loss or the gradients were not finite in %d consecutive "
            "steps (train.max_nonfinite_steps: %d; last loss %s, gradient norm %s, loss scale "
            "%g); lower train.lr, check the data or the model's weights, or train in bf16",
            step + 1, nonfinite.consecutive, train.max_nonfinite_steps,
            NumberText(report.loss.value_or(std::nan(""))), NumberText(report.grad_norm),
            report.loss_scale));
      }
    } else {
      nonfinite.consecutive = 0;
      if (report.loss) result.final_loss = report.loss;
    }
    result.skipped_steps = nonfinite.skipped;
    report.skipped_steps = nonfinite.skipped;
    report.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
    if (std::optional<CudaMemory> gpu;
        device.is_cuda() && (gpu = CudaMemoryOf(cuda_device)).has_value()) {
      CudaStepMemory(replicated, gpu->peak_bytes, report);
    } else {
      const MemorySnapshot memory = tracker->Snapshot();
      for (int i = 0; i < kNumMemoryComponents; ++i) report.memory_at_peak[i] = memory.at_peak[i];
      report.memory_at_peak[static_cast<int>(MemoryComponent::kWeights)] += mapped_weight_bytes_;
      report.peak_bytes = memory.total.peak_bytes + mapped_weight_bytes_;
    }
    result.peak_bytes = std::max(result.peak_bytes, report.peak_bytes);
    if (eval_data_ && train.eval_every > 0 && (step + 1) % train.eval_every == 0 && Evaluates()) {
      ProfileScope scope("eval");
      model_->set_training(false);
      LATHE_ASSIGN_OR_RETURN(Evaluation eval,
                             Evaluate(*model_, *eval_data_, spec_.data.seq_len, false));
      model_->set_training(true);
      report.eval_loss = eval.loss;
    }
    if (step > first_step || plan_.total_steps == 1) {
      timed_tokens += report.tokens;
      timed_seconds += report.seconds;
      ++timed_steps;
    }
    report.mean_step_seconds = timed_steps > 0 ? timed_seconds / timed_steps : report.seconds;
    report.mfu =
        Mfu(model_flops_per_token_, report.seconds > 0 ? report.tokens / report.seconds : 0,
            peak_flops_, options_.world_size);
    report.products = products_;
    on_step(report);
    // A stop asked of one rank stops them all, after the same step.
    double stops = stop_requested_.load() ? 1.0 : 0.0;
    LATHE_RETURN_IF_ERROR(SumAcrossRanks(&stops, "agreeing whether to stop"));
    const bool stop = stops > 0;
    const bool periodic = train.checkpoint_every > 0 && (step + 1) % train.checkpoint_every == 0 &&
                          step + 1 < plan_.total_steps;
    if ((stop || periodic) && (options_.rank == 0 || sharded_)) {
      LATHE_RETURN_IF_ERROR(
          SaveCheckpoint(step + 1, replicated, sampler, scaler, nonfinite, result.final_loss));
      if (on_checkpoint) on_checkpoint(step + 1, checkpoints_->StepDir(step + 1));
    }
    step_scope.reset();
    profiler.AfterStep(step + 1);
    if (stop) {
      return absl::CancelledError(absl::StrCat("stopped after step ", step + 1,
                                               "; started again, the run resumes from ",
                                               checkpoints_->dir()));
    }
  }
  profiler.Finish(plan_.total_steps, "training finished");
  model_->set_training(false);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.tokens_per_second = timed_seconds > 0 ? timed_tokens / timed_seconds : 0.0;

  if (eval_data_ && Evaluates()) {
    LATHE_ASSIGN_OR_RETURN(Evaluation eval,
                           Evaluate(*model_, *eval_data_, spec_.data.seq_len, false));
    result.eval_loss = eval.loss;
  }
  if (!sharded_) {
    for (const NamedParameter& p : model_->TrainableParameters()) {
      LATHE_RETURN_IF_ERROR(CheckFinite(p.name, p.tensor));
    }
  }
  auto export_output = [&]() -> absl::Status {
    if (sharded_) {
      LATHE_RETURN_IF_ERROR(ExportSharded(result));
    } else if (options_.rank != 0) {
      // rank 0 writes the output
    } else if (TrainsLora(spec_)) {
      result.adapter_dir = (fs::path(spec_.output) / "adapter").string();
      LATHE_RETURN_IF_ERROR(model_->ExportAdapter(
          result.adapter_dir, AdapterConfigOf(submitted_spec_, model_->lora_targets())));
    } else {
      result.model_dir = (fs::path(spec_.output) / "model").string();
      LATHE_RETURN_IF_ERROR(model_->ExportModel(result.model_dir));
    }
    if (options_.rank != 0 || result.model_dir.empty()) return absl::OkStatus();
    return CopyModelSideFiles(spec_.model.path, result.model_dir);
  };
  // Rank 0 writes under the fence: a stale attempt exports nothing.
  LATHE_RETURN_IF_ERROR(options_.rank == 0 ? checkpoints_->Fenced(export_output) : export_output());
  if (options_.rank != 0) {
    result.adapter_dir.clear();
    result.model_dir.clear();
  }
  result.peak_rss_bytes = PeakRssBytes();
  return result;
}

absl::Status Trainer::ExportSharded(TrainResult& result) {
  const bool writer = options_.rank == 0;
  if (TrainsLora(spec_)) {
    // The adapter is small: gathered whole on every rank, written by rank 0.
    TensorsToWrite tensors;
    LATHE_RETURN_IF_ERROR(sharded_->ForEachTrainableUnit(
        [&](int64_t, const std::vector<std::pair<std::string, at::Tensor>>& named) {
          for (const auto& [name, tensor] : named) {
            if (absl::Status finite = CheckFinite(name, tensor); !finite.ok()) return finite;
            if (writer) tensors.Add(name, tensor);
          }
          return absl::OkStatus();
        }));
    result.adapter_dir = (fs::path(spec_.output) / "adapter").string();
    return writer ? WritePeftAdapter(result.adapter_dir,
                                     AdapterConfigOf(submitted_spec_, model_->lora_targets()),
                                     tensors.tensors())
                  : absl::OkStatus();
  }
  // The model, unit by unit into Hugging Face shard files: never whole on one rank.
  result.model_dir = (fs::path(spec_.output) / "model").string();
  const std::string& dir = result.model_dir;
  std::error_code error;
  if (writer) fs::create_directories(dir, error);
  if (error) return absl::InternalError(absl::StrCat(dir, ": ", error.message()));
  const int64_t files = sharded_->num_units();
  nlohmann::ordered_json index;
  int64_t total_bytes = 0;
  LATHE_RETURN_IF_ERROR(sharded_->ForEachTrainableUnit(
      [&](int64_t unit, const std::vector<std::pair<std::string, at::Tensor>>& named) {
        for (const auto& [name, tensor] : named) {
          if (absl::Status finite = CheckFinite(name, tensor); !finite.ok()) return finite;
        }
        if (!writer) return absl::OkStatus();
        const std::string file = absl::StrFormat("model-%05d-of-%05d.safetensors", unit + 1, files);
        TensorsToWrite tensors;
        for (const auto& [name, tensor] : named) {
          tensors.Add(name, tensor);
          index["weight_map"][name] = file;
          total_bytes += tensor.numel() * tensor.element_size();
        }
        return WriteSafetensors(dir + "/" + file, tensors.tensors(), {{"format", "pt"}});
      }));
  if (!writer) return absl::OkStatus();
  index["metadata"]["total_size"] = total_bytes;
  LATHE_RETURN_IF_ERROR(
      WriteFileAtomically(dir + "/model.safetensors.index.json", index.dump(2) + "\n"));
  return model_->WriteExportedConfig(dir);
}

bool Trainer::Evaluates() const {
  return options_.rank == 0 || (sharded_ && sharded_->stage() == 3);
}

absl::Status Trainer::SumAcrossRanks(double* value, absl::string_view what) {
  if (options_.world_size == 1) return absl::OkStatus();
  ProfileScope scope("comm/all_reduce/scalars");
  if (options_.comm->memory() == CommMemory::kHost) {
    return Annotate(options_.comm->AllReduceSum(value, 1, CommDType::kFloat64), what);
  }
  at::Tensor staged =
      at::full({1}, *value, at::TensorOptions(at::kDouble).device(model_->options().device));
  LATHE_RETURN_IF_ERROR(SumAcrossRanks(staged, what));
  *value = staged.item<double>();
  return absl::OkStatus();
}

absl::Status Trainer::SumAcrossRanks(const at::Tensor& values, absl::string_view what) {
  if (options_.world_size == 1) return absl::OkStatus();
  ProfileScope scope("comm/all_reduce/scalars");
  return Annotate(options_.comm->AllReduceSum(
                      values.data_ptr(), static_cast<size_t>(values.numel()), CommDType::kFloat64),
                  what);
}

absl::Status Trainer::AllRanksOk(const absl::Status& status, absl::string_view what) {
  double failed = status.ok() ? 0.0 : 1.0;
  absl::Status sum = SumAcrossRanks(&failed, what);
  if (!status.ok()) return status;
  LATHE_RETURN_IF_ERROR(sum);
  if (failed > 0) {
    return absl::AbortedError(
        absl::StrCat(static_cast<int64_t>(failed), " other rank(s) failed ", what));
  }
  return absl::OkStatus();
}

absl::Status Trainer::TrainZerothOrder(const std::vector<Sequence>& batch,
                                       const std::vector<NamedParameter>& params,
                                       StepReport& report) {
  const TrainSpec& train = spec_.train;
  int64_t targets = 0;
  for (const Sequence& s : batch) targets += CountTargets(s);
  if (targets == 0) return absl::OkStatus();  // nothing to learn from: no update
  const at::Device device = model_->options().device;
  const int64_t per_rank = train.global_batch / options_.world_size;
  const int64_t begin = options_.rank * per_rank;
  PhaseSeconds& phases = report.phases;
  auto lap = Laps(report.phase_products);
  // The step's loss at the perturbed weights, summed over every rank's sequences.
  auto loss_here = [&]() -> absl::StatusOr<double> {
    at::NoGradGuard no_grad;
    MemoryScope scope(MemoryComponent::kActivations);
    double sum = 0.0;
    for (int64_t m = begin; m < begin + per_rank; m += plan_.strategy.micro_batch) {
      std::vector<Sequence> micro(batch.begin() + m,
                                  batch.begin() + m + plan_.strategy.micro_batch);
      at::Tensor ids, labels;
      {
        ProfileScope collate_scope("data/collate");
        std::tie(ids, labels) = Collate(micro);
      }
      at::Tensor hidden;
      {
        ProfileScope forward_scope("forward");
        hidden = model_->Hidden(ids.to(device));
      }
      ProfileScope loss_scope("loss");
      sum += model_->SumLossOfHidden(hidden, labels.to(device)).item<double>();
    }
    phases.forward += lap(ProductPhase::kForward);
    LATHE_RETURN_IF_ERROR(SumAcrossRanks(&sum, "summing the loss across ranks"));
    phases.comm += lap();
    return sum / static_cast<double>(targets);
  };
  const uint64_t seed = MezoSeed(train.seed, report.step);
  const double eps = spec_.mezo.eps;
  auto perturb = [&](double scale) {
    ProfileScope profile_scope("optimizer");
    MemoryScope scope(MemoryComponent::kOptimizer);
    MezoPerturb(params, seed, scale);
    phases.optimizer += lap(ProductPhase::kOptimizer);
  };
  perturb(eps);
  LATHE_ASSIGN_OR_RETURN(const double plus, loss_here());
  perturb(-2 * eps);
  LATHE_ASSIGN_OR_RETURN(const double minus, loss_here());
  perturb(eps);
  const double projected = (plus - minus) / (2 * eps);
  report.loss = (plus + minus) / 2;
  report.grad_norm = std::abs(projected);
  if (!std::isfinite(plus) || !std::isfinite(minus)) {
    report.skipped = true;
    return absl::OkStatus();
  }
  ProfileScope profile_scope("optimizer");
  MemoryScope scope(MemoryComponent::kOptimizer);
  MezoUpdate(params, seed, projected, report.lr, train.weight_decay);
  phases.optimizer += lap(ProductPhase::kOptimizer);
  return absl::OkStatus();
}

absl::Status Trainer::TrainOn(const std::vector<Sequence>& batch, Optimizer* optimizer,
                              LossScaler& scaler, StepReport& report) {
  const TrainSpec& train = spec_.train;
  int64_t targets = 0;
  for (const Sequence& s : batch) targets += CountTargets(s);
  if (targets == 0) return absl::OkStatus();  // nothing to learn from: no update
  report.loss_scale = scaler.scale();
  const at::Device device = model_->options().device;
  // Summed on the device (float64, as the host would), read once the ranks' sums are in.
  at::Tensor loss_sum = at::zeros({1}, at::TensorOptions(at::kDouble).device(device));
  const int64_t per_rank = train.global_batch / options_.world_size;
  const int64_t begin = options_.rank * per_rank;
  PhaseSeconds& phases = report.phases;
  auto lap = Laps(report.phase_products);
  for (int64_t m = begin; m < begin + per_rank; m += plan_.strategy.micro_batch) {
    std::vector<Sequence> micro(batch.begin() + m, batch.begin() + m + plan_.strategy.micro_batch);
    at::Tensor ids, labels;
    {
      ProfileScope scope("data/collate");
      std::tie(ids, labels) = Collate(micro);
    }
    lap();  // collating is not one of the phases
    at::Tensor loss;
    {
      MemoryScope scope(MemoryComponent::kActivations);
      at::Tensor hidden;
      {
        ProfileScope forward_scope("forward");
        hidden = model_->Hidden(ids.to(device));
      }
      phases.forward += lap(ProductPhase::kForward);
      ProfileScope loss_scope("loss");
      // A copy, counted as activations: the loss kernel's scalar is allocated under the
      // logits' scope, and kept through backward it showed at a checkpointed step's peak as
      // "logits 4 B" (issue #32). Nothing saves the original, so it goes at once.
      loss = model_->SumLossOfHidden(hidden, labels.to(device)).clone();
      phases.loss += lap(ProductPhase::kLoss);
    }
    ProfileScope backward_scope("backward");
    MemoryScope scope(MemoryComponent::kGradients);
    // Normalised over the whole step's targets, so that accumulation does not change the
    // update; multiplied by the loss scale (1 unless fp16).
    (loss * (scaler.scale() / static_cast<double>(targets))).backward();
    loss_sum += loss.detach().to(at::kDouble);
    phases.backward += lap(ProductPhase::kBackward);
  }
  {
    // At ZeRO-2 and -3 most of the reduction already ran during backward.
    MemoryScope scope(MemoryComponent::kCommBuffers);
    if (sharded_) {
      LATHE_RETURN_IF_ERROR(sharded_->FinishBackward());
    } else if (options_.world_size > 1) {
      LATHE_RETURN_IF_ERROR(AllReduceGradients(*optimizer));
    }
    const double reduce_seconds = lap();
    LATHE_RETURN_IF_ERROR(SumAcrossRanks(loss_sum, "summing the loss across ranks"));
    // Sharded: the time blocked on every collective of the step so far, those inside forward
    // and backward (and so inside those phases too) included; the optimizer's come below.
    phases.comm += (sharded_ ? sharded_->TakeCommSeconds() : reduce_seconds) + lap();
  }
  ProfileScope optimizer_scope("optimizer");  // unscaling, norm, clipping, the update
  auto scale_grads = [&](double factor) {
    sharded_ ? sharded_->ScaleGrads(factor) : optimizer->ScaleGrads(factor);
  };
  auto zero_grads = [&] { sharded_ ? sharded_->ZeroGrad() : optimizer->ZeroGrad(); };
  report.loss = loss_sum.item<double>() / static_cast<double>(targets);
  if (scaler.scale() != 1.0) scale_grads(1.0 / scaler.scale());
  if (sharded_) {
    LATHE_ASSIGN_OR_RETURN(report.grad_norm, sharded_->GradNorm());
  } else {
    report.grad_norm = optimizer->GradNorm();
  }
  // Every rank sees the same summed loss and gradient norm, so every rank decides alike.
  const bool finite = std::isfinite(*report.loss) && std::isfinite(report.grad_norm);
  if (!scaler.Update(finite)) {
    report.skipped = true;
    zero_grads();
    return absl::OkStatus();
  }
  if (train.max_grad_norm > 0) {
    double coef = train.max_grad_norm / (report.grad_norm + 1e-6);
    if (coef < 1.0) scale_grads(coef);
  }
  {
    MemoryScope scope(MemoryComponent::kOptimizer);
    if (sharded_) {
      LATHE_RETURN_IF_ERROR(sharded_->Step(report.lr));
    } else {
      optimizer->Step(report.lr);
    }
  }
  zero_grads();
  phases.optimizer += lap(ProductPhase::kOptimizer);
  if (sharded_) phases.comm += sharded_->TakeCommSeconds();
  return absl::OkStatus();
}

void Trainer::CudaStepMemory(const Optimizer* optimizer, int64_t peak_bytes,
                             StepReport& report) const {
  auto& at_peak = report.memory_at_peak;
  at_peak.fill(0);
  auto set = [&at_peak](MemoryComponent c, int64_t bytes) { at_peak[static_cast<int>(c)] = bytes; };
  if (sharded_) {
    const ShardBytes bytes = sharded_->bytes();
    set(MemoryComponent::kWeights, bytes.frozen);
    set(MemoryComponent::kTrainable, bytes.trainable);
    set(MemoryComponent::kGradients, bytes.gradients);
    set(MemoryComponent::kOptimizer, bytes.optimizer);
  } else {
    int64_t trainable = 0;
    for (const NamedParameter& p : optimizer->params()) trainable += p.tensor.nbytes();
    const bool full = TrainsFullWeights(spec_);
    set(MemoryComponent::kWeights,
        full ? 0
             : ParameterCount(model_config_) * c10::elementSize(model_->options().weight_dtype));
    set(MemoryComponent::kTrainable, trainable);
    set(MemoryComponent::kGradients, trainable);
    set(MemoryComponent::kOptimizer, optimizer->paged() ? 0 : optimizer->StateBytes());
  }
  int64_t fixed = 0;
  for (int64_t bytes : at_peak) fixed += bytes;
  at_peak[static_cast<int>(MemoryComponent::kActivations)] =
      std::max<int64_t>(0, peak_bytes - fixed);
  report.peak_bytes = std::max(peak_bytes, fixed);
}

int64_t Trainer::resume_step() const { return resume_ ? resume_->state.step : 0; }

absl::Status Trainer::SaveCheckpoint(int64_t step, const Optimizer* optimizer,
                                     const SequenceSampler& sampler, const LossScaler& scaler,
                                     const NonFiniteSteps& nonfinite, std::optional<double> loss) {
  ProfileScope scope("checkpoint/save");
  TrainingState state;
  state.step = step;
  state.optimizer_steps = sharded_ ? sharded_->optimizer_steps() : optimizer->steps();
  state.cursor = sampler.cursor();
  state.rng_state = CpuRngState();
  state.last_loss = loss;
  state.loss_scale = scaler.state();
  state.skipped_steps = nonfinite.skipped;
  state.consecutive_nonfinite = nonfinite.consecutive;
  state.spec_fingerprint = spec_fingerprint_;
  const std::string what = absl::StrCat("checkpoint at step ", step);
  if (sharded_) {
    // Every rank writes its slices; rank 0 prepares the directory and commits it.
    state.shard_world = options_.world_size;
    const bool first = options_.rank == 0;
    LATHE_RETURN_IF_ERROR(
        AllRanksOk(Annotate(first ? checkpoints_->Prepare(step) : absl::OkStatus(), what), what));
    absl::Status written;
    try {
      TensorsToWrite slices;
      sharded_->AddShardTo(&slices);
      written = WriteSafetensors(
          (fs::path(checkpoints_->TempDir(step)) / ShardFileName(options_.rank)).string(),
          slices.tensors());
    } catch (const c10::Error& e) {
      written = StatusFromTorchError(e, "preparing a checkpoint");
    }
    LATHE_RETURN_IF_ERROR(AllRanksOk(Annotate(written, what), what));
    return AllRanksOk(Annotate(first ? checkpoints_->Commit(state) : absl::OkStatus(), what), what);
  }
  TensorsToWrite trainable, moments;
  try {
    for (const NamedParameter& p : optimizer->params()) trainable.Add(p.name, p.tensor);
    optimizer->AddStateTo(&moments);
  } catch (const c10::Error& e) {
    return StatusFromTorchError(e, "preparing a checkpoint");
  }
  return Annotate(checkpoints_->Save(state, trainable.tensors(), moments.tensors()), what);
}

absl::Status Trainer::AllReduceGradients(Optimizer& optimizer) {
  ProfileScope scope("comm/all_reduce/gradients");
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const NamedParameter& p : optimizer.params()) {
    const at::Tensor& grad = p.tensor.grad();
    grads.push_back(grad.defined() ? grad.reshape({-1})
                                   : at::zeros({p.tensor.numel()}, p.tensor.options()));
  }
  at::Tensor flat = at::cat(grads).contiguous();
  LATHE_RETURN_IF_ERROR(
      Annotate(options_.comm->AllReduceSum(flat.data_ptr<float>(),
                                           static_cast<size_t>(flat.numel()), CommDType::kFloat32),
               "summing gradients across ranks"));
  int64_t offset = 0;
  for (const NamedParameter& p : optimizer.params()) {
    at::Tensor slice = flat.slice(0, offset, offset + p.tensor.numel()).view(p.tensor.sizes());
    if (p.tensor.grad().defined()) {
      p.tensor.mutable_grad().copy_(slice);
    } else {
      p.tensor.mutable_grad() = slice.clone();
    }
    offset += p.tensor.numel();
  }
  return absl::OkStatus();
}

}  // namespace lathe
