#include "planner/memory_model.h"

#include <algorithm>
#include <array>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/flat_layout.h"
#include "common/lora_targets.h"
#include "common/model_config.h"
#include "kernels/cpu/linear_cross_entropy.h"
#include "planner/model_states.h"

namespace lathe {
namespace {

// The CUDA context, cuBLAS workspaces and the caching allocator's slack, which the step's
// own allocations do not show: a fixed allowance per GPU rank.
constexpr uint64_t kCudaRuntimeBytes = uint64_t{1} << 30;

// Bytes of one element of each kind of tensor the step makes.
struct Widths {
  int64_t compute;  // activations: float32, or bfloat16/float16 under those precisions
  int64_t weight;   // frozen weights
  int64_t math;     // LoRA's x A^T: float32 on the CPU whatever the precision
};

Widths WidthsOf(const JobShape& job) {
  const int64_t half = job.precision == Precision::kFp32 ? 4 : 2;
  return {half, job.method == Method::kFull ? 4 : half, job.device == DeviceKind::kCpu ? 4 : half};
}

// The loss's peak at the end of the forward pass: the target rows and their hidden
// gradient (the CPU kernel computes it in forward), the log-sum-exp, the row indices, and
// the kernel's workspace as the kernel sizes it; unfused, the [targets, vocab] logits and
// their log-softmax.
int64_t LossPeakBytes(const JobShape& job, const Strategy& p, const Widths& w) {
  const ModelConfig& m = job.model.config;
  const int64_t n = p.micro_batch * (job.seq_len - 1);  // every position a target: the worst
  // MeZO's forward passes make no gradient: the target rows alone.
  const bool grad = !job.zeroth_order;
  const int64_t rows = (grad ? 2 : 1) * n * m.hidden_size * w.compute + n * 4 + 2 * n * 8;
  if (!p.chunked_loss) {
    const int64_t logits = n * m.vocab_size;
    // The log-softmax kept for backward, and at the start of backward the gradients of the
    // loss and of the log-softmax, all [targets, vocab] float32.
    // Gemma 2's soft-cap keeps its capped logits too.
    return rows + (m.final_logit_softcapping > 0 ? 4 : 3) * logits * 4 +
           (w.compute == 4 ? 0 : logits * w.compute);
  }
  kernels::LinearCrossEntropyProblem problem;
  problem.tokens = n;
  problem.hidden_size = m.hidden_size;
  problem.vocab = m.vocab_size;
  problem.dtype = w.compute == 4 ? kernels::LinearCrossEntropyDtype::kFloat32
                                 : kernels::LinearCrossEntropyDtype::kBFloat16;
  constexpr int64_t kBudget = kernels::kDefaultLinearCrossEntropyBudgetBytes;
  if (job.method == Method::kFull && w.compute == 4 && grad) {
    // A trained float32 head: one pass for both gradients when enough tokens fit.
    const int64_t chunk = kernels::cpu::LinearCrossEntropySinglePassTokenChunk(problem, kBudget);
    if (chunk > 0) {
      return rows + kernels::cpu::LinearCrossEntropySinglePassWorkspaceBytes(problem, chunk) +
             m.vocab_size * m.hidden_size * 4;  // the head's gradient, made in forward
    }
  }
  auto bytes = [&](const kernels::LinearCrossEntropyChunks& c) {
    return kernels::cpu::LinearCrossEntropyForwardWorkspaceBytes(problem, c, grad);
  };
  return rows + bytes(kernels::ChooseLinearCrossEntropyChunks(problem, kBudget, bytes));
}

// What one decoder block keeps for its backward pass: its input's norm, the attention's
// q, k, v (the keys and values repeated to every head under GQA) and output, the residual
// sum, the second norm, gate, up and their product, its output, LoRA's x A^T per target,
// the norms' reciprocal RMS, and the attention's own: the float32 probabilities of the
// explicit softmax (and their 16-bit copy), or, where libtorch's fused attention runs
// (common/plan.h's FusedAttention), a float32 log-sum-exp per query row. Qwen3's q_norm and
// k_norm keep their inputs (q and k as projected) and a float32 reciprocal RMS per head and
// token, fused or not (bench/planner_accuracy.py measured 1.42 and 1.43 MiB over a Llama of
// the same shape). Phi-3's fused qkv_proj and gate_up_proj keep what the separate projections
// do (q, k, v and gate, up are copied out of the fused outputs, v by the engine itself under
// multi-head attention; LoRA keeps x A^T per fused target): its planner_accuracy
// configurations err as the Llama's and Qwen3's of the same shape (+0.2%, +2.9%, +2.7%, and
// +0.2% with multi-head attention, against +0.1%, +2.8%, +2.8%). The unfused kernels keep
// more: the norms' intermediates and SiLU(gate).
// Gemma keeps, besides, the inputs and reciprocal RMS of its two norms on the attention's and
// the MLP's outputs, and with Gemma 2's soft-capped scores, which always take the explicit
// softmax, the capped scores; unfused, GELU(gate) too. Its unfused norms measured no more
// than its fused ones (bench/planner_accuracy.py at --quick's sizes, LoRA with micro-batches
// of 4 without checkpointing: counting a float32 normalised input per unfused norm predicted
// 6.5% and 8.4% over), so none is counted.
int64_t BlockSavedBytes(const JobShape& job, const Strategy& p, const Widths& w) {
  const ModelConfig& m = job.model.config;
  const int64_t bt = p.micro_batch * job.seq_len;
  const int64_t h = m.hidden_size, q = m.num_attention_heads * m.head_dim, i = m.intermediate_size;
  const bool softcapped = m.attn_logit_softcapping > 0, geglu = IsGemma(m);
  const int64_t lora = job.method == Method::kLora
                           ? job.lora_rank * static_cast<int64_t>(job.lora_targets.size())
                           : 0;
  const int64_t rows = p.micro_batch * m.num_attention_heads * job.seq_len;
  const bool fused_attention =
      !softcapped && FusedAttention(p.fused_kernels, job.device, job.seq_len);
  const int64_t attention =
      fused_attention ? rows * 4
                      : rows * job.seq_len *
                            (4 + (w.compute == 4 ? 0 : w.compute) + (softcapped ? w.compute : 0));
  int64_t bytes =
      bt * w.compute * (4 * h + 4 * q + 3 * i) + bt * w.math * lora + 2 * bt * 4 + attention;
  if (geglu) bytes += bt * w.compute * (2 * h + (p.fused_kernels ? 0 : i)) + 2 * bt * 4;
  if (!p.fused_kernels && !geglu) bytes += bt * w.compute * (2 * h + i);
  if (m.qk_norm) {
    const int64_t qk = q + m.num_key_value_heads * m.head_dim;
    bytes += bt * w.compute * qk + bt * 4 * (m.num_attention_heads + m.num_key_value_heads);
  }
  return bytes;
}

// The backward pass's own buffers within one block (incoming and outgoing gradients, the
// SwiGLU's and the attention's), calibrated against the tracking allocator on the CPU
// (bench/planner_accuracy.py): per token, 1.3 hidden and 2.14 MLP widths fused, 1.6 and
// 1.7 unfused.
int64_t BackwardTransientBytes(const JobShape& job, const Strategy& p, const Widths& w) {
  const int64_t bt = p.micro_batch * job.seq_len;
  const int64_t h = bt * job.model.config.hidden_size * w.compute;
  const int64_t i = bt * job.model.config.intermediate_size * w.compute;
  return p.fused_kernels ? (13 * h + 21 * i) / 10 : (16 * h + 17 * i) / 10;
}

// The largest single trainable tensor: the optimizer step's temporaries are of its size.
// (The targets are known to be valid: UnitsOf has checked them.)
int64_t LargestTrainableTensor(const JobShape& job, bool with_embeddings = true) {
  const ModelShape& m = job.model;
  if (job.method == Method::kFull) {
    // The head, or the largest projection (Phi-3's fused qkv_proj or gate_up_proj).
    int64_t largest = with_embeddings || m.lm_head > 0 ? m.embeddings : 0;
    for (const std::string& name : ProjectionNamesOf(m)) {
      const absl::StatusOr<ProjectionShape> p = ProjectionOf(m, name);
      if (p.ok()) largest = std::max(largest, p->in_features * p->out_features);
    }
    return largest;
  }
  int64_t largest = 0;
  if ((with_embeddings && job.saved.embed_tokens) || job.saved.lm_head) {
    largest = m.embeddings;  // a saved module's copy (vocab x hidden)
  }
  for (const std::string& t : job.lora_targets) {
    const absl::StatusOr<ProjectionShape> p = ProjectionOf(m, t);
    if (p.ok()) {
      largest = std::max(largest, job.lora_rank * std::max(p->in_features, p->out_features));
    }
  }
  return largest;
}

// The CUDA runtime's allowance, added to every phase of a GPU rank.
int64_t RuntimeBytes(const JobShape& job) {
  return job.device == DeviceKind::kCuda ? static_cast<int64_t>(kCudaRuntimeBytes) : 0;
}

// The bytes of unit u's frozen slice on one of the job's ranks at ZeRO-3: QLoRA slices each
// block's dense frozen weights and, apart, its NF4 bytes.
int64_t FrozenSliceBytes(const JobShape& job, const std::vector<UnitElements>& units, int64_t u,
                         const Widths& w) {
  const int64_t per_block = job.model.block.attention + job.model.block.mlp;
  const int64_t last = static_cast<int64_t>(units.size()) - 1;
  const bool nf4 = job.method == Method::kQLora && u > 0 && u < last;
  return w.weight * ShardNumel(units[u].frozen - (nf4 ? per_block : 0), job.ranks) +
         (nf4 ? ShardNumel(Nf4Bytes(per_block), job.ranks) : 0);
}

// The model states one rank holds through the step: model_states.h's for AdamW, then this
// job's own. On the CPU, offloading moves nothing out of the memory the ranks share.
struct RankStates {
  ModelStateBytes bytes;
  bool optimizer_in_host = false;  // offload_optimizer on CUDA
  bool paged = false;              // paged on CUDA at stage 0: the state lives in host memory
};

absl::StatusOr<RankStates> RankStatesOf(const JobShape& job, const Strategy& p,
                                        const std::vector<UnitElements>& units, const Widths& w) {
  const bool cuda = job.device == DeviceKind::kCuda;
  // On the CPU host and device memory are one: offloading moves nothing.
  Strategy choice = p;
  choice.offload_optimizer = p.offload_optimizer && cuda;
  choice.offload_params = p.offload_params && cuda;
  RankStates rank;
  rank.optimizer_in_host = choice.offload_optimizer;
  ModelStateBytes& states = rank.bytes;
  states = ModelStates(units, w.weight, job.ranks, choice);
  if (job.zeroth_order) states.gradients = states.optimizer = 0;  // MeZO keeps neither
  // QLoRA: the projections' frozen weights in NF4, half a byte per weight, a byte per block
  // of 64, four bytes per 256 blocks (docs/kernels.md "NF4"); at ZeRO-3 sliced as
  // FrozenSliceBytes says.
  if (job.method == Method::kQLora && p.zero_stage < 3) {
    const int64_t projections =
        job.model.config.num_hidden_layers * (job.model.block.attention + job.model.block.mlp);
    states.weights += Nf4Bytes(projections) - projections * w.weight;
  } else if (job.method == Method::kQLora) {
    int64_t saved = 0;
    for (int64_t u = 0; u < static_cast<int64_t>(units.size()); ++u) {
      saved +=
          FrozenSliceBytes(job, units, u, w) - w.weight * ShardNumel(units[u].frozen, job.ranks);
    }
    (choice.offload_params ? states.host : states.weights) += saved;
  }
  if (job.optimizer.kind != OptimizerKind::kAdamW) {
    absl::StatusOr<std::vector<TrainableShape>> shapes =
        TrainableShapes(job.model, job.method, job.lora_rank, job.lora_targets, job.saved);
    if (!shapes.ok()) return shapes.status();
    const int64_t state =
        OptimizerStateBytes(*shapes, job.optimizer, p.zero_stage > 0 ? job.ranks : 1);
    if (choice.offload_optimizer) {
      // ModelStates counted AdamW's two moments in host memory: this optimizer's instead.
      int64_t slices = 0;
      for (const UnitElements& u : units) slices += ShardNumel(u.trainable, job.ranks);
      states.host += state - 8 * slices;
    } else {
      states.optimizer = state;
    }
  }
  // Paged on CUDA, the state lives in host memory; one tensor's is on the device during the
  // step (OptimizerStepBytes). On the CPU host and device memory are one.
  rank.paged = job.paged_optimizer && cuda && p.zero_stage == 0;
  if (rank.paged) {
    states.host += states.optimizer;
    states.optimizer = 0;
  }
  return rank;
}

// What the optimizer step adds to the optimizer state on the device: two temporaries of the
// largest tensor (sharded, of the largest piece a rank steps: the largest tensor or the
// largest unit's slice, whichever is smaller) and, paged, that tensor's state. Offloaded at
// stages 1-3 the step runs in host memory: nothing.
int64_t OptimizerStepBytes(const JobShape& job, const Strategy& p,
                           const std::vector<UnitElements>& units, const RankStates& states) {
  if (p.zero_stage > 0 && states.optimizer_in_host) return 0;
  int64_t largest_unit = 0;
  for (const UnitElements& e : units) largest_unit = std::max(largest_unit, e.trainable);
  const int64_t cap =
      p.zero_stage == 0 ? std::numeric_limits<int64_t>::max() : ShardNumel(largest_unit, job.ranks);
  const int64_t largest = std::min(LargestTrainableTensor(job), cap);
  // 8-bit AdamW takes AdamW's path for the embeddings (float32 moments), its own for the
  // rest.
  const int64_t temporaries =
      job.optimizer.kind == OptimizerKind::kAdamW8bit
          ? std::max(8 * largest,
                     StepTemporaryBytesPerElement(job.optimizer) *
                         std::min(LargestTrainableTensor(job, /*with_embeddings=*/false), cap))
          : StepTemporaryBytesPerElement(job.optimizer) * largest;
  return temporaries + (states.paged ? OptimizerStateBytes({{{largest}}}, job.optimizer) : 0);
}

// What the activations hold through the step. The forward pass keeps, besides the blocks,
// the embeddings' output, the rotary tables and the token ids, and with a micro-batch of
// more than one sequence the loss's copy of the shifted hidden states; each block keeps
// BlockSavedBytes, or with checkpointing its input (and the attention mask, once) instead.
// MeZO's forward passes keep nothing past each op.
class Activations {
 public:
  Activations(const JobShape& job, const Strategy& p, const Widths& w)
      : checkpointing_(p.activation_checkpointing),
        zeroth_order_(job.zeroth_order),
        layers_(job.model.config.num_hidden_layers),
        input_(p.micro_batch * job.seq_len * job.model.config.hidden_size * w.compute),
        mask_(job.seq_len * job.seq_len * w.compute),
        block_(BlockSavedBytes(job, p, w)) {
    const int64_t b = p.micro_batch, t = job.seq_len;
    fixed_ = input_ + 2 * t * job.model.config.head_dim * w.compute + b * t * 8;
    if (b > 1) fixed_ += b * (t - 1) * job.model.config.hidden_size * w.compute;
  }
  // At the end of the forward pass.
  int64_t Kept() const { return zeroth_order_ ? fixed_ : Below(layers_); }
  // While block j runs backward: it and the blocks below it kept (checkpointing: their
  // inputs, and block j recomputed).
  int64_t During(int64_t j) const { return Below(j + 1) + (checkpointing_ ? block_ : 0); }
  // Once block j has handed its gradients over: the blocks below it (none below the first).
  int64_t After(int64_t j) const { return j == 0 ? 0 : Below(j); }
  // The gradient flowing into a block.
  int64_t Incoming() const { return input_; }

 private:
  // What the first `blocks` blocks keep, with the fixed tensors.
  int64_t Below(int64_t blocks) const {
    return checkpointing_ ? fixed_ + mask_ + blocks * input_ : fixed_ + blocks * block_;
  }
  bool checkpointing_, zeroth_order_;
  int64_t layers_, input_, mask_, block_, fixed_ = 0;
};

// How the step keeps gradients, by ZeRO stage, as backward hands each unit's over: stage 0
// accumulates them whole; stage 1 copies each into a whole flat buffer (its sharded flat
// gradient resident throughout backward), reduced to slices before the step; stages 2 and 3
// copy each into a bucket (the whole unit and the slice it reduces into) with up to three in
// flight to their reduce-scatter (two waiting, one starting), and keep the slices. With
// gradient accumulation the step's last micro-batch, the one sized, starts with the earlier
// ones' gradients alive: whole (stages 0 and 1, accumulated in place) or the reduced slices
// (stages 2 and 3), with the previous micro-batch's last two reductions still in flight.
class GradientFlow {
 public:
  GradientFlow(const JobShape& job, const Strategy& p, const std::vector<UnitElements>& units,
               const ModelStateBytes& states)
      : stage_(p.zero_stage), units_(units.size()) {
    const int64_t n = job.ranks;
    for (size_t u = 0; u < units.size(); ++u) {
      units_[u].gradients = 4 * units[u].trainable;
      units_[u].slice = 4 * ShardNumel(units[u].trainable, n);
      units_[u].bucket = 4 * (n + 1) * ShardNumel(units[u].trainable, n);
      whole_ += units_[u].gradients;
      slices_all_ += units_[u].slice;
    }
    sharded_ = stage_ == 0 ? 0 : states.gradients;
    const int64_t accumulation =
        job.global_batch > 0 ? std::max<int64_t>(1, job.global_batch / n / p.micro_batch) : 1;
    accumulating_ = accumulation > 1;
    if (!accumulating_) return;
    // (MeZO carries no gradients.)
    if (!job.zeroth_order) carried_ = stage_ == 0 ? whole_ : stage_ == 1 ? sharded_ : slices_all_;
    made_ = whole_;
    slices_ = slices_all_;
    if (Buckets()) {
      // The units the previous backward handed over last, oldest first.
      for (size_t u = units[0].trainable > 0 ? 0 : 1; u < units.size() && flight_.size() < 2; ++u) {
        flight_.insert(flight_.begin(), units_[u].bucket);
      }
    }
  }

  // At the start of the micro-batch: the earlier micro-batches' gradients, and their
  // reductions in flight.
  int64_t Carried() const { return carried_; }
  int64_t CarriedInFlight() const { return InFlight(2); }
  // Alive through backward beside the units' own: stage 1's sharded flat gradient.
  int64_t Resident() const { return stage_ == 1 ? sharded_ : 0; }
  // The gradients made so far: whole (stage 0), slices (stages 2-3).
  int64_t Made() const { return stage_ == 0 ? made_ : Buckets() ? slices_ : 0; }
  // The newest `count` buckets in flight (stages 2-3).
  int64_t InFlight(size_t count) const {
    int64_t sum = 0;
    if (!Buckets()) return 0;
    for (size_t k = 0; k < count && k < flight_.size(); ++k) sum += flight_[flight_.size() - 1 - k];
    return sum;
  }
  // Unit u hands its gradients over: the gradients alive as it does, beside Resident().
  // Autograd's are still alive while they are copied into the unit's bucket (stages 2-3)
  // or, accumulating, added into stage 1's whole gradient. Call HandedOver(u) after.
  int64_t HandOver(int64_t u) {
    if (!accumulating_) made_ += units_[u].gradients;
    flight_.push_back(units_[u].bucket);
    const int64_t copy = stage_ == 0   ? 0
                         : stage_ == 1 ? (accumulating_ ? units_[u].gradients : 0)
                                       : units_[u].gradients;
    return Made() + copy;
  }
  void HandedOver(int64_t u) {
    if (!accumulating_) slices_ += units_[u].slice;
  }
  // Every gradient whole (stage 0's all-reduce and step), or every slice (stages 1-3's step).
  int64_t Whole() const { return whole_; }
  int64_t AtStep() const { return stage_ == 0 ? made_ : slices_all_; }

 private:
  struct Unit {
    int64_t gradients = 0, slice = 0, bucket = 0;
  };
  bool Buckets() const { return stage_ >= 2; }
  int64_t stage_;
  std::vector<Unit> units_;
  int64_t whole_ = 0, slices_all_ = 0, sharded_ = 0, carried_ = 0;
  bool accumulating_ = false;
  int64_t made_ = 0, slices_ = 0;
  std::vector<int64_t> flight_;
};

// The step's phases, in order, each at its own peak.
class Timeline {
 public:
  using Bytes = std::array<int64_t, kNumMemoryComponents>;
  // What every phase holds: the model states on the device, the ids and labels, and a GPU's
  // runtime allowance.
  Timeline(const JobShape& job, const Strategy& p, const ModelStateBytes& states) {
    At(base_, MemoryComponent::kWeights) = states.weights;
    At(base_, MemoryComponent::kTrainable) = states.trainable;
    At(base_, MemoryComponent::kOptimizer) = states.optimizer;
    At(base_, MemoryComponent::kOverhead) = p.micro_batch * job.seq_len * 16 + RuntimeBytes(job);
  }
  static int64_t& At(Bytes& bytes, MemoryComponent c) { return bytes[static_cast<int>(c)]; }
  const Bytes& Base() const { return base_; }
  // A moment of `phase`: the phase's first, or its peak if it holds more than the phase's
  // moments so far.
  void Add(absl::string_view phase, const Bytes& bytes) {
    int64_t total = 0;
    for (int64_t v : bytes) total += v;
    auto it = std::find_if(phases_.begin(), phases_.end(),
                           [&](const Phase& known) { return known.name == phase; });
    if (it == phases_.end()) {
      phases_.push_back({std::string(phase), bytes, total});
      it = phases_.end() - 1;
    } else if (total > it->total) {
      it->bytes = bytes;
      it->total = total;
    }
    // The step's peak: its first moment with the most bytes.
    if (total > peak_total_) {
      peak_total_ = total;
      peak_ = it->name;
    }
  }
  // The estimate: the phases in the step's order, the peak the phase of the step's first
  // moment with the most bytes (its peak is that moment).
  MemoryEstimate Estimate(int64_t host) const {
    MemoryEstimate estimate;
    for (absl::string_view name : kPhases) {
      for (const Phase& phase : phases_) {
        if (phase.name != name) continue;
        MemoryPhase out;
        out.name = phase.name;
        for (int i = 0; i < kNumMemoryComponents; ++i) {
          out.bytes.components[i] = static_cast<uint64_t>(phase.bytes[i]);
        }
        out.bytes.total = static_cast<uint64_t>(phase.total);
        if (phase.name == peak_) estimate.device = out.bytes;
        estimate.timeline.push_back(std::move(out));
      }
    }
    estimate.host = static_cast<uint64_t>(host);
    estimate.peak_phase = PhaseMoment(peak_);
    return estimate;
  }

 private:
  struct Phase {
    std::string name;
    Bytes bytes;
    int64_t total;
  };
  // In the step's order.
  static constexpr absl::string_view kPhases[] = {
      kPhaseForward, kPhaseLoss,      kPhaseBackward,  kPhaseHandOver,
      kPhaseReduce,  kPhaseAllReduce, kPhaseOptimizer, kPhasePerturbation};
  Bytes base_{};
  std::vector<Phase> phases_;
  std::string peak_;
  int64_t peak_total_ = -1;
};

}  // namespace

int64_t WeightBytes(const JobShape& job) { return WidthsOf(job).weight; }

int64_t Nf4Bytes(int64_t elements) {
  const int64_t blocks = (elements + 63) / 64;
  return blocks * 32 + blocks + 4 * ((blocks + 255) / 256);
}

JobShape JobShapeOf(const JobSpec& spec, const ModelShape& model) {
  JobShape job;
  job.model = model;
  // MeZO trains LoRA or every weight, without gradients or optimizer state.
  job.method = spec.method == Method::kMezo ? spec.mezo.trainable : spec.method;
  job.zeroth_order = spec.method == Method::kMezo;
  // Per block, as if every block were alike: the modules selected in any layer, at the
  // largest rank any target has (exact without patterns; an upper bound with them).
  // PlanAsGiven has checked that the targets match.
  job.lora_rank = spec.lora.rank;
  job.lora_targets = LoraTargetsOn(model, spec.lora.targets);
  const std::vector<std::string>& modules = ProjectionNamesOf(model);
  if (absl::StatusOr<std::vector<LoraTarget>> targets =
          MatchLoraTargets(spec.lora, model.config.num_hidden_layers, modules);
      targets.ok()) {
    job.lora_targets = ModulesOfTargets(*targets, modules);
    job.lora_rank = 0;
    for (const LoraTarget& target : *targets) job.lora_rank = std::max(job.lora_rank, target.rank);
  }
  if (job.method != Method::kFull) {
    // Validated with the spec (ValidateJobSpec): only the names PEFT's suffix match accepts.
    job.saved = ResolveModulesToSave(spec.lora.modules_to_save).value_or(SavedModules());
  }
  job.seq_len = spec.data.seq_len;
  job.global_batch = spec.train.global_batch;
  job.ranks = spec.resources.ranks;
  job.device = spec.resources.device;
  job.precision = spec.train.precision;
  job.optimizer = OptimizerChoiceOf(spec.train);
  job.paged_optimizer = spec.train.paged_optimizer;
  return job;
}

std::string PhaseMoment(absl::string_view phase) {
  if (phase == kPhaseForward || phase == kPhaseLoss) return "the forward pass";
  if (phase == kPhaseBackward || phase == kPhaseHandOver || phase == kPhaseReduce) {
    return "the backward pass";
  }
  if (phase == kPhaseAllReduce) return "the gradient all-reduce";
  if (phase == kPhaseOptimizer) return "the optimizer step";
  if (phase == kPhasePerturbation) return "the perturbation";
  return std::string(phase);
}

const MemoryPhase* MemoryEstimate::Phase(absl::string_view name) const {
  for (const MemoryPhase& phase : timeline) {
    if (phase.name == name) return &phase;
  }
  return nullptr;
}

absl::StatusOr<MemoryEstimate> EstimateMemory(const JobShape& job, const Strategy& p) {
  const Widths w = WidthsOf(job);
  absl::StatusOr<std::vector<UnitElements>> units =
      UnitsOf(job.model, job.method, job.lora_rank, job.lora_targets, job.saved);
  if (!units.ok()) return units.status();
  absl::StatusOr<RankStates> states = RankStatesOf(job, p, *units, w);
  if (!states.ok()) return states.status();
  const Activations activations(job, p, w);
  GradientFlow gradients(job, p, *units, states->bytes);
  // ZeRO-3 gathers each unit whole for its forward and backward.
  std::vector<int64_t> gathered(units->size());
  for (int64_t u = 0; u < static_cast<int64_t>(units->size()); ++u) {
    gathered[u] = p.zero_stage < 3 ? 0
                                   : job.ranks * (FrozenSliceBytes(job, *units, u, w) +
                                                  4 * ShardNumel((*units)[u].trainable, job.ranks));
  }
  const int64_t head = static_cast<int64_t>(units->size()) - 1;
  Timeline timeline(job, p, states->bytes);
  using C = MemoryComponent;
  auto moment = [&](int64_t activations_bytes, int64_t gradient_bytes, int64_t comm_bytes) {
    Timeline::Bytes bytes = timeline.Base();
    Timeline::At(bytes, C::kActivations) = activations_bytes;
    Timeline::At(bytes, C::kGradients) = gradient_bytes;
    Timeline::At(bytes, C::kCommBuffers) = comm_bytes;
    return bytes;
  };

  // The end of the forward pass: the last block done (ZeRO-3: still gathered, the head
  // prefetched); then inside the loss (the unfused loss peaks at the start of backward, with
  // everything still kept).
  timeline.Add(kPhaseForward,
               moment(activations.Kept(), gradients.Carried(),
                      gradients.CarriedInFlight() + gathered[head] + gathered[head - 1]));
  Timeline::Bytes loss =
      moment(activations.Kept(), gradients.Carried(), gradients.CarriedInFlight() + gathered[head]);
  Timeline::At(loss, C::kLogits) = LossPeakBytes(job, p, w);
  timeline.Add(kPhaseLoss, loss);
  if (job.zeroth_order) {
    // MeZO: forward passes only, and between them each trainable tensor perturbed by its
    // random direction, made one tensor at a time (the update scales it in place).
    Timeline::Bytes perturb = timeline.Base();
    Timeline::At(perturb, C::kOptimizer) = 4 * LargestTrainableTensor(job);
    timeline.Add(kPhasePerturbation, perturb);
    return timeline.Estimate(states->bytes.host);
  }

  // Backward, unit by unit from the head: while block j runs backward (backward: its own
  // transient buffers and the gradient flowing in; ZeRO-3 holds it and prefetches the one
  // below), and as each unit hands its gradients over (hand-over).
  const int64_t transient = BackwardTransientBytes(job, p, w);
  auto hand_over = [&](int64_t unit, int64_t activations_bytes, int64_t incoming) {
    const int64_t alive = gradients.HandOver(unit);
    timeline.Add(kPhaseHandOver, moment(activations_bytes, gradients.Resident() + incoming + alive,
                                        gradients.InFlight(3) + gathered[unit]));
    gradients.HandedOver(unit);
  };
  hand_over(head, activations.Kept(), activations.Incoming());
  for (int64_t j = job.model.config.num_hidden_layers - 1; j >= 0; --j) {
    const int64_t unit = j + 1;
    // The embeddings are gathered for backward only when they train.
    const bool below = unit - 1 >= 1 || (*units)[0].trainable > 0;
    timeline.Add(
        kPhaseBackward,
        moment(activations.During(j),
               gradients.Resident() + transient + activations.Incoming() + gradients.Made(),
               gradients.InFlight(2) + gathered[unit] + (below ? gathered[unit - 1] : 0)));
    hand_over(unit, activations.After(j), 0);
  }
  if ((*units)[0].trainable > 0) hand_over(0, 0, 0);
  // Stages 2 and 3: the last reductions drain, every slice made, the last buckets not yet
  // dropped.
  if (p.zero_stage >= 2) {
    timeline.Add(kPhaseReduce, moment(0, gradients.Made(), gradients.InFlight(3)));
  }
  // Stage 0 on several ranks sums the gradients in one flat copy of them all.
  if (p.zero_stage == 0 && job.ranks > 1) {
    timeline.Add(kPhaseAllReduce, moment(0, gradients.Whole(), gradients.Whole()));
  }
  // The optimizer step: every gradient (stage 1's reduced into slices), and the step's own.
  Timeline::Bytes step = moment(0, gradients.AtStep(), 0);
  Timeline::At(step, C::kOptimizer) += OptimizerStepBytes(job, p, *units, *states);
  timeline.Add(kPhaseOptimizer, step);
  return timeline.Estimate(states->bytes.host);
}

}  // namespace lathe
