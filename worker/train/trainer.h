// Runs one training job in this process (docs/training.md): loads the model and data,
// trains for the spec's steps with gradient accumulation, AdamW, clipping and the LR
// schedule, and writes the adapter (LoRA) or the model (full fine-tuning) at the end.
//
// With several ranks (data parallel), every rank draws the same global batch of each step
// and trains on its contiguous share of it; the loss is normalised by the targets of the
// whole step, the gradients and the loss are summed across ranks, and every rank then takes
// the same optimizer step. The result therefore matches a single-rank run of the same spec
// up to floating-point summation order. Rank 0 writes the output. With strategy.zero_stage
// 1-3 the model, gradients and optimizer are sharded across the ranks (worker/shard,
// docs/sharding.md); the result is the same.
//
// Everything that can be checked is checked in Create, before any file is written: a job
// that fails validation leaves nothing behind, and a job that fails while training writes
// no output.
//
// Thread-safety: not thread-safe; one thread drives a Trainer.
#ifndef LATHE_WORKER_TRAIN_TRAINER_H_
#define LATHE_WORKER_TRAIN_TRAINER_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "common/memory_components.h"
#include "common/model_config.h"
#include "common/plan.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/token_dataset.h"
#include "worker/train/profiler.h"

namespace lathe {

class Optimizer;
class CausalLm;
class Communicator;
class LossScaler;
class ShardedModel;
struct NamedParameter;

struct TrainerOptions {
  int threads = 0;         // intra-op threads; 0 = every core
  int64_t rank = 0;        // this process's rank in the attempt
  int64_t world_size = 1;  // must equal the spec's resources.ranks
  // Connects the ranks when world_size > 1 (data parallel: every rank trains on its share
  // of each step's batch and the gradients are summed). Not owned; must outlive Run.
  Communicator* comm = nullptr;
  // Peak FLOP/s of this rank's device for MFU; 0: looked up (CUDA) or measured (CPU) by
  // PeakFlopsFor (peak_flops.h).
  double peak_flops = 0.0;
  // ZeRO-3: gather the next unit while the current one computes (worker/shard).
  bool prefetch = true;
  // The attempt this process belongs to (a task from the agent). With a generation > 0,
  // rank 0 claims <output>/checkpoints for it and every checkpoint and the exported output
  // are fenced (checkpoint.h): once a later attempt has claimed the directory, this one's
  // writes fail with FAILED_PRECONDITION. 0: unfenced (`lathe-worker train --spec`).
  std::string job_id{};  // (initialised, so that `{threads}` aggregates stay warning-free)
  int64_t generation = 0;
  // The spec as submitted, when the one given to Create reads its files through other paths
  // (common/allowed_roots.h: pinned below the allowed roots): a checkpoint's fingerprint and
  // the adapter's base model name its paths. Null: the spec given.
  std::shared_ptr<const JobSpec> submitted_spec{};
  // Profiling on request (profiler.h): where requests are looked for between steps, and
  // where their outcomes go. Default: off.
  ProfileOptions profile{};
};

// Wall time of a step's phases, summed over its micro-batches. On CUDA these are host times
// (kernels run asynchronously; the loss read-back at the end of backward synchronises).
struct PhaseSeconds {
  double forward = 0.0;   // embeddings to the final norm
  double loss = 0.0;      // LM head and cross-entropy
  double backward = 0.0;  // everything's backward (recomputation included)
  // Gradient sum across ranks; sharded (worker/shard), the time blocked on any collective,
  // also inside forward, backward and the optimizer step (and so inside those phases too).
  double comm = 0.0;
  double optimizer = 0.0;  // unscaling, norm, clipping, AdamW, zeroing
};

// The CPU kernel's matrix products (kernels/cpu/matmul.h, MatmulTotal) inside a step's phases,
// by phase and operand type: what their rate is against the roofline (bench/train_bench.py).
// Products that ops send to ATen (the small ones, and all on CUDA) are not counted. The counters
// are the process's: ranks run as threads (tests) count each other's products too.
enum class ProductPhase { kForward, kLoss, kBackward, kOptimizer };
inline constexpr int kNumProductPhases = 4;
enum class ProductType { kFloat32, kBFloat16 };
inline constexpr int kNumProductTypes = 2;
struct ProductTally {
  double flops = 0.0;
  double seconds = 0.0;
};
using PhaseProducts = std::array<std::array<ProductTally, kNumProductTypes>, kNumProductPhases>;

// What one optimizer step did.
struct StepReport {
  int64_t step = 0;            // 1-based
  int64_t steps = 0;           // total
  std::optional<double> loss;  // mean over the step's targets, before the update; unset
                               // when the step had no targets (and was skipped)
  double lr = 0.0;
  double grad_norm = 0.0;  // before clipping (after unscaling)
  // The loss or the gradients were not finite: the step made no update (docs/training.md,
  // "Precision"). `loss` then holds the non-finite value.
  bool skipped = false;
  int64_t skipped_steps = 0;        // steps skipped so far in the run, this one included
  double loss_scale = 1.0;          // fp16's dynamic loss scale during this step; else 1
  std::optional<double> eval_loss;  // at every train.eval_every-th step (rank 0)
  int64_t tokens = 0;               // input tokens, padding excluded
  double seconds = 0.0;
  // Mean seconds per step so far, the first (warm-up) step left out once there are others.
  double mean_step_seconds = 0.0;
  // Model FLOPs utilisation of this step (common/flops.h): tokens / seconds x model FLOPs
  // per token over world_size x peak_flops(); 0 when the peak is unknown.
  double mfu = 0.0;
  // What runs the matrix products (kernels/ops/matmul.h, ProductsBackend).
  std::string products;
  PhaseSeconds phases;
  PhaseProducts phase_products{};
  // Memory of this rank at the step's peak, by component (common/memory_components.h), in bytes;
  // the components sum to peak_bytes. On the CPU measured by the MemoryTracker (weights mapped from
  // the model file count as weights); on CUDA see CudaStepMemory.
  std::array<int64_t, kNumMemoryComponents> memory_at_peak{};
  int64_t peak_bytes = 0;
};

struct TrainResult {
  int64_t steps = 0;
  int64_t resumed_from_step = 0;  // 0 when the run started fresh
  int64_t skipped_steps = 0;      // steps skipped for a non-finite loss or gradient
  std::optional<double> final_loss;
  std::optional<double> eval_loss;  // when data.eval is set
  std::string adapter_dir;          // LoRA
  std::string model_dir;            // full fine-tuning
  double seconds = 0.0;
  double tokens_per_second = 0.0;  // over every step but the first (warm-up)
  int64_t peak_rss_bytes = 0;
  int64_t peak_bytes = 0;  // the largest step peak, as in StepReport
};

class Trainer {
 public:
  // Validates `spec` and `plan` against the engine (common/capabilities.h), each other
  // (CheckPlanRunsSpec), this process, the model directory and the data, and loads the
  // model. The plan is what runs: micro-batch, accumulation, checkpointing, chunked loss and
  // fused kernels come from it and nothing here chooses them again. Errors name the field
  // ("data.seq_len: ...", "model.path: ...", "data.train: /d/x.jsonl: line 3: ..."):
  // INVALID_ARGUMENT or NOT_FOUND for bad input, UNIMPLEMENTED for what the engine cannot
  // run, FAILED_PRECONDITION for what this process cannot (no GPU, no communicator).
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const JobSpec& spec, const Plan& plan,
                                                         const TrainerOptions& options);
  ~Trainer();

  // Trains to the end, calling `on_step` after every step, then writes the output. Resumes
  // from the newest valid checkpoint in <output>/checkpoints when there is one (see
  // checkpoint.h) and, with train.checkpoint_every, writes one every that many steps.
  // CANCELLED after RequestStop: the run stopped after a step and saved a checkpoint.
  // `on_checkpoint`, when set, is called after each checkpoint with its step and directory.
  absl::StatusOr<TrainResult> Run(
      const std::function<void(const StepReport&)>& on_step,
      const std::function<void(int64_t step, const std::string& dir)>& on_checkpoint = nullptr);

  // Asks Run to stop after the current step and write a checkpoint. Safe to call from any
  // thread and from a signal handler.
  void RequestStop() { stop_requested_.store(true); }

  // The step the run resumes from (0: fresh), and the checkpoints skipped as invalid.
  int64_t resume_step() const;
  const std::vector<std::string>& skipped_checkpoints() const { return skipped_checkpoints_; }

  int64_t total_steps() const { return plan_.total_steps; }
  // The plan being run (total_steps filled in when the spec gives epochs).
  const Plan& plan() const { return plan_; }
  // Model FLOPs per trained token (forward and backward, no recomputation) and the peak
  // FLOP/s of this rank's device: MFU's numerator per token and its denominator.
  double model_flops_per_token() const { return model_flops_per_token_; }
  double peak_flops() const { return peak_flops_; }

 private:
  Trainer() = default;
  // Steps skipped for a non-finite loss or gradient: in all, and the current run of them.
  struct NonFiniteSteps {
    int64_t skipped = 0;
    int64_t consecutive = 0;
  };

  // One optimizer step on `batch` (every rank's sequences of the step): forward and
  // backward over this rank's micro-batches, the gradient sum across ranks, then, when the
  // loss and the gradients are finite, clipping and the update. Fills report's loss,
  // grad_norm, loss_scale and skipped. `optimizer` is null when sharded_ holds the optimizer.
  // Throws c10::Error from libtorch.
  // One MeZO step (method mezo) on `batch`: two forward passes, the update along the step's
  // direction (worker/train/mezo.h). `params` in MeZO's order.
  absl::Status TrainZerothOrder(const std::vector<Sequence>& batch,
                                const std::vector<NamedParameter>& params, StepReport& report);
  absl::Status TrainOn(const std::vector<Sequence>& batch, Optimizer* optimizer, LossScaler& scaler,
                       StepReport& report);
  // The step's memory on CUDA: the caching allocator's peak, of which weights, trainable,
  // gradients and optimizer are their tensors' sizes and the rest counts as activations.
  void CudaStepMemory(const Optimizer* optimizer, int64_t peak_bytes, StepReport& report) const;
  // Sums every gradient across the ranks.
  absl::Status AllReduceGradients(Optimizer& optimizer);
  // Sums `*value` across the ranks (a no-op on one rank).
  absl::Status SumAcrossRanks(double* value, absl::string_view what);
  // The same for float64 tensors where the communicator's buffers live (the device of a
  // CUDA job), in place.
  absl::Status SumAcrossRanks(const at::Tensor& values, absl::string_view what);
  // OK when `status` is OK on every rank; else this rank's error, or ABORTED naming `what`
  // when only other ranks failed. A collective.
  absl::Status AllRanksOk(const absl::Status& status, absl::string_view what);
  absl::Status SaveCheckpoint(int64_t step, const Optimizer* optimizer,
                              const SequenceSampler& sampler, const LossScaler& scaler,
                              const NonFiniteSteps& nonfinite, std::optional<double> loss);
  // Writes the adapter or the model of a sharded run: every rank takes part, rank 0 writes.
  absl::Status ExportSharded(TrainResult& result);
  // Whether this rank evaluates: rank 0, and every rank at ZeRO-3 (the units are gathered
  // from all of them).
  bool Evaluates() const;

  JobSpec spec_;
  JobSpec submitted_spec_;  // options.submitted_spec, else spec_
  Plan plan_;
  TrainerOptions options_;
  ModelConfig model_config_;
  std::unique_ptr<CausalLm> model_;
  std::optional<TokenDataset> train_data_;
  std::optional<TokenDataset> eval_data_;
  double model_flops_per_token_ = 0.0;
  double peak_flops_ = 0.0;
  std::string products_;  // what runs the matrix products (StepReport::products)
  // Frozen weights read in place from the mapped model file: resident, but not allocated.
  int64_t mapped_weight_bytes_ = 0;
  std::string spec_fingerprint_;
  std::unique_ptr<CheckpointStore> checkpoints_;
  std::optional<LoadedCheckpoint> resume_;
  std::vector<std::string> skipped_checkpoints_;
  std::atomic<bool> stop_requested_{false};
  std::unique_ptr<Communicator> own_comm_;  // a single-rank group for a sharded run of one
  std::unique_ptr<ShardedModel> sharded_;   // ZeRO stages 1-3; null at stage 0
};

}  // namespace lathe

#endif  // LATHE_WORKER_TRAIN_TRAINER_H_
