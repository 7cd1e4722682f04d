// The architecture of a Hugging Face Llama-family model, read from its config.json, and
// the weight names and shapes that follow from it. Llama (1-3.x), Mistral and Qwen2 share
// one decoder: embeddings, RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, LM head;
// Qwen3 adds an RMSNorm over each head of q and k; Phi-3 (and Phi-4-mini) fuses q/k/v into
// one qkv_proj and gate/up into one gate_up_proj, may rotate only part of each head and
// scales RoPE by LongRoPE. They differ in biases (Qwen2: q/k/v; Llama and Qwen3:
// `attention_bias`; Llama: `mlp_bias`), sliding windows (Mistral, Phi-3, Qwen2 and Qwen3
// with `use_sliding_window`), RoPE scaling and tied embeddings.
//
// Gemma 2 and Gemma 3 (text) keep that decoder with Gemma's changes (see IsGemma): embeddings
// scaled by sqrt(hidden_size), RMSNorms that multiply by (1 + weight) in float32, four per
// block (input, post_attention on the attention's output, pre_feedforward, post_feedforward),
// a GeGLU MLP (gelu_pytorch_tanh), scores scaled by query_pre_attn_scalar^-0.5, sliding and
// global layers (layer_types). Gemma 2 soft-caps the scores and the logits; Gemma 3 norms q
// and k (as Qwen3) and gives its sliding layers their own RoPE base (rope_local_base_freq).
//
// Thread-safety: plain values and pure functions.
#ifndef LATHE_COMMON_MODEL_CONFIG_H_
#define LATHE_COMMON_MODEL_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lathe {

struct RopeScaling {
  enum class Kind { kNone, kLinear, kLlama3, kLongRope };
  Kind kind = Kind::kNone;
  double factor = 1.0;
  // Llama 3.1 ("rope_type": "llama3") only.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  // Llama 3.1 and LongRoPE. Phi-3 reads it at the top level of config.json (default 4096).
  int64_t original_max_position_embeddings = 8192;
  // LongRoPE (Phi-3, "rope_type": "longrope", or "su"/"yarn" which Phi-3 reads as it):
  // every inverse frequency divided by its factor [RotaryDim / 2], short_factor when a
  // sequence is at most original_max_position_embeddings long, long_factor beyond; cos and
  // sin multiplied by attention_factor (given, or transformers' sqrt(1 + ln(factor) /
  // ln(original_max_position_embeddings)) with factor = max_position_embeddings /
  // original_max_position_embeddings when not given, 1 when factor <= 1).
  std::vector<double> short_factor;
  std::vector<double> long_factor;
  double attention_factor = 1.0;
};

struct ModelConfig {
  // "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"
  std::string model_type;
  std::string architecture;  // architectures[0], e.g. "LlamaForCausalLM"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // defaults to num_attention_heads
  int64_t head_dim = 0;             // defaults to hidden_size / num_attention_heads
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  // Phi-3: RoPE rotates the first RotaryDim(config) features of each head only (Phi-4-mini:
  // 0.75); the rest pass through.
  double partial_rotary_factor = 1.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // Qwen2 always; Llama, Qwen3 and Gemma when attention_bias
  bool o_bias = false;    // Llama, Qwen3 and Gemma when attention_bias
  // Qwen3 and Gemma 3: RMSNorm (weight [head_dim], rms_norm_eps) on every head of q and of k
  // after the projections, before RoPE (self_attn.q_norm, self_attn.k_norm).
  bool qk_norm = false;
  bool mlp_bias = false;  // Llama when mlp_bias
  // Tokens a position may attend back to (itself included); unset means unlimited. On every
  // layer, or on those of sliding_layers when it is not empty.
  std::optional<int64_t> sliding_window;
  // Gemma: per layer, whether it is a sliding layer (layer_types' "sliding_attention"; the
  // others are global). Empty for the other families: every layer slides when sliding_window
  // is set.
  std::vector<bool> sliding_layers;
  // Gemma: the attention scores are scaled by query_pre_attn_scalar^-0.5 (0: head_dim^-0.5).
  int64_t query_pre_attn_scalar = 0;
  // Gemma (2): s -> cap * tanh(s / cap) on the scaled attention scores and on the logits;
  // 0 means none.
  double attn_logit_softcapping = 0.0;
  double final_logit_softcapping = 0.0;
  // Gemma 3: the RoPE base of the sliding layers, which ignore rope_scaling; 0 means every
  // layer uses rope_theta and rope_scaling.
  double rope_local_base_freq = 0.0;
  // The embedding row that the lookup never trains (every family's nn.Embedding padding_idx).
  // Gemma: transformers' default 0 when absent; null: none. The other families: as written,
  // also written back (Phi3Config would otherwise assume 32000, which may lie outside a smaller
  // vocabulary); a value that is not a token id (LLaMA 1's -1) is dropped.
  std::optional<int64_t> pad_token_id;
  std::string torch_dtype;  // as written in the file ("bfloat16", ...); may be empty
  // Special tokens, when config.json names them (null or absent: unknown). A list of
  // bos_token_id keeps its first entry; eos_token_id keeps every entry (Llama 3.1 Instruct
  // lists three), the first being the one Lathe appends to text records.
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;
};

// Parses the text of a config.json: the one reading of it, which the trainer, the
// coordinator's admission and the planner (planner/model_shape.h) share. `source` names the
// file in error messages. UNIMPLEMENTED "<source>: num_local_experts: 8: mixture-of-experts
// ..." for a mixture-of-experts model (by its expert count key, whatever its model_type).
// INVALID_ARGUMENT naming the field for: malformed JSON, a missing or non-positive size,
// an unsupported model_type (supported: llama, mistral, qwen2, qwen3, gemma2, gemma3_text,
// phi3; the multimodal gemma3 is refused), hidden_act other than silu (Gemma:
// hidden_activation other than gelu_pytorch_tanh), num_attention_heads not divisible by
// num_key_value_heads, an unknown rope_scaling type (phi3: other than longrope), a
// bos_token_id or eos_token_id that is not an integer (or list of them) in [0, vocab_size),
// a Gemma setting the engine does not implement (use_bidirectional_attention,
// attention_dropout, RoPE scaling on the sliding layers); for phi3 also a
// partial_rotary_factor that leaves an odd or no rotary dimension, LongRoPE factors of the
// wrong length, and what Lathe does not implement: attention_bias, mlp_bias or lm_head_bias
// true, a non-zero attention_dropout or resid_pdrop.
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text, absl::string_view source);

// True for Gemma 2 and Gemma 3 text (model_type gemma2, gemma3_text): scaled embeddings,
// (1 + weight) RMSNorms, four norms per block, GeGLU.
bool IsGemma(const ModelConfig& config);
// Whether layer `layer` attends within sliding_window (unset window: false).
bool LayerSlides(const ModelConfig& config, int64_t layer);

// Reads `dir`/config.json. NOT_FOUND when missing; otherwise as ParseModelConfig.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir);

// Features of each head that RoPE rotates: int(head_dim * partial_rotary_factor).
int64_t RotaryDim(const ModelConfig& config);

// The linear projections of each decoder block of `config`'s model, in model order: what
// LoRA can target. q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; Phi-3:
// qkv_proj, o_proj, gate_up_proj, down_proj.
const std::vector<std::string>& ProjectionModules(const ModelConfig& config);
// True when some supported architecture has a projection called `module` (what a job spec's
// lora.targets may name before its model is read).
bool IsProjectionModule(absl::string_view module);
// Every name IsProjectionModule accepts.
const std::vector<std::string>& AllProjectionModules();

// The projections a job's lora.targets `targets` names on `config`'s model, in model order:
// every projection of the model when `targets` is empty (the spec's default).
// INVALID_ARGUMENT "lora.targets: ..." naming the model's modules when a target is not one
// of them.
absl::StatusOr<std::vector<std::string>> LoraTargetsOf(const ModelConfig& config,
                                                       const std::vector<std::string>& targets);

// Input and output features of projection `module` ("q_proj", ..., "down_proj"; Phi-3's
// qkv_proj: (heads + 2 * kv_heads) * head_dim out, q rows then k then v; gate_up_proj:
// 2 * intermediate_size out, gate rows then up). REQUIRES: IsProjectionModule(module).
struct ProjectionShape {
  int64_t in_features;
  int64_t out_features;
};
ProjectionShape ProjectionShapeOf(const ModelConfig& config, absl::string_view module);

// Hugging Face parameter name of projection `module` in layer `layer`, without the
// ".weight" suffix: "model.layers.3.self_attn.q_proj" or "model.layers.3.mlp.up_proj".
// REQUIRES: IsProjectionModule(module).
std::string ProjectionName(int64_t layer, absl::string_view module);

// Every weight the model's safetensors must hold, in model order, with its shape.
// lm_head.weight is absent when embeddings are tied.
struct WeightSpec {
  std::string name;
  std::vector<int64_t> shape;
};
std::vector<WeightSpec> ExpectedWeights(const ModelConfig& config);

// Parameter count of the model (tied embeddings counted once).
int64_t ParameterCount(const ModelConfig& config);

// Serialises `config` back to config.json text (used to write generated models).
std::string ModelConfigToJson(const ModelConfig& config);

}  // namespace lathe

#endif  // LATHE_COMMON_MODEL_CONFIG_H_
