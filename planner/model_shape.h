// The shape of a Hugging Face causal LM as the planner needs it (issue #11): exact parameter
// counts by tensor kind and by block, from config.json alone. Covers the dense decoders of
// the Llama family (Llama, Mistral, Qwen2, Qwen3), Gemma, Gemma 2 and Gemma 3 (text), and Phi-3;
// mixture-of-experts configs are refused. The engine trains a subset of these
// (common/capabilities.h); the planner can size them all, so that it can say what a job would need
// before anything runs.
//
// No libtorch, no I/O: pure functions (planner/ builds with the coordinator).
//
// Thread-safety: plain values and pure functions.
#ifndef LATHE_PLANNER_MODEL_SHAPE_H_
#define LATHE_PLANNER_MODEL_SHAPE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lathe {

enum class ModelFamily { kLlama, kMistral, kQwen2, kQwen3, kGemma, kGemma2, kGemma3Text, kPhi3 };

// "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3" (config.json's
// model_type).
absl::string_view ModelFamilyName(ModelFamily family);

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
  ModelFamily family = ModelFamily::kLlama;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  bool tied_embeddings = false;
  // Gemma 2 and 3: a GeGLU MLP, four norms of hidden a block.
  bool geglu = false;
  // Gemma 2's attn_logit_softcapping (absent: transformers' 50; null: none): the engine's
  // attention is then always the explicit softmax, never libtorch's fused kernel.
  bool softcapped_attention = false;
  // Gemma 2's final_logit_softcapping (absent: 30; null: none): unchunked, the capped logits
  // are one more [targets, vocab] float32 tensor.
  bool softcapped_logits = false;

  BlockParams block;       // every block has the same shape
  int64_t embeddings = 0;  // vocab x hidden
  int64_t lm_head = 0;     // vocab x hidden; 0 when tied to the embeddings
  int64_t final_norm = 0;  // hidden

  int64_t total_params() const {
    return embeddings + lm_head + final_norm + num_layers * block.total();
  }
  // The largest unit a ZeRO-3 run gathers (docs/sharding.md): a block, or the embeddings,
  // or the final norm with the head.
  int64_t largest_unit_params() const;
};

// Reads a config.json's text. `source` names the file in errors, which are one line:
// INVALID_ARGUMENT "<source>: <field>: <problem>" for a missing or bad field, an unknown
// model_type (naming the families above) or sizes that disagree (heads that do not divide
// the hidden size without a head_dim, key/value heads that do not divide the heads);
// UNIMPLEMENTED for mixture-of-experts models ("<source>: num_local_experts: 8: ...").
absl::StatusOr<ModelShape> ParseModelShape(absl::string_view config_json, absl::string_view source);

}  // namespace lathe

#endif  // LATHE_PLANNER_MODEL_SHAPE_H_
