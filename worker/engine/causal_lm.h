// A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, Phi-3;
// docs/training.md, "Model") with optional LoRA adapters on its projections, written against
// ATen directly: explicit parameter tensors, no torch::nn modules, so the engine decides where
// every byte lives.
//
// Thread-safety: not thread-safe; one trainer thread owns a model.
#ifndef LATHE_WORKER_ENGINE_CAUSAL_LM_H_
#define LATHE_WORKER_ENGINE_CAUSAL_LM_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "common/lora_targets.h"
#include "common/model_config.h"
#include "common/peft.h"
#include "common/plan.h"
#include "kernels/ops/nf4_linear.h"
#include "kernels/ops/torch_compat.h"

namespace lathe {

// How a model holds its tensors and computes (docs/training.md, "Precision").
struct ModelOptions {
  // Storage type of the frozen base weights: float32, bfloat16 or float16. Trainable
  // tensors (LoRA, or every weight in full fine-tuning) are always float32 masters.
  at::ScalarType weight_dtype = at::kFloat;
  // Type of the activations and of the matrix products. Low-precision weights are converted
  // to it as they are used; RMSNorm statistics, softmax and the loss stay in float32.
  at::ScalarType compute_dtype = at::kFloat;
  at::Device device = at::kCPU;
  // While training, keep only each decoder block's input for backward and recompute the
  // block's forward there (with the same dropout masks) instead of storing its activations.
  bool activation_checkpointing = false;
  // The fused kernels of kernels/ (RMSNorm, RoPE, SwiGLU or GeGLU, LoRA linear); otherwise the
  // plain ATen compositions (kernels/ops/unfused.h).
  bool fused_kernels = true;
  // The loss by the fused linear cross-entropy (chunked, no [targets, vocab] logits);
  // otherwise the logits and at::cross_entropy_loss.
  bool chunked_loss = true;
  // Load leaves every base weight as the model file's tensor: on the CPU, in the file's
  // dtype, read-only (mapped where aligned), never requiring grad, whatever the device and
  // `trainable_base`. For the shard layer (worker/shard), which places each rank's slice.
  bool keep_mapped = false;
};

// The units a model is sharded by (worker/shard): unit 0 is the embeddings, units 1..L the
// decoder blocks, unit L + 1 the final norm and the LM head (whose tied weight is unit 0's).
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  // Called before `unit` computes, with its input (the token ids for unit 0, the hidden
  // states otherwise); returns the tensor the unit computes from. The unit's tensor slots
  // (CausalLm::UnitTensors) must hold its weights when this returns.
  virtual at::Tensor Enter(int64_t unit, const at::Tensor& input) = 0;
  // Called after `unit` computed `output`; returns the tensor passed on. The head unit is
  // left by SumLossOfHidden and Logits, with the loss or the logits.
  virtual at::Tensor Leave(int64_t unit, const at::Tensor& output) = 0;
};

// One tensor slot of a unit.
struct UnitTensor {
  std::string name;  // Hugging Face name, or PEFT name for LoRA tensors
  at::Tensor* slot;
  bool trainable = false;
  bool weight_decay = true;  // AdamW decays it (not biases and norms)
};

// A linear projection y = x W^T + b, plus s * dropout(x) A^T B^T when it carries LoRA.
// Computes in x's type; a weight of another type is converted as it is used.
struct Projection {
  at::Tensor weight;       // [out, in]; undefined when quantized
  kernels::Nf4Weight nf4;  // the frozen weight in NF4 (method qlora), multiplied tile by tile
  at::Tensor bias;         // [out]; undefined when the model has none here
  at::Tensor lora_a;       // [r, in]; undefined without LoRA
  at::Tensor lora_b;       // [out, r]
  double lora_scale = 0.0;

  // `fused`: one kernels::LoraLinear node; otherwise the ATen composition.
  at::Tensor Forward(const at::Tensor& x, double lora_dropout, bool training, bool fused) const;
};

struct DecoderLayer {
  at::Tensor input_norm;           // [hidden]
  at::Tensor post_attention_norm;  // [hidden]
  // Qwen3 and Gemma 3 (ModelConfig::qk_norm): RMSNorm weights over each head of q and of k;
  // undefined otherwise.
  at::Tensor q_norm, k_norm;  // [head_dim]
  // Gemma (IsGemma): the norms around the MLP (post_attention_norm then norms the attention's
  // output); undefined otherwise.
  at::Tensor pre_feedforward_norm, post_feedforward_norm;  // [hidden]
  // The model's ProjectionModules: q/k/v/gate/up_proj, or Phi-3's fused qkv_proj (q, k and v
  // rows) and gate_up_proj (gate rows, then up); the others stay empty.
  Projection q_proj, k_proj, v_proj, qkv_proj, o_proj, gate_proj, up_proj, gate_up_proj, down_proj;

  // The projection called `module` ("q_proj", ...). REQUIRES: IsProjectionModule(module).
  Projection& projection(absl::string_view module);
  const Projection& projection(absl::string_view module) const;
  // The block's tensors that require grad.
  std::vector<at::Tensor> TrainableTensors() const;
};

// A trainable tensor with its Hugging Face (or PEFT) name.
struct NamedParameter {
  std::string name;
  at::Tensor tensor;
  bool weight_decay = true;
};

class CausalLm {
 public:
  // Loads the weights of model directory `dir` onto options.device. With `trainable_base`
  // every weight is an owned float32 copy that requires grad (full fine-tuning); otherwise
  // weights are frozen, of options.weight_dtype and, where the file holds that type on the
  // CPU, views of the mapped files.
  // Errors name the tensor and the file: NOT_FOUND for a missing weights file,
  // INVALID_ARGUMENT for a missing tensor or a shape that disagrees with config.json,
  // and any error of SafetensorsDirectory::Open.
  static absl::StatusOr<std::unique_ptr<CausalLm>> Load(const std::string& dir,
                                                        const ModelConfig& config,
                                                        bool trainable_base,
                                                        const ModelOptions& options = {});

  // Adds fresh LoRA adapters per `spec` on the projections its targets select
  // (MatchLoraTargets over the model's ProjectionModules; none named: every projection):
  // A uniform in +-1/sqrt(in), B zero, from a generator seeded with `seed`, in model order.
  // With spec.modules_to_save, also a trainable float32 copy of each module it names (the
  // base weight's values; the base stays frozen): the copy replaces the module in the
  // forward pass, as PEFT's ModulesToSaveWrapper does. With tied embeddings each copy
  // replaces only its own use (lm_head: the head's product; embed_tokens: the lookup), the
  // other use keeping the frozen tied weight, as PEFT 0.21 does without ensure_weight_tying.
  // REQUIRES: the targets select a projection (MatchLoraTargets succeeds; the trainer checks
  // it where it opens the model).
  void InitLora(const LoraSpec& spec, uint64_t seed);

  // Adds LoRA adapters from PEFT adapter directory `dir`, for `spec`'s targets and rank
  // (scaling from `spec`), and the copies of spec.modules_to_save from its saved modules.
  // INVALID_ARGUMENT naming "lora.init_from", the tensor and the file when the adapter lacks
  // a targeted tensor or a saved module's, or has another rank or shape, or its config's
  // modules_to_save names other modules than the spec's (one the spec would drop, or one the
  // adapter does not have); as MatchLoraTargets when the targets select nothing.
  absl::Status LoadLora(const LoraSpec& spec, const std::string& dir);

  // Replaces every projection's frozen weight with its NF4 form (method qlora; docs/kernels.md
  // "NF4") and releases the dense one; returns the bytes the NF4 forms hold. REQUIRES: the
  // projections are frozen.
  int64_t QuantizeProjections();

  // Final-normalised hidden states [batch, seq, hidden] of token ids [batch, seq]. With unit
  // hooks, the head unit stays entered: SumLossOfHidden leaves it.
  at::Tensor Hidden(const at::Tensor& input_ids) const;
  // Float32 logits [batch, seq, vocab].
  at::Tensor Logits(const at::Tensor& input_ids) const;
  // Sum of the next-token cross-entropy over every target: position t predicts
  // labels[t + 1]; labels of -100 are skipped. input_ids and labels: [batch, seq].
  at::Tensor SumLoss(const at::Tensor& input_ids, const at::Tensor& labels) const;
  // The same from Hidden(input_ids): the LM head and the cross-entropy alone.
  at::Tensor SumLossOfHidden(const at::Tensor& hidden, const at::Tensor& labels) const;

  // Tensors that receive gradients: the LoRA A/B matrices then the saved modules' copies
  // (embed_tokens, lm_head; PEFT's adapter keys), or, with a trainable base, every weight
  // (HF names; biases and norms without weight decay).
  std::vector<NamedParameter> TrainableParameters();

  // Writes the LoRA adapters and the saved modules' copies as a PEFT adapter directory.
  // REQUIRES: LoRA was added.
  absl::Status ExportAdapter(const std::string& dir, const PeftAdapterConfig& config) const;
  // Writes config.json and model.safetensors (float32) to `dir`.
  absl::Status ExportModel(const std::string& dir) const;
  // Folds every LoRA adapter into its frozen weight (W + scale * B A, computed in float32,
  // stored in the weight's type) and drops the adapters; a saved module's copy replaces its
  // base weight (in the weight's type): the model then computes what base and adapter did
  // together. FAILED_PRECONDITION for NF4 weights (method qlora), and for copies of tied
  // embeddings (the merged model would need them untied).
  absl::Status MergeLora();
  // The base weights (LoRA excluded) by Hugging Face name, in ExpectedWeights' order.
  std::vector<std::pair<std::string, at::Tensor>> NamedBaseWeights() const;
  // Writes the config.json of an exported model (float32 weights) to `dir`, as ExportModel
  // does; for exports whose weights are written elsewhere (ZeRO-3, unit by unit).
  absl::Status WriteExportedConfig(const std::string& dir) const;

  // The units (see UnitHooks) and the tensors of each, in a fixed order: frozen base weights
  // and, for LoRA, the unit's adapters (trainable) and saved module copy (unit 0: the
  // embeddings', the head unit: the LM head's); with a trainable base every weight is
  // trainable. The head unit of a model with tied embeddings has only the final norm (and a
  // saved lm_head copy).
  int64_t num_units() const { return config_.num_hidden_layers + 2; }
  std::vector<UnitTensor> UnitTensors(int64_t unit);
  // The NF4 weights of `unit`'s projections (method qlora, after QuantizeProjections), by
  // name, in a fixed order; none for other units or before quantization.
  std::vector<std::pair<std::string, kernels::Nf4Weight*>> UnitNf4Weights(int64_t unit);
  // Calls `hooks` around every unit from now on (nullptr: none). Not owned.
  void set_unit_hooks(UnitHooks* hooks) { hooks_ = hooks; }

  void set_training(bool training) { training_ = training; }
  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  // One decoder block: x + attention, then + MLP. Public for the checkpointing node.
  at::Tensor Block(int64_t layer, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& mask) const;
  int64_t lora_rank() const { return lora_rank_; }
  // The projections that carry LoRA, in model order (empty before InitLora/LoadLora).
  const std::vector<LoraTarget>& lora_targets() const { return lora_targets_; }

 private:
  CausalLm(const ModelConfig& config, const ModelOptions& options);

  // Every base weight with its HF name, in ExpectedWeights order.
  std::vector<std::pair<std::string, at::Tensor*>> BaseWeights();
  // The weights the head's product and the embedding lookup use: a saved module's copy,
  // else the base weight (tied: the embeddings).
  const at::Tensor& lm_head() const;
  const at::Tensor& embedding() const;
  // The hooks' Leave of the head unit, when there are hooks.
  at::Tensor LeaveHead(const at::Tensor& output) const;
  at::Tensor Norm(const at::Tensor& x, const at::Tensor& weight) const;
  // Float32 logits of `hidden` [..., hidden].
  at::Tensor HeadLogits(const at::Tensor& hidden) const;
  // cos/sin tables [seq, RotaryDim] for positions 0..seq-1 of inverse frequencies `inv_freq`
  // (LongRoPE: its long factors' beyond its original length; cos and sin times its attention
  // factor).
  std::pair<at::Tensor, at::Tensor> RopeTables(int64_t seq, const at::Tensor& inv_freq) const;
  // Whether attention over `seq` tokens is libtorch's scaled_dot_product_attention rather than
  // the explicit softmax(q k^T + mask) v, whose products on the CPU are the engine's (oneDNN,
  // bf16 where the CPU multiplies it): common/plan.h's FusedAttention, as the planner models.
  // Gemma 2's soft-capped scores have no fused kernel: always the explicit path.
  bool FusedSdpa(int64_t seq) const {
    return config_.attn_logit_softcapping == 0 &&
           FusedAttention(options_.fused_kernels,
                          options_.device.is_cuda() ? DeviceKind::kCuda : DeviceKind::kCpu, seq);
  }
  at::Tensor Attention(const DecoderLayer& layer, const at::Tensor& x, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& mask) const;

  ModelConfig config_;
  ModelOptions options_;
  at::Tensor embed_tokens_;  // [vocab, hidden]
  std::vector<DecoderLayer> layers_;
  at::Tensor norm_;     // [hidden]
  at::Tensor lm_head_;  // [vocab, hidden]; undefined when tied
  // PEFT's modules_to_save: trainable float32 copies [vocab, hidden]; undefined when unsaved.
  at::Tensor saved_embed_tokens_, saved_lm_head_;
  SavedModules saved_;        // which copies exist (their slots may be released under ZeRO-3)
  at::Tensor inv_freq_;       // [RotaryDim / 2]
  at::Tensor long_inv_freq_;  // LongRoPE's for sequences beyond its original length
  // Gemma 3's sliding layers (rope_local_base_freq); undefined otherwise.
  at::Tensor local_inv_freq_;
  std::vector<LoraTarget> lora_targets_;
  bool trainable_base_ = false;
  int64_t lora_rank_ = 0;
  double lora_dropout_ = 0.0;
  bool training_ = false;
  UnitHooks* hooks_ = nullptr;
};

// RoPE inverse frequencies [RotaryDim / 2] (float32) for `config`, rope_scaling applied, for
// sequences of `seq_len` positions: LongRoPE divides by its long factors beyond
// original_max_position_embeddings, by its short ones otherwise (as transformers picks by the
// largest position id + 1).
at::Tensor RopeInverseFrequencies(const ModelConfig& config, int64_t seq_len = 0);

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_CAUSAL_LM_H_
