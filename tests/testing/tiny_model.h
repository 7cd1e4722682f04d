// The small Llama-style architecture the unit tests train and load (GQA: 4 query heads,
// 2 key/value heads). Tests change the fields they are about.
#ifndef LATHE_TESTS_TESTING_TINY_MODEL_H_
#define LATHE_TESTS_TESTING_TINY_MODEL_H_

#include <string>

#include "common/model_config.h"

namespace lathe::testing {

inline ModelConfig TinyModelConfig(const std::string& model_type = "llama") {
  ModelConfig c;
  c.model_type = model_type;
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.max_position_embeddings = 64;
  c.qkv_bias = model_type == "qwen2";
  c.qk_norm = model_type == "qwen3" || model_type == "gemma3_text";
  if (IsGemma(c)) {
    // Sliding and global layers, each Gemma's own way; scores scaled by 1/4 (not head_dim's
    // 1/sqrt(8)); Gemma 2's soft-caps small enough to act on a tiny model's scores and logits.
    c.sliding_window = 5;
    c.sliding_layers = {true, false};
    c.query_pre_attn_scalar = 16;
    c.pad_token_id = 0;
    if (model_type == "gemma2") {
      c.attn_logit_softcapping = 2.0;
      c.final_logit_softcapping = 3.0;
    } else {
      c.rope_local_base_freq = 100.0;
    }
  }
  return c;
}

}  // namespace lathe::testing

#endif  // LATHE_TESTS_TESTING_TINY_MODEL_H_
