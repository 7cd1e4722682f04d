// The optimizers the engine trains with on a replicated model (docs/training.md,
// "Optimizers"): AdamW as torch.optim.AdamW; block-wise 8-bit AdamW; Adafactor with a
// factored second moment; SGD with momentum as torch.optim.SGD. Each updates the trainable
// tensors in place from their .grad(), and names its state tensors for checkpoints. Paged
// (train.paged_optimizer), the state lives in host memory (pinned when the parameters are on
// CUDA) and each parameter's is copied to its device for its update and back. The
// updates are written as libtorch ops in a fixed order, which the Python reference
// (tests/reference) repeats: run single-threaded, both give bitwise the same result.
//
// Thread-safety: not thread-safe.
#ifndef LATHE_WORKER_ENGINE_OPTIMIZER_H_
#define LATHE_WORKER_ENGINE_OPTIMIZER_H_

#include <cstdint>
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

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update with learning rate `lr` from the parameters' .grad(); parameters without
  // a gradient are skipped.
  void Step(double lr);
  // Sets every gradient to undefined (frees its memory).
  void ZeroGrad();
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

 protected:
  Optimizer(std::vector<NamedParameter> params, bool paged);
  // Adds a state tensor of parameter `param` (zero-initialised by the caller); paged, it is
  // moved to host memory.
  void AddState(size_t param, std::string name, at::Tensor tensor);
  // The update of parameter `i` at step steps() (already counted).
  virtual void Update(size_t i, at::Tensor& param, const at::Tensor& grad, double lr) = 0;
  // The state tensors of parameter `i`, in the order added.
  std::vector<at::Tensor>& state(size_t i) { return state_[i]; }
  // Multiplies `param` by 1 - lr * weight_decay when the parameter decays.
  void DecoupledDecay(size_t i, at::Tensor& param, double lr, double weight_decay) const;

 private:
  std::vector<NamedParameter> params_;
  const bool paged_;
  std::vector<std::vector<at::Tensor>> state_;
  std::vector<std::vector<std::string>> state_names_;
  int64_t steps_ = 0;
};

// The optimizer `train.optimizer` names, with its hyperparameters from `train`.
std::unique_ptr<Optimizer> MakeOptimizer(std::vector<NamedParameter> params,
                                         const TrainSpec& train);

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_OPTIMIZER_H_
