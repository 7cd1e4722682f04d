#include "planner/memory_model.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "common/flat_layout.h"
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
int64_t LossPeakBytes(const JobShape& job, const StrategyPoint& p, const Widths& w) {
  const ModelShape& m = job.model;
  const int64_t n = p.micro_batch * (job.seq_len - 1);  // every position a target: the worst
  // MeZO's forward passes make no gradient: the target rows alone.
  const bool grad = !job.zeroth_order;
  const int64_t rows = (grad ? 2 : 1) * n * m.hidden_size * w.compute + n * 4 + 2 * n * 8;
  if (!p.chunked_loss) {
    const int64_t logits = n * m.vocab_size;
    // The log-softmax kept for backward, and at the start of backward the gradients of the
    // loss and of the log-softmax, all [targets, vocab] float32.
    return rows + 3 * logits * 4 + (w.compute == 4 ? 0 : logits * w.compute);
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
// (common/plan.h's FusedAttention), a float32 log-sum-exp per query row. The unfused kernels
// keep more: the norms' intermediates and SiLU(gate).
int64_t BlockSavedBytes(const JobShape& job, const StrategyPoint& p, const Widths& w) {
  const ModelShape& m = job.model;
  const int64_t bt = p.micro_batch * job.seq_len;
  const int64_t h = m.hidden_size, q = m.num_heads * m.head_dim, i = m.intermediate_size;
  const int64_t lora = job.method == Method::kLora
                           ? job.lora_rank * static_cast<int64_t>(job.lora_targets.size())
                           : 0;
  const int64_t rows = p.micro_batch * m.num_heads * job.seq_len;
  const int64_t attention = FusedAttention(p.fused_kernels, job.device, job.seq_len)
                                ? rows * 4
                                : rows * job.seq_len * (4 + (w.compute == 4 ? 0 : w.compute));
  int64_t bytes =
      bt * w.compute * (4 * h + 4 * q + 3 * i) + bt * w.math * lora + 2 * bt * 4 + attention;
  if (!p.fused_kernels) bytes += bt * w.compute * (2 * h + i);
  return bytes;
}

// The backward pass's own buffers within one block (incoming and outgoing gradients, the
// SwiGLU's and the attention's), calibrated against the tracking allocator on the CPU
// (bench/planner_accuracy.py): per token, 1.3 hidden and 2.14 MLP widths fused, 1.6 and
// 1.7 unfused.
int64_t BackwardTransientBytes(const JobShape& job, const StrategyPoint& p, const Widths& w) {
  const int64_t bt = p.micro_batch * job.seq_len;
  const int64_t h = bt * job.model.hidden_size * w.compute;
  const int64_t i = bt * job.model.intermediate_size * w.compute;
  return p.fused_kernels ? (13 * h + 21 * i) / 10 : (16 * h + 17 * i) / 10;
}

// The largest single trainable tensor: the optimizer step's temporaries are of its size.
// (The targets are known to be valid: UnitsOf has checked them.)
int64_t LargestTrainableTensor(const JobShape& job, bool with_embeddings = true) {
  const ModelShape& m = job.model;
  if (job.method == Method::kFull) {
    const int64_t head = with_embeddings || m.lm_head > 0 ? m.vocab_size : 0;
    return std::max({head, m.num_heads * m.head_dim, m.intermediate_size}) * m.hidden_size;
  }
  int64_t largest = 0;
  for (const std::string& t : job.lora_targets) {
    const absl::StatusOr<ProjectionDims> p = ProjectionOf(m, t);
    if (p.ok()) largest = std::max(largest, job.lora_rank * std::max(p->in, p->out));
  }
  return largest;
}

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
  job.lora_rank = spec.lora.rank;
  job.lora_targets = spec.lora.targets;
  job.seq_len = spec.data.seq_len;
  job.global_batch = spec.train.global_batch;
  job.ranks = spec.resources.ranks;
  job.device = spec.resources.device;
  job.precision = spec.train.precision;
  job.optimizer = OptimizerChoiceOf(spec.train);
  job.paged_optimizer = spec.train.paged_optimizer;
  return job;
}

absl::StatusOr<MemoryEstimate> EstimateMemory(const JobShape& job, const StrategyPoint& p) {
  const ModelShape& m = job.model;
  const Widths w = WidthsOf(job);
  absl::StatusOr<std::vector<UnitElements>> units =
      UnitsOf(m, job.method, job.lora_rank, job.lora_targets);
  if (!units.ok()) return units.status();
  const bool cuda = job.device == DeviceKind::kCuda;
  // On the CPU, offloading moves nothing out of the memory the ranks share.
  ShardingChoice choice{job.ranks, p.zero_stage, p.offload_optimizer && cuda,
                        p.offload_params && cuda};
  ModelStateBytes states = ModelStates(*units, w.weight, choice);
  if (job.zeroth_order) states.gradients = states.optimizer = 0;  // MeZO keeps neither
  // QLoRA: the projections' frozen weights in NF4, half a byte per weight, a byte per block
  // of 64, four bytes per 256 blocks (docs/kernels.md "NF4"). ZeRO-3 slices each block's
  // dense frozen weights and, apart, its NF4 bytes.
  const bool qlora = job.method == Method::kQLora;
  const int64_t n = job.ranks, last = static_cast<int64_t>(units->size()) - 1;
  const int64_t per_block = m.block.attention + m.block.mlp;
  // The bytes of unit u's frozen slice at stage 3.
  auto frozen_slice_bytes = [&](int64_t u) {
    const bool nf4 = qlora && u > 0 && u < last;
    return w.weight * ShardNumel((*units)[u].frozen - (nf4 ? per_block : 0), n) +
           (nf4 ? ShardNumel(Nf4Bytes(per_block), n) : 0);
  };
  if (qlora && p.zero_stage < 3) {
    const int64_t projections = m.num_layers * per_block;
    states.weights += Nf4Bytes(projections) - projections * w.weight;
  } else if (qlora) {
    int64_t before = 0, after = 0;
    states.gathered_unit = 0;
    for (int64_t u = 0; u <= last; ++u) {
      before += w.weight * ShardNumel((*units)[u].frozen, n);
      after += frozen_slice_bytes(u);
      states.gathered_unit =
          std::max(states.gathered_unit,
                   n * (frozen_slice_bytes(u) + 4 * ShardNumel((*units)[u].trainable, n)));
    }
    (choice.offload_params ? states.host : states.weights) += after - before;
  }
  if (job.optimizer.kind != OptimizerKind::kAdamW) {
    absl::StatusOr<std::vector<TrainableShape>> shapes =
        TrainableShapes(m, job.method, job.lora_rank, job.lora_targets);
    if (!shapes.ok()) return shapes.status();
    const int64_t state =
        OptimizerStateBytes(*shapes, job.optimizer, p.zero_stage > 0 ? job.ranks : 1);
    if (choice.offload_optimizer) {
      // ModelStates counted AdamW's two moments in host memory: this optimizer's instead.
      int64_t slices = 0;
      for (const UnitElements& u : *units) slices += ShardNumel(u.trainable, job.ranks);
      states.host += state - 8 * slices;
    } else {
      states.optimizer = state;
    }
  }
  // Paged on CUDA, the state lives in host memory; one tensor's is on the device during the
  // step (below). On the CPU host and device memory are one.
  const bool paged = job.paged_optimizer && cuda && p.zero_stage == 0;
  if (paged) {
    states.host += states.optimizer;
    states.optimizer = 0;
  }

  const int64_t b = p.micro_batch, t = job.seq_len, h = m.hidden_size, layers = m.num_layers;
  const int64_t bt = b * t;
  // The embeddings' output, the rotary tables and the token ids; with a micro-batch of more
  // than one sequence, the loss's copy of the shifted hidden states.
  int64_t fixed = bt * h * w.compute + 2 * t * m.head_dim * w.compute + bt * 8;
  if (b > 1) fixed += b * (t - 1) * h * w.compute;
  const int64_t block = BlockSavedBytes(job, p, w);
  const int64_t transient = BackwardTransientBytes(job, p, w);
  const int64_t dy = bt * h * w.compute;  // the gradient flowing into a block
  // Checkpointing keeps each block's input (and the attention mask) instead of its insides.
  // MeZO's forward passes keep nothing past each op; the loss's peak (below) is above any
  // block's transients.
  const int64_t kept = job.zeroth_order ? fixed
                       : p.activation_checkpointing
                           ? fixed + t * t * w.compute + layers * bt * h * w.compute
                           : fixed + layers * block;
  const int64_t loss = LossPeakBytes(job, p, w);

  // Per unit, in the engine's order: the bytes of its whole
  // gradient bucket with the slice it reduces into (ZeRO-2/3), and of the unit gathered
  // whole (ZeRO-3).
  const int64_t num_units = static_cast<int64_t>(units->size());
  std::vector<int64_t> bucket(num_units), whole(num_units);
  int64_t largest_unit_trainable = 0;
  for (int64_t u = 0; u < num_units; ++u) {
    const UnitElements& e = (*units)[u];
    largest_unit_trainable = std::max(largest_unit_trainable, e.trainable);
    bucket[u] = 4 * (n + 1) * ShardNumel(e.trainable, n);
    whole[u] = n * (frozen_slice_bytes(u) + 4 * ShardNumel(e.trainable, n));
  }
  // Stage 0 makes whole gradients as backward goes, stage 1 whole flat ones, stages 2 and 3
  // slices as their reductions finish; all are dropped after the step.
  const int64_t sharded_grads = p.zero_stage == 0 ? 0 : states.gradients;
  const bool stage3 = p.zero_stage == 3;
  int64_t whole_grads = 0, all_slices = 0;
  for (const UnitElements& e : *units) {
    whole_grads += 4 * e.trainable;
    all_slices += 4 * ShardNumel(e.trainable, n);
  }
  // With gradient accumulation, the step's last micro-batch runs with the gradients of the
  // earlier ones alive from its start: whole ones (stages 0 and 1, accumulated in place) or
  // the reduced slices (stages 2 and 3). It is the larger of the micro-batches, so it is the
  // one sized.
  const int64_t accumulation =
      job.global_batch > 0 ? std::max<int64_t>(1, job.global_batch / n / p.micro_batch) : 1;
  const bool accumulating = accumulation > 1;
  const int64_t carried = !accumulating || job.zeroth_order ? 0
                          : p.zero_stage == 0               ? whole_grads
                          : p.zero_stage == 1               ? sharded_grads
                                                            : all_slices;

  struct Moment {
    const char* phase;
    std::array<int64_t, kNumMemoryComponents> c{};
  };
  auto base = [&](const char* phase, bool with_gradients) {
    Moment mo{phase};
    mo.c[static_cast<int>(MemoryComponent::kWeights)] = states.weights;
    mo.c[static_cast<int>(MemoryComponent::kTrainable)] = states.trainable;
    mo.c[static_cast<int>(MemoryComponent::kOptimizer)] = states.optimizer;
    mo.c[static_cast<int>(MemoryComponent::kGradients)] = with_gradients ? sharded_grads : 0;
    mo.c[static_cast<int>(MemoryComponent::kOverhead)] = bt * 16;  // ids and labels
    return mo;
  };
  auto at = [](Moment& mo, MemoryComponent c) -> int64_t& { return mo.c[static_cast<int>(c)]; };
  std::vector<Moment> moments;
  const int64_t head = num_units - 1;
  // The estimate: the moment with the most bytes.
  auto peak_of_moments = [&]() {
    MemoryEstimate estimate;
    const Moment* peak = &moments.front();
    int64_t peak_total = -1;
    for (const Moment& mo : moments) {
      int64_t total = 0;
      for (int64_t v : mo.c) total += v;
      if (total > peak_total) {
        peak_total = total;
        peak = &mo;
      }
    }
    for (int i = 0; i < kNumMemoryComponents; ++i) {
      estimate.device.components[i] = static_cast<uint64_t>(peak->c[i]);
    }
    if (cuda) {
      estimate.device.components[static_cast<int>(MemoryComponent::kOverhead)] += kCudaRuntimeBytes;
    }
    for (uint64_t v : estimate.device.components) estimate.device.total += v;
    estimate.host = static_cast<uint64_t>(states.host);
    estimate.peak_phase = peak->phase;
    return estimate;
  };

  // The end of the forward pass: the last block done (ZeRO-3: still gathered, the head
  // prefetched), then inside the loss (the unfused loss peaks at the start of backward, with
  // everything still kept).
  // Accumulating at stages 2 and 3, the previous micro-batch's last two reductions are still
  // in flight when this one starts (the engine waits for them only when more are pushed, or
  // at the step): the buckets of the units its backward handed over last, oldest first.
  std::vector<int64_t> carried_flight;
  if (accumulating && p.zero_stage >= 2) {
    for (int64_t u = (*units)[0].trainable > 0 ? 0 : 1; u < num_units && carried_flight.size() < 2;
         ++u) {
      carried_flight.insert(carried_flight.begin(), bucket[u]);
    }
  }
  const int64_t carried_bytes =
      std::accumulate(carried_flight.begin(), carried_flight.end(), int64_t{0});
  Moment blocks_done = base("the forward pass", false);
  at(blocks_done, MemoryComponent::kActivations) = kept;
  at(blocks_done, MemoryComponent::kGradients) = carried;
  at(blocks_done, MemoryComponent::kCommBuffers) =
      carried_bytes + (stage3 ? whole[head] + whole[head - 1] : 0);
  moments.push_back(blocks_done);
  Moment in_loss = base("the forward pass", false);
  at(in_loss, MemoryComponent::kActivations) = kept;
  at(in_loss, MemoryComponent::kGradients) = carried;
  at(in_loss, MemoryComponent::kLogits) = loss;
  at(in_loss, MemoryComponent::kCommBuffers) = carried_bytes + (stage3 ? whole[head] : 0);
  moments.push_back(in_loss);
  if (job.zeroth_order) {
    // MeZO: forward passes only (no activations kept past their block), and between them
    // each trainable tensor perturbed by its random direction, made one tensor at a time
    // (the update scales it in place).
    Moment perturb = base("the perturbation", false);
    at(perturb, MemoryComponent::kOptimizer) = 4 * LargestTrainableTensor(job);
    moments.push_back(perturb);
    return peak_of_moments();
  }

  // Backward, unit by unit from the head: while block j runs backward (its insides kept or
  // recomputed, its own transient buffers, the blocks below it still kept; ZeRO-3 holds it
  // and prefetches the one below), and as each unit hands its gradients over (autograd's
  // still alive while they are copied into the unit's bucket). Stage 0 accumulates whole
  // gradients; stages 2 and 3 have up to three buckets in flight to their reduce-scatter
  // (two waiting, one starting).
  const int64_t input = bt * h * w.compute;
  const int64_t mask = t * t * w.compute;
  // Stage 0: the gradients made so far (all of them when accumulating into earlier ones).
  int64_t made = accumulating ? whole_grads : 0;
  std::vector<int64_t> flight = carried_flight;
  auto in_flight = [&flight](size_t count) {
    int64_t sum = 0;
    for (size_t k = 0; k < count && k < flight.size(); ++k) sum += flight[flight.size() - 1 - k];
    return sum;
  };
  // Stages 2 and 3: the gradient slices of the units reduced so far (accumulating: all).
  int64_t slices = accumulating ? all_slices : 0;
  auto hand_over = [&](int64_t unit, int64_t activations, int64_t extra_gradients) {
    const int64_t grads = 4 * (*units)[unit].trainable;
    if (!accumulating) made += grads;
    flight.push_back(bucket[unit]);
    Moment after = base("the backward pass", p.zero_stage == 1);
    at(after, MemoryComponent::kActivations) = activations;
    // Stage 1 copies the unit's gradients into a new whole buffer, added into the step's
    // whole gradient when accumulating.
    at(after, MemoryComponent::kGradients) +=
        extra_gradients + (p.zero_stage == 0   ? made
                           : p.zero_stage == 1 ? (accumulating ? grads : 0)
                                               : slices + grads);
    at(after, MemoryComponent::kCommBuffers) =
        (p.zero_stage >= 2 ? in_flight(3) : 0) + (stage3 ? whole[unit] : 0);
    moments.push_back(after);
    if (!accumulating) slices += 4 * ShardNumel((*units)[unit].trainable, n);
  };
  hand_over(head, kept, dy);
  for (int64_t j = layers - 1; j >= 0; --j) {
    const int64_t unit = j + 1;
    Moment during = base("the backward pass", p.zero_stage == 1);
    at(during, MemoryComponent::kActivations) = p.activation_checkpointing
                                                    ? fixed + mask + (j + 1) * input + block
                                                    : fixed + (j + 1) * block;
    at(during, MemoryComponent::kGradients) += transient + dy +
                                               (p.zero_stage == 0   ? made
                                                : p.zero_stage >= 2 ? slices
                                                                    : 0);
    // The embeddings are gathered for backward only when they train.
    const bool below = unit - 1 >= 1 || (*units)[0].trainable > 0;
    at(during, MemoryComponent::kCommBuffers) =
        (p.zero_stage >= 2 ? in_flight(2) : 0) +
        (stage3 ? whole[unit] + (below ? whole[unit - 1] : 0) : 0);
    moments.push_back(during);
    hand_over(
        unit,
        j == 0 ? 0 : (p.activation_checkpointing ? fixed + mask + j * input : fixed + j * block),
        0);
  }
  if ((*units)[0].trainable > 0) hand_over(0, 0, 0);
  if (p.zero_stage >= 2) {
    // The last reductions drain: every slice made, the last buckets not yet dropped.
    Moment drained = base("the backward pass", false);
    at(drained, MemoryComponent::kGradients) = slices;
    at(drained, MemoryComponent::kCommBuffers) = in_flight(3);
    moments.push_back(drained);
  }

  // Stage 0 on several ranks sums the gradients in one flat copy of them all.
  if (p.zero_stage == 0 && n > 1) {
    Moment all_reduce = base("the gradient all-reduce", false);
    at(all_reduce, MemoryComponent::kGradients) = whole_grads;
    at(all_reduce, MemoryComponent::kCommBuffers) = whole_grads;
    moments.push_back(all_reduce);
  }

  // The optimizer step: every gradient, and two temporaries of the largest tensor (of the
  // largest unit's slice when sharded); offloaded, the step runs in host memory.
  Moment step = base("the optimizer step", true);
  // Sharded, the optimizer steps each tensor's piece of this rank's slice: at most the
  // largest unit's slice.
  const int64_t cap = p.zero_stage == 0 ? std::numeric_limits<int64_t>::max()
                                        : ShardNumel(largest_unit_trainable, job.ranks);
  const int64_t largest = std::min(LargestTrainableTensor(job), cap);
  // 8-bit AdamW takes AdamW's path for the embeddings (float32 moments), its own for the
  // rest.
  const int64_t temporaries =
      job.optimizer.kind == OptimizerKind::kAdamW8bit
          ? std::max(8 * largest,
                     StepTemporaryBytesPerElement(job.optimizer) *
                         std::min(LargestTrainableTensor(job, /*with_embeddings=*/false), cap))
          : StepTemporaryBytesPerElement(job.optimizer) * largest;
  if (p.zero_stage == 0) {
    at(step, MemoryComponent::kGradients) = made;
    at(step, MemoryComponent::kOptimizer) +=
        temporaries + (paged ? OptimizerStateBytes({{{largest}}}, job.optimizer) : 0);
  } else {
    // Stage 1's whole gradients were reduced into slices before the step.
    at(step, MemoryComponent::kGradients) = all_slices;
    if (!choice.offload_optimizer) at(step, MemoryComponent::kOptimizer) += temporaries;
  }
  moments.push_back(step);

  return peak_of_moments();
}

}  // namespace lathe
