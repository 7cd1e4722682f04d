// The shape of a Hugging Face causal LM as the planner needs it (issue #11): exact parameter
// counts by tensor kind and by block, derived from the model's ModelConfig
// (common/model_config.h), the one description of config.json that the trainer, the
// coordinator's admission checks and the planner all read. Covers what ParseModelConfig
// accepts: the dense decoders of the Llama family (Llama, Mistral, Qwen2, Qwen3), Gemma 2 and
// Gemma 3 (text), and Phi-3.
//
// No libtorch, no I/O: pure functions (planner/ builds with the coordinator).
//
// Thread-safety: plain values and pure functions.
#ifndef LATHE_PLANNER_MODEL_SHAPE_H_
#define LATHE_PLANNER_MODEL_SHAPE_H_

#include <cstdint>

#include "common/model_config.h"

namespace lathe {

// Parameters of one decoder block by kind. Phi-3's fused qkv_proj and gate_up_proj count
// as the q/k/v and gate/up projections they hold.
struct BlockParams {
  int64_t attention = 0;       // q, k, v, o weights
  int64_t attention_bias = 0;  // q, k, v (and o) biases
  int64_t mlp = 0;             // gate, up, down weights
  int64_t mlp_bias = 0;
  // 2 RMSNorm weights of hidden; 4 in Gemma 2 and 3 (pre/post attention and MLP); Qwen3 and
  // Gemma 3 add q_norm and k_norm of head_dim each (head_norms of them).
  int64_t norms = 0;
  int64_t head_norms = 0;  // how many of the norms are over head_dim (Qwen3, Gemma 3: 2)
  int64_t hidden_norms(int64_t hidden_size, int64_t head_dim) const {
    return hidden_size > 0 ? (norms - head_norms * head_dim) / hidden_size : 0;
  }
  int64_t total() const { return attention + attention_bias + mlp + mlp_bias + norms; }
};

struct ModelShape {
  // The sizes (hidden_size, num_hidden_layers, ...), the family (model_type) and the features
  // (IsGemma: GeGLU and four norms a block; attn_logit_softcapping: the explicit attention
  // path; final_logit_softcapping: one more [targets, vocab] float32 tensor unchunked).
  ModelConfig config;

  BlockParams block;       // every block has the same shape
  int64_t embeddings = 0;  // vocab x hidden
  int64_t lm_head = 0;     // vocab x hidden; 0 when tied to the embeddings
  int64_t final_norm = 0;  // hidden

  int64_t total_params() const {
    return embeddings + lm_head + final_norm + config.num_hidden_layers * block.total();
  }
  // The largest unit a ZeRO-3 run gathers (docs/sharding.md): a block, or the embeddings,
  // or the final norm with the head.
  int64_t largest_unit_params() const;
};

// The counts of `config`'s model (as ParseModelConfig accepted it).
ModelShape ModelShapeOf(const ModelConfig& config);

}  // namespace lathe

#endif  // LATHE_PLANNER_MODEL_SHAPE_H_
