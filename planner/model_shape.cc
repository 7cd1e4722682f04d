#include "planner/model_shape.h"

#include <algorithm>

namespace lathe {

int64_t ModelShape::largest_unit_params() const {
  return std::max({block.total(), embeddings, final_norm + lm_head});
}

ModelShape ModelShapeOf(const ModelConfig& config) {
  ModelShape shape;
  shape.config = config;
  const int64_t h = config.hidden_size, i = config.intermediate_size, d = config.head_dim;
  const int64_t q = config.num_attention_heads * d, kv = config.num_key_value_heads * d;
  BlockParams& block = shape.block;
  block.attention = h * q + 2 * h * kv + q * h;  // Phi-3's qkv_proj holds the same
  block.attention_bias = (config.qkv_bias ? q + 2 * kv : 0) + (config.o_bias ? h : 0);
  block.mlp = 3 * h * i;  // gate, up (Phi-3's gate_up_proj) and down
  if (config.mlp_bias) block.mlp_bias = 2 * i + h;
  block.head_norms = config.qk_norm ? 2 : 0;
  block.norms = (IsGemma(config) ? 4 : 2) * h + block.head_norms * d;
  shape.embeddings = config.vocab_size * h;
  shape.lm_head = config.tie_word_embeddings ? 0 : config.vocab_size * h;
  shape.final_norm = h;
  return shape;
}

}  // namespace lathe
