// AdamW with decoupled weight decay, step for step as torch.optim.AdamW (single-tensor
// path): the engine owns its optimizer so that state can later be sharded and offloaded.
//
// Thread-safety: not thread-safe.
#ifndef LATHE_WORKER_ENGINE_ADAMW_H_
#define LATHE_WORKER_ENGINE_ADAMW_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
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

class AdamW {
 public:
  // `params` must stay the tensors the model trains (they are updated in place).
  AdamW(std::vector<NamedParameter> params, const AdamWOptions& options);

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

  // The moments, named "exp_avg.<param>" and "exp_avg_sq.<param>", for a checkpoint.
  void AddStateTo(TensorsToWrite* out) const;
  // Restores the moments written by AddStateTo and the step count. DATA_LOSS naming the
  // tensor when one is missing or has another shape.
  absl::Status RestoreState(const std::shared_ptr<const SafetensorsFile>& file, int64_t steps);

 private:
  std::vector<NamedParameter> params_;
  AdamWOptions options_;
  std::vector<at::Tensor> exp_avg_;
  std::vector<at::Tensor> exp_avg_sq_;
  int64_t steps_ = 0;
};

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_ADAMW_H_
