// ZeRO stages 1-3 over a CausalLm (docs/sharding.md): FSDP-style units with flat buffers,
// each rank owning a contiguous 1/N slice of every unit, the optimizer on the slices, and
// optional CPU offload of the optimizer and (stage 3) of the parameter slices. The optimizer
// is any of worker/engine/optimizer.h's, over the pieces of tensors each rank owns.
//
//   stage 1  every rank holds the whole model and accumulates whole gradients over the
//            step's micro-batches; at the end of the step they are reduce-scattered unit by
//            unit, each rank updates its slice and the slices are all-gathered back.
//   stage 2  as 1, but each unit's gradient is reduce-scattered during backward, as soon as
//            the unit's backward is done (every micro-batch), and the whole gradient freed.
//   stage 3  as 2, and every unit's parameters (frozen base included, QLoRA's NF4 weights
//            as bytes) are sharded too: a unit is all-gathered just before its forward,
//            freed after it, gathered again just before its backward and freed after; with
//            prefetch the next unit's gather runs while the current one computes.
//
// The model calls the ShardedModel around every unit (CausalLm::set_unit_hooks); gradients
// arrive through autograd. The trainer then calls FinishBackward, GradNorm, ScaleGrads and
// Step, which are collectives: every rank calls them in the same order.
//
// Errors: a failed collective inside forward or backward throws c10::Error (autograd's only
// way out) and is kept: error() returns its status (ABORTED, DEADLINE_EXCEEDED, ...).
//
// Thread-safety: not thread-safe; the trainer's thread drives it (autograd calls back on the
// same thread on the CPU).
#ifndef LATHE_WORKER_SHARD_SHARDED_MODEL_H_
#define LATHE_WORKER_SHARD_SHARDED_MODEL_H_

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/flat_layout.h"
#include "common/strategy.h"
#include "worker/comm/communicator.h"
#include "worker/engine/causal_lm.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/weights.h"

namespace lathe {

struct ShardOptions {
  // Of the plan's strategy: the ZeRO stage (1, 2 or 3), offload_optimizer (optimizer state
  // and the optimizer step in host memory; the gradient slice is copied there and the
  // updated parameters copied back) and offload_params (stage 3: parameter slices in host
  // memory, copied to the device as a unit is gathered; the optimizer step then runs where
  // they are, the host). REQUIRES: zero_stage 1, 2 or 3 (Create refuses others).
  Strategy strategy;
  // Stage 3: start gathering the next unit (forward) or the previous one (backward) while
  // the current one computes.
  bool prefetch = true;
  // The optimizer and its hyperparameters (optimizer, adam_*, weight_decay, ...).
  TrainSpec train;
};

// Bytes this rank holds, by what they are (for the memory report on CUDA and the docs'
// formulas).
struct ShardBytes {
  int64_t frozen = 0;        // frozen weights: whole (stages 1-2) or the slices (stage 3)
  int64_t trainable = 0;     // trainable parameters: whole (stages 1-2) or the slices
  int64_t gradients = 0;     // whole (stage 1) or the slices
  int64_t optimizer = 0;     // optimizer state (and the master slice when offloaded)
  int64_t largest_unit = 0;  // the largest gathered unit (stage 3), frozen and trainable
};

class ShardedModel final : public UnitHooks {
 public:
  // Takes over `model`'s unit tensors (CausalLm::UnitTensors): for stage 3 the model must
  // have been loaded with ModelOptions::keep_mapped, and each rank copies only its slices.
  // Trainable tensors become views of flat buffers; the model is hooked. Neither `model`
  // nor `comm` is owned; both must outlive this. INVALID_ARGUMENT for a stage outside 1..3
  // or offload_params below stage 3.
  static absl::StatusOr<std::unique_ptr<ShardedModel>> Create(CausalLm* model, Communicator* comm,
                                                              const ShardOptions& options);
  ~ShardedModel() override;

  // UnitHooks.
  at::Tensor Enter(int64_t unit, const at::Tensor& input) override;
  at::Tensor Leave(int64_t unit, const at::Tensor& output) override;

  // After the last micro-batch's backward of a step: completes the gradient reduction, so
  // that every rank holds the sum over ranks and micro-batches of its gradient slices.
  absl::Status FinishBackward();
  // The L2 norm of the whole gradient (a collective; the same on every rank).
  absl::StatusOr<double> GradNorm();
  void ScaleGrads(double factor);
  // The optimizer on this rank's slices with learning rate `lr`, then (stages 1-2) the
  // updated slices all-gathered into every rank's whole parameters. Frees the gradients.
  absl::Status Step(double lr);
  // Frees the gradients without an update (a skipped step).
  void ZeroGrad();
  int64_t optimizer_steps() const { return optimizer_steps_; }

  // This rank's slices for a checkpoint: "unit.<u>.param" (the logical elements this rank
  // owns, padding excluded) and the optimizer state of its piece of each tensor under the
  // stage-0 names ("exp_avg.<tensor>", ...; the whole-tensor statistics from rank 0 only).
  void AddShardTo(TensorsToWrite* out) const;
  // Restores the trainable parameters and the optimizer state from `checkpoint`, written by
  // a run of any stage on any number of ranks (named tensors of a stage-0 run, or the slices
  // of AddShardTo with their world size in the state). DATA_LOSS naming the file and tensor
  // when one is missing or has another size; FAILED_PRECONDITION for 8-bit moments written
  // on another number of ranks (their blocks are the writer's pieces).
  absl::Status Restore(const LoadedCheckpoint& checkpoint);

  // Calls `fn` on every rank with each unit's whole trainable tensors by name (float32,
  // on the device), one unit at a time; at stage 3 each unit is all-gathered for the call
  // and freed after it (a collective: every rank calls this).
  absl::Status ForEachTrainableUnit(
      const std::function<
          absl::Status(int64_t unit, const std::vector<std::pair<std::string, at::Tensor>>&)>& fn);

  ShardBytes bytes() const;
  // Seconds this rank spent blocked on collectives since the last call: what communication
  // prefetch and the overlap with backward did not hide.
  double TakeCommSeconds();
  // The first collective error met inside forward or backward (OK when none).
  const absl::Status& error() const { return error_; }
  int64_t stage() const { return options_.strategy.zero_stage; }
  int64_t num_units() const { return static_cast<int64_t>(units_.size()); }

  // The autograd functions' callbacks (public for them; not for other callers).
  void UnitGradients(int64_t unit, const std::vector<at::Tensor>& grads);
  void BeforeBackward(int64_t use);
  void UseDone(int64_t use);
  // The trainable views of `unit`'s whole buffer, one per trainable tensor.
  std::vector<at::Tensor> TrainableViews(int64_t unit) const;

 private:
  struct Unit {
    std::vector<at::Tensor*> frozen_slots, trainable_slots;
    FlatLayout frozen, trainable;
    int64_t frozen_shard = 0, trainable_shard = 0;  // elements per rank (S)
    // Stage 3 with QLoRA: the unit's NF4 weights (codes, block codes, second-level maxima,
    // each at a multiple of 4 bytes) as one flat byte buffer, sharded like the frozen
    // weights; nf4_sizes: the element counts of each weight's three tensors.
    std::vector<kernels::Nf4Weight*> nf4_slots;
    std::vector<std::array<int64_t, 3>> nf4_sizes;
    FlatLayout nf4;
    int64_t nf4_shard = 0;
    // Stage 3: this rank's slices (host memory with offload_params).
    at::Tensor frozen_slice, trainable_slice, nf4_slice;
    // The whole unit, [world * S]: stages 1-2 keep the trainable one; stage 3 gathers all
    // and frees their storage when the unit is released.
    at::Tensor frozen_whole, trainable_whole, nf4_whole;
    int refs = 0;
    bool gathered = false;
    std::vector<std::unique_ptr<CommWork>> gathers;  // a gather in flight (prefetch)
    std::vector<at::Tensor> gather_inputs;           // kept alive until it is waited for
    // Gradients: the summed slice, and (stage 1) the whole gradient summed over the step.
    at::Tensor grad_slice, grad_whole;
    // Optimizer: the master slice (the device slice itself unless offloaded) and the
    // optimizer over its pieces, one per trainable tensor (pieces[i]: where tensor i's owned
    // elements lie in the slice; empty when this rank owns none).
    at::Tensor param_slice, master;
    std::vector<FlatRange> pieces;
    std::unique_ptr<Optimizer> optimizer;
  };
  // One forward pass through a unit (with the head's tied embeddings, two units): released
  // when its backward events (the input's gradient, the parameters' gradients) are done.
  struct Use {
    std::vector<int64_t> units;
    int pending = 0;
  };
  struct PendingReduce {
    int64_t unit;
    at::Tensor whole, slice;
    std::unique_ptr<CommWork> work;
  };

  ShardedModel(CausalLm* model, Communicator* comm, const ShardOptions& options);
  absl::Status Init();
  // Sums `t` (float32) over the ranks in place; throws c10::Error when it fails (the
  // sharded optimizer's sum_over_ranks).
  void SumOverRanks(at::Tensor& t);
  // Throws c10::Error after keeping `status` in error_.
  [[noreturn]] void Fail(const absl::Status& status);
  // Runs `wait` (a collective, or waiting for one) and adds its time to comm_seconds_.
  absl::Status Timed(const std::function<absl::Status()>& wait);
  void Check(const absl::Status& status) {
    if (!status.ok()) Fail(status);
  }
  void StartGather(int64_t unit);
  // Frees the storage of a unit's gathered buffers (their views stay, AllocateStorage gives
  // them data again).
  void FreeUnit(Unit& u);
  // Points the model's NF4 weights of `u` at their places in u.nf4_whole.
  void BindNf4(Unit& u);
  void Acquire(int64_t unit);
  void Release(int64_t unit);
  // Points the unit's slots at its gathered buffers; its trainable ones (views through a
  // UnitParams node of `use`, or plain views for -1) unless `trainables` is false.
  void Bind(int64_t unit, int64_t use, bool trainables = true);
  void DrainOneReduce();
  void ReleaseUse(int64_t use);
  at::Device device() const { return model_->options().device; }
  // Host memory for offloaded state: pinned on a CUDA job, so that copies are asynchronous.
  at::TensorOptions HostOptions(at::ScalarType dtype) const {
    return at::TensorOptions(dtype).device(at::kCPU).pinned_memory(device().is_cuda());
  }

  CausalLm* model_;
  Communicator* comm_;
  ShardOptions options_;
  int64_t rank_ = 0, world_ = 1;
  std::vector<Unit> units_;
  bool tied_ = false;
  // Tied and the tied weight trains (full fine-tuning): the head's use of unit 0 binds its
  // trainable tensors too. Otherwise (LoRA, a modules_to_save copy of embed_tokens) the head
  // reads only unit 0's frozen weight, and a UnitParams node it never differentiates would
  // keep the use, and unit 0 gathered, until the step's end.
  bool head_trains_embeddings_ = false;
  at::Tensor anchor_;  // an empty leaf that requires grad: the input of UnitParams nodes
  std::map<int64_t, Use> uses_;
  int64_t next_use_ = 0;
  std::vector<int64_t> current_use_;   // by unit: the use between Enter and Leave
  std::vector<bool> awaits_backward_;  // by unit: gathered again before its backward
  std::deque<PendingReduce> reduces_;
  int64_t optimizer_steps_ = 0;
  double comm_seconds_ = 0.0;
  absl::Status error_;
};

}  // namespace lathe

#endif  // LATHE_WORKER_SHARD_SHARDED_MODEL_H_
