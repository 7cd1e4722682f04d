// Model FLOPs per trained token and devices' peak FLOP/s: the two halves of MFU (model
// FLOPs utilisation), docs/training.md "MFU" gives the formula with its reasoning.
//
// A multiply-add counts as 2 FLOPs. Per token and per decoder layer, the forward pass costs
// 2 x (the projections' weights) plus, for LoRA, 2 x r x (in + out) per adapted projection,
// plus causal attention 2 x (seq_len + 1) x heads x head_dim (QK^T and AV, each position
// attending to (seq_len + 1) / 2 others on average); the LM head adds 2 x vocab x hidden.
// The backward pass costs twice the forward for everything that is trained (gradients for
// the inputs and for the weights), and once the forward for frozen weights (gradients for
// the inputs only): full fine-tuning is 3x the forward, LoRA 2x the frozen part plus 3x the
// adapters and the attention. Activation checkpointing runs the decoder blocks' forward
// once more: that is hardware FLOPs, not model FLOPs, so MFU leaves it out (HFU would not).
// Embedding lookups, norms, RoPE and the softmax are not counted (under 1% at real sizes).
//
// Thread-safety: pure functions.
#ifndef LATHE_COMMON_FLOPS_H_
#define LATHE_COMMON_FLOPS_H_

#include <optional>

#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "common/model_config.h"

namespace lathe {

// FLOPs of one training step per token of `seq_len`-token sequences, for `spec`'s method and
// LoRA targets on `config`. `recompute`: include activation checkpointing's second forward
// of the decoder blocks (hardware FLOPs); false gives the model FLOPs MFU divides.
double TrainingFlopsPerToken(const ModelConfig& config, const JobSpec& spec, int64_t seq_len,
                             bool recompute);

// The dense peak FLOP/s of a CUDA device from its name ("NVIDIA H100 80GB HBM3") for
// matrix products in `precision` (fp32 counts without TF32), from NVIDIA's data sheets;
// nullopt for a device not in the table.
std::optional<double> CudaPeakFlops(absl::string_view device_name, Precision precision);

// Model FLOPs utilisation: achieved model FLOP/s over the peak of `ranks` devices. 0 when
// the peak is unknown (<= 0).
double Mfu(double flops_per_token, double tokens_per_second, double peak_flops_per_rank,
           int64_t ranks);

}  // namespace lathe

#endif  // LATHE_COMMON_FLOPS_H_
