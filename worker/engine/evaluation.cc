#include "worker/engine/evaluation.h"

#include <limits>

namespace lathe {

absl::StatusOr<Evaluation> Evaluate(const CausalLm& model, const TokenDataset& data,
                                    int64_t seq_len, bool keep_logits) {
  Evaluation result;
  double loss_sum = 0.0;
  try {
    at::NoGradGuard no_grad;
    const at::Device device = model.options().device;
    for (const Document& doc : data.documents()) {
      int64_t len = std::min<int64_t>(seq_len, static_cast<int64_t>(doc.input_ids.size()));
      at::Tensor ids =
          at::tensor(at::ArrayRef<int64_t>(doc.input_ids.data(), len)).view({1, len}).to(device);
      at::Tensor labels =
          at::tensor(at::ArrayRef<int64_t>(doc.labels.data(), len)).view({1, len}).to(device);
      if (keep_logits) result.logits.push_back(model.Logits(ids)[0].cpu().contiguous());
      int64_t targets = labels.slice(1, 1).ne(kIgnoreLabel).sum().item<int64_t>();
      if (targets == 0) continue;
      loss_sum += model.SumLoss(ids, labels).item<double>();
      result.targets += targets;
    }
  } catch (const c10::Error& e) {
    return StatusFromTorchError(e, "evaluating");
  }
  result.loss = result.targets > 0 ? loss_sum / static_cast<double>(result.targets)
                                   : std::numeric_limits<double>::quiet_NaN();
  return result;
}

}  // namespace lathe
