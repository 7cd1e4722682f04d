// The optimizers the engine trains with on a replicated model (docs/training.md,
// "Optimizers"): AdamW as torch.optim.AdamW; block-wise 8-bit AdamW; Adafactor with a
// factored second moment; SGD with momentum as torch.optim.SGD. Each updates the trainable
// tensors in place from their .grad(), and names its state tensors for checkpoints. Paged
// (train.paged_optimizer), the state lives in host memory (pinned when the parameters are on
// CUDA) and each parameter's is copied to its device for its update and back. The
// updates are written as libtorch ops in a fixed order, which the Python reference
// (tests/reference) repeats: run single-threaded, both give bitwise the same result.
//
// Under ZeRO (worker/shard) each rank's optimizer updates only the elements it owns: every
// parameter it is given is then a 1-D piece of a whole tensor (OptimizerSharding), possibly
// empty. Element-wise state (AdamW's and SGD's) is the same as on the whole tensor; 8-bit
// AdamW quantizes each piece in its own blocks; Adafactor keeps every tensor's factored
// statistics whole on every rank, summing the pieces' row and column sums (and the update's
// RMS) over the ranks, so that its update is the whole tensor's.
//
// Thread-safety: not thread-safe.
#ifndef LATHE_WORKER_ENGINE_OPTIMIZER_H_
#define LATHE_WORKER_ENGINE_OPTIMIZER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "common/safetensors.h"
#include "kernels/ops/torch_compat.h"
#include "worker/engine/causal_lm.h"
#include "worker/engine/weights.h"

namespace lathe {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

// 8-bit AdamW: tensors with fewer elements keep float32 moments; larger ones are quantized
// in blocks of kBlock8bit elements of their flattened values.
inline constexpr int64_t kMin8bitElements = 4096;
inline constexpr int64_t kBlock8bit = 2048;

// Whether 8-bit AdamW keeps float32 moments for the tensor `name` whatever its size: the
// token embeddings, as bitsandbytes advises (their rows of tokens absent from a batch get no
// gradient; where such a row's second moment was quantized to 0 and its first was not, the
// update would be m / eps, hundreds of times the learning rate).
bool KeepsFloat32Moments(absl::string_view name);

// Where each parameter given to a sharded optimizer lies in its whole tensor, and how to sum
// over the ranks.
struct OptimizerSharding {
  struct Piece {
    std::vector<int64_t> shape;  // the whole tensor's
    int64_t offset = 0;          // of the piece's first element in the flattened tensor
  };
  std::vector<Piece> pieces;  // by parameter
  // Sums a float32 tensor in place over the ranks: a collective that every rank calls in the
  // same order with the same sizes. Throws c10::Error when it fails.
  std::function<void(at::Tensor&)> sum_over_ranks;
};

// How a state tensor relates to its parameter: element by element (AdamW's moments: under
// ZeRO any rank's piece can be read from any layout), in blocks of the parameter (8-bit codes
// and block maxima: tied to the piece they quantize), or of the whole tensor (Adafactor's
// row and column statistics, the same on every rank).
enum class StateLayout { kElementwise, kBlocks, kWholeTensor };

class Optimizer {
 public:
  struct StateInfo {
    std::string kind;    // "exp_avg", "exp_avg_sq_row", ...
    std::string suffix;  // "" or ".codes", ".absmax"
    StateLayout layout;
  };

  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update with learning rate `lr` from the parameters' .grad(); parameters without
  // a gradient are skipped.
  void Step(double lr);
  // Sets every gradient to undefined (frees its memory).
  void ZeroGrad();
  // The same with the gradients given, by parameter (undefined: skipped).
  void Step(double lr, const std::vector<at::Tensor>& grads);
  // sqrt of the sum of squared gradient elements over all parameters.
  double GradNorm() const;
  // Multiplies every gradient by `factor`.
  void ScaleGrads(double factor);

  const std::vector<NamedParameter>& params() const { return params_; }
  int64_t steps() const { return steps_; }
  // Bytes of optimizer state held (moments, codes, block maxima, factored statistics).
  int64_t StateBytes() const;
  // Whether the state is paged from host memory (then none of it stays on the device).
  bool paged() const { return paged_; }

  // The state tensors under their checkpoint names ("exp_avg.<param>", ...).
  void AddStateTo(TensorsToWrite* out) const;
  // Restores the state written by AddStateTo and the step count. DATA_LOSS naming the file
  // and tensor when one is missing or has another shape or type.
  absl::Status RestoreState(const std::shared_ptr<const SafetensorsFile>& file, int64_t steps);

  // Parameter `i`'s state, for a sharded checkpoint: what each tensor is, and the tensor
  // (written in place to restore it). Its checkpoint name is kind.<param name>suffix.
  const std::vector<StateInfo>& state_info(size_t i) const { return state_info_[i]; }
  at::Tensor& state_tensor(size_t i, size_t k) { return state_[i][k]; }
  const at::Tensor& state_tensor(size_t i, size_t k) const { return state_[i][k]; }
  void set_steps(int64_t steps) { steps_ = steps; }

 protected:
  Optimizer(std::vector<NamedParameter> params, bool paged, const OptimizerSharding* sharding);
  // Adds a state tensor of parameter `param` (zero-initialised by the caller); paged, it is
  // moved to host memory.
  void AddState(size_t param, std::string kind, at::Tensor tensor,
                StateLayout layout = StateLayout::kElementwise, std::string suffix = "");
  // The update of parameter `i` at step steps() (already counted).
  virtual void Update(size_t i, at::Tensor& param, const at::Tensor& grad, double lr) = 0;
  // The state tensors of parameter `i`, in the order added.
  std::vector<at::Tensor>& state(size_t i) { return state_[i]; }
  // Multiplies `param` by 1 - lr * weight_decay when the parameter decays.
  void DecoupledDecay(size_t i, at::Tensor& param, double lr, double weight_decay) const;
  // Sharded: where parameter `i` lies in its tensor (nullptr when it is the whole tensor).
  const OptimizerSharding::Piece* piece(size_t i) const {
    return sharding_.pieces.empty() ? nullptr : &sharding_.pieces[i];
  }
  // Elements of parameter `i`'s whole tensor.
  int64_t WholeNumel(size_t i) const;
  void SumOverRanks(at::Tensor& t) const { sharding_.sum_over_ranks(t); }

 private:
  std::vector<NamedParameter> params_;
  const bool paged_;
  const OptimizerSharding sharding_;
  std::vector<std::vector<at::Tensor>> state_;
  std::vector<std::vector<StateInfo>> state_info_;
  int64_t steps_ = 0;
};

// The optimizer `train.optimizer` names, with its hyperparameters from `train`; with
// `sharding`, over the pieces of tensors a rank owns under ZeRO (copied).
std::unique_ptr<Optimizer> MakeOptimizer(std::vector<NamedParameter> params, const TrainSpec& train,
                                         const OptimizerSharding* sharding = nullptr);

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_OPTIMIZER_H_
