// Scoring a model on a token data set: mean next-token loss, optionally the logits.
//
// Thread-safety: not thread-safe (uses the model).
#ifndef LATHE_WORKER_ENGINE_EVALUATION_H_
#define LATHE_WORKER_ENGINE_EVALUATION_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/engine/causal_lm.h"
#include "worker/engine/token_dataset.h"

namespace lathe {

struct Evaluation {
  double loss = 0.0;               // mean over targets; NaN when there are none
  int64_t targets = 0;             // positions scored
  std::vector<at::Tensor> logits;  // per document [len, vocab] when requested
};

// Scores every document of `data` in file order, one at a time, each truncated to
// `seq_len` tokens, without gradients. INTERNAL/RESOURCE_EXHAUSTED on libtorch errors.
absl::StatusOr<Evaluation> Evaluate(const CausalLm& model, const TokenDataset& data,
                                    int64_t seq_len, bool keep_logits);

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_EVALUATION_H_
