#include "worker/shard/sharded_model.h"

#include <chrono>
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "worker/engine/memory_tracker.h"
#include "worker/engine/profile_scope.h"

namespace lathe {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int kMaxReducesInFlight = 2;

// Frees a tensor's storage but keeps the tensor (and every view of it, such as those saved
// for backward), so that AllocateStorage can give the same views their data back.
void FreeStorage(const at::Tensor& t) {
  if (!t.defined()) return;
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

void AllocateStorage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (storage->nbytes() == bytes) return;
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

at::Tensor Flat(const at::Tensor& t, const FlatEntry& e) {
  return t.slice(0, e.offset, e.offset + e.numel).view(e.shape);
}

// The parameters of one unit for one forward pass: views of the unit's whole trainable
// buffer. Its backward receives their gradients, which the ShardedModel reduces.
class UnitParams : public torch::autograd::Function<UnitParams> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& /*anchor*/,
                               ShardedModel* owner, int64_t unit, int64_t use) {
    ctx->saved_data["owner"] = reinterpret_cast<int64_t>(owner);
    ctx->saved_data["unit"] = unit;
    ctx->saved_data["use"] = use;
    return owner->TrainableViews(unit);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* owner = reinterpret_cast<ShardedModel*>(ctx->saved_data["owner"].toInt());
    owner->UnitGradients(ctx->saved_data["unit"].toInt(), grads);
    owner->UseDone(ctx->saved_data["use"].toInt());
    return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Identity on a unit's output or input, whose backward tells the ShardedModel where
// backward has come to. On the output (kBefore) it runs just before the unit's backward,
// which needs the unit gathered again; on the input (kAfter) it runs once the unit's input
// gradient is complete, that is after every node of the unit that needs its weights.
class UnitBoundary : public torch::autograd::Function<UnitBoundary> {
 public:
  enum Side : int64_t { kBefore, kAfter };
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, ShardedModel* owner,
                            int64_t use, int64_t side) {
    ctx->saved_data["owner"] = reinterpret_cast<int64_t>(owner);
    ctx->saved_data["use"] = use;
    ctx->saved_data["side"] = side;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* owner = reinterpret_cast<ShardedModel*>(ctx->saved_data["owner"].toInt());
    const int64_t use = ctx->saved_data["use"].toInt();
    if (ctx->saved_data["side"].toInt() == kBefore) {
      owner->BeforeBackward(use);
    } else {
      owner->UseDone(use);
    }
    return {grads[0], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

ShardedModel::ShardedModel(CausalLm* model, Communicator* comm, const ShardOptions& options)
    : model_(model), comm_(comm), options_(options) {}

ShardedModel::~ShardedModel() {
  model_->set_unit_hooks(nullptr);
  // Collectives in flight write into buffers owned here: let them end first.
  for (PendingReduce& r : reduces_) r.work->Wait().IgnoreError();
  for (Unit& u : units_) {
    for (auto& work : u.gathers) work->Wait().IgnoreError();
  }
}

absl::StatusOr<std::unique_ptr<ShardedModel>> ShardedModel::Create(CausalLm* model,
                                                                   Communicator* comm,
                                                                   const ShardOptions& options) {
  if (options.strategy.zero_stage == 0) {
    return absl::InvalidArgumentError("strategy.zero_stage: 0 is not a sharded stage (1-3)");
  }
  StrategyContext context;
  context.ranks = comm->world_size();
  LATHE_RETURN_IF_ERROR(ValidateStrategy(options.strategy, context));
  if (options.strategy.zero_stage == 3 && !model->options().keep_mapped) {
    return absl::FailedPreconditionError(
        "ZeRO-3 needs a model loaded with ModelOptions::keep_mapped");
  }
  std::unique_ptr<ShardedModel> sharded(new ShardedModel(model, comm, options));
  try {
    LATHE_RETURN_IF_ERROR(sharded->Init());
  } catch (const c10::Error& e) {
    return StatusFromTorchError(e, "sharding the model");
  }
  model->set_unit_hooks(sharded.get());
  return sharded;
}

absl::Status ShardedModel::Init() {
  at::NoGradGuard no_grad;
  rank_ = comm_->rank();
  world_ = comm_->world_size();
  tied_ = model_->config().tie_word_embeddings;
  const bool stage3 = options_.strategy.zero_stage == 3;
  const at::ScalarType weight_dtype = model_->options().weight_dtype;
  anchor_ = at::empty({0}, at::kFloat).set_requires_grad(true);
  units_.resize(model_->num_units());
  current_use_.assign(units_.size(), -1);
  awaits_backward_.assign(units_.size(), false);
  for (int64_t index = 0; index < num_units(); ++index) {
    Unit& u = units_[index];
    for (const UnitTensor& t : model_->UnitTensors(index)) {
      if (!t.slot->defined()) continue;  // e.g. no bias here
      std::vector<int64_t> shape(t.slot->sizes().begin(), t.slot->sizes().end());
      if (t.trainable) {
        u.trainable.Add(t.name, std::move(shape), t.weight_decay);
        u.trainable_slots.push_back(t.slot);
      } else {
        u.frozen.Add(t.name, std::move(shape), false);
        u.frozen_slots.push_back(t.slot);
      }
    }
    u.frozen_shard = ShardNumel(u.frozen.numel, world_);
    u.trainable_shard = ShardNumel(u.trainable.numel, world_);
    if (index == 0 && tied_) {
      for (const FlatEntry& e : u.trainable.entries) {
        head_trains_embeddings_ |= e.name == "model.embed_tokens.weight";
      }
    }
    if (stage3) {
      // Copy only this rank's part of each tensor into its slices; the rest of the mapped
      // file is never touched. The model's slots are cleared (unmapping the file).
      auto slice_of = [&](const FlatLayout& layout, const std::vector<at::Tensor*>& slots,
                          int64_t shard, at::ScalarType dtype, MemoryComponent component) {
        at::Tensor slice;
        {
          MemoryScope scope(component);
          slice = options_.strategy.offload_params
                      ? at::zeros({shard}, HostOptions(dtype))
                      : at::zeros({shard}, at::TensorOptions(dtype).device(device()));
        }
        const FlatRange owned = OwnedRange(layout.numel, rank_, world_);
        const int64_t base = rank_ * shard;
        for (size_t i = 0; i < layout.entries.size(); ++i) {
          const FlatEntry& e = layout.entries[i];
          const FlatRange part = Intersect(e.range(), owned);
          if (part.size() > 0) {
            slice.slice(0, part.begin - base, part.end - base)
                .copy_(slots[i]->detach().reshape({-1}).slice(0, part.begin - e.offset,
                                                              part.end - e.offset));
          }
          *slots[i] = at::Tensor();
        }
        return slice;
      };
      u.frozen_slice = slice_of(u.frozen, u.frozen_slots, u.frozen_shard, weight_dtype,
                                MemoryComponent::kWeights);
      u.trainable_slice = slice_of(u.trainable, u.trainable_slots, u.trainable_shard, at::kFloat,
                                   MemoryComponent::kTrainable);
      // QLoRA's NF4 weights as bytes, each tensor padded to 4 bytes (absmax2 is read back as
      // float32 from its place in the gathered buffer).
      std::vector<at::Tensor> nf4_bytes;
      for (auto& [name, weight] : model_->UnitNf4Weights(index)) {
        u.nf4_slots.push_back(weight);
        u.nf4_sizes.push_back(
            {weight->codes.numel(), weight->absmax_codes.numel(), weight->absmax2.numel()});
        for (auto [part, t] : {std::pair{".codes", &weight->codes},
                               std::pair{".absmax_codes", &weight->absmax_codes},
                               std::pair{".absmax2", &weight->absmax2}}) {
          const int64_t bytes = static_cast<int64_t>(t->nbytes());
          at::Tensor padded = at::zeros({(bytes + 3) / 4 * 4}, at::kByte);
          padded.narrow(0, 0, bytes).copy_(t->contiguous().view(at::kByte).reshape({-1}).cpu());
          u.nf4.Add(name + part, {padded.numel()}, false);
          nf4_bytes.push_back(std::move(padded));
          *t = at::Tensor();
        }
      }
      if (!u.nf4_slots.empty()) {
        std::vector<at::Tensor*> slots;
        for (at::Tensor& t : nf4_bytes) slots.push_back(&t);
        u.nf4_shard = ShardNumel(u.nf4.numel, world_);
        u.nf4_slice = slice_of(u.nf4, slots, u.nf4_shard, at::kByte, MemoryComponent::kWeights);
      }
      MemoryScope scope(MemoryComponent::kCommBuffers);
      u.frozen_whole =
          at::empty({world_ * u.frozen_shard}, at::TensorOptions(weight_dtype).device(device()));
      u.trainable_whole =
          at::empty({world_ * u.trainable_shard}, at::TensorOptions(at::kFloat).device(device()));
      if (!u.nf4_slots.empty()) {
        u.nf4_whole =
            at::empty({world_ * u.nf4_shard}, at::TensorOptions(at::kByte).device(device()));
        BindNf4(u);
      }
      FreeUnit(u);
      u.param_slice = u.trainable_slice;
    } else {
      {
        MemoryScope scope(MemoryComponent::kTrainable);
        u.trainable_whole =
            at::zeros({world_ * u.trainable_shard}, at::TensorOptions(at::kFloat).device(device()));
      }
      for (size_t i = 0; i < u.trainable.entries.size(); ++i) {
        const FlatEntry& e = u.trainable.entries[i];
        u.trainable_whole.slice(0, e.offset, e.offset + e.numel)
            .copy_(u.trainable_slots[i]->detach().reshape({-1}));
        *u.trainable_slots[i] = Flat(u.trainable_whole, e);
      }
      u.param_slice =
          u.trainable_whole.slice(0, rank_ * u.trainable_shard, (rank_ + 1) * u.trainable_shard);
    }
    // The optimizer's slice: the parameter slice itself, or a host copy of it when the
    // optimizer is offloaded (with offload_params the slice is in host memory already).
    MemoryScope scope(MemoryComponent::kOptimizer);
    u.master =
        options_.strategy.offload_optimizer
            ? at::empty({u.param_slice.numel()}, HostOptions(at::kFloat)).copy_(u.param_slice)
            : u.param_slice;
    const FlatRange owned_t = OwnedRange(u.trainable.numel, rank_, world_);
    const int64_t base_t = rank_ * u.trainable_shard;
    std::vector<NamedParameter> params;
    OptimizerSharding sharding;
    for (const FlatEntry& e : u.trainable.entries) {
      FlatRange part = Intersect(e.range(), owned_t);
      if (part.size() == 0) part = {owned_t.begin, owned_t.begin};
      u.pieces.push_back({part.begin - base_t, part.end - base_t});
      params.push_back(
          {e.name, u.master.slice(0, u.pieces.back().begin, u.pieces.back().end), e.weight_decay});
      sharding.pieces.push_back({e.shape, part.size() == 0 ? 0 : part.begin - e.offset});
    }
    sharding.sum_over_ranks = [this](at::Tensor& t) { SumOverRanks(t); };
    u.optimizer = MakeOptimizer(std::move(params), options_.train, &sharding);
  }
  return absl::OkStatus();
}

void ShardedModel::SumOverRanks(at::Tensor& t) {
  ProfileScope profile_scope("comm/all_reduce/optimizer_stats");
  // The communicator's buffers live on the model's device (NCCL reads device memory).
  at::Tensor buffer = t.device() == device() ? t : t.to(device());
  Check(Annotate(Timed([&] {
                   return comm_->AllReduceSum(
                       buffer.data_ptr(), static_cast<size_t>(buffer.numel()), CommDType::kFloat32);
                 }),
                 "summing optimizer statistics across ranks"));
  if (!buffer.is_same(t)) t.copy_(buffer);
}

absl::Status ShardedModel::Timed(const std::function<absl::Status()>& wait) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status status = wait();
  comm_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return status;
}

double ShardedModel::TakeCommSeconds() {
  const double seconds = comm_seconds_;
  comm_seconds_ = 0.0;
  return seconds;
}

void ShardedModel::Fail(const absl::Status& status) {
  if (error_.ok()) error_ = status;
  TORCH_CHECK(false, std::string(status.message()));
}

std::vector<at::Tensor> ShardedModel::TrainableViews(int64_t unit) const {
  const Unit& u = units_[unit];
  std::vector<at::Tensor> views;
  for (const FlatEntry& e : u.trainable.entries) views.push_back(Flat(u.trainable_whole, e));
  return views;
}

void ShardedModel::StartGather(int64_t unit) {
  Unit& u = units_[unit];
  if (u.gathered || !u.gathers.empty()) return;
  ProfileScope profile_scope("comm/all_gather/unit", unit);  // starting it
  MemoryScope scope(MemoryComponent::kCommBuffers);
  for (auto [slice, whole] :
       {std::pair{&u.frozen_slice, &u.frozen_whole},
        std::pair{&u.trainable_slice, &u.trainable_whole}, std::pair{&u.nf4_slice, &u.nf4_whole}}) {
    if (!whole->defined() || whole->numel() == 0) continue;
    AllocateStorage(*whole);
    // Offloaded slices travel to the device first (from pinned memory, on the compute stream,
    // which the collective waits for): the same path on a CPU job, a copy.
    at::Tensor in = options_.strategy.offload_params
                        ? slice->to(device(), /*non_blocking=*/true, /*copy=*/true)
                        : *slice;
    u.gathers.push_back(comm_->StartAllGather(in.data_ptr(), whole->data_ptr(),
                                              static_cast<size_t>(in.numel()) * in.element_size()));
    u.gather_inputs.push_back(std::move(in));
  }
  u.gathered = true;
}

void ShardedModel::Acquire(int64_t unit) {
  Unit& u = units_[unit];
  if (u.refs++ > 0 || options_.strategy.zero_stage != 3) return;
  StartGather(unit);
  ProfileScope profile_scope("comm/all_gather/unit", unit);  // waiting for it
  for (auto& work : u.gathers) {
    absl::Status status = Timed([&] { return work->Wait(); });
    if (!status.ok()) Fail(Annotate(status, absl::StrCat("gathering unit ", unit)));
  }
  u.gathers.clear();
  u.gather_inputs.clear();
}

void ShardedModel::Release(int64_t unit) {
  Unit& u = units_[unit];
  if (--u.refs > 0 || options_.strategy.zero_stage != 3) return;
  // A gather still in flight writes into the storage: it was prefetched for a coming use
  // (the tied embeddings are released by the head while unit 0's backward gather may have
  // started), so keep the unit.
  if (!u.gathers.empty()) return;
  FreeUnit(u);
}

void ShardedModel::FreeUnit(Unit& u) {
  FreeStorage(u.frozen_whole);
  FreeStorage(u.trainable_whole);
  FreeStorage(u.nf4_whole);
  u.gathered = false;
}

void ShardedModel::BindNf4(Unit& u) {
  for (size_t i = 0; i < u.nf4_slots.size(); ++i) {
    kernels::Nf4Weight& w = *u.nf4_slots[i];
    const FlatEntry* e = &u.nf4.entries[3 * i];
    w.codes = u.nf4_whole.slice(0, e[0].offset, e[0].offset + u.nf4_sizes[i][0]);
    w.absmax_codes = u.nf4_whole.slice(0, e[1].offset, e[1].offset + u.nf4_sizes[i][1]);
    w.absmax2 =
        u.nf4_whole.slice(0, e[2].offset, e[2].offset + 4 * u.nf4_sizes[i][2]).view(at::kFloat);
  }
}

void ShardedModel::Bind(int64_t unit, int64_t use, bool trainables) {
  Unit& u = units_[unit];
  if (options_.strategy.zero_stage ==
      3) {  // below, the frozen weights stay where the model loaded them
    for (size_t i = 0; i < u.frozen.entries.size(); ++i) {
      *u.frozen_slots[i] = Flat(u.frozen_whole, u.frozen.entries[i]);
    }
  }
  if (u.trainable.entries.empty() || !trainables) return;
  std::vector<at::Tensor> views;
  if (use >= 0) {
    views = UnitParams::apply(anchor_, this, unit, use);
    ++uses_[use].pending;
  } else {
    views = TrainableViews(unit);
  }
  for (size_t i = 0; i < views.size(); ++i) *u.trainable_slots[i] = views[i];
}

at::Tensor ShardedModel::Enter(int64_t unit, const at::Tensor& input) {
  const bool grad = at::GradMode::is_enabled();
  const int64_t id = next_use_++;
  Use& use = uses_[id];
  use.units = {unit};
  if (unit == num_units() - 1 && tied_) use.units.push_back(0);
  for (int64_t v : use.units) Acquire(v);
  if (options_.strategy.zero_stage == 3 && options_.prefetch && unit + 1 < num_units())
    StartGather(unit + 1);
  for (int64_t v : use.units) Bind(v, grad ? id : -1, v == unit || head_trains_embeddings_);
  current_use_[unit] = id;
  if (grad && input.requires_grad()) {
    ++uses_[id].pending;
    return UnitBoundary::apply(input, this, id, UnitBoundary::kAfter);
  }
  return input;
}

at::Tensor ShardedModel::Leave(int64_t unit, const at::Tensor& output) {
  const int64_t id = current_use_[unit];
  current_use_[unit] = -1;
  const Use& use = uses_.at(id);
  const bool backward = at::GradMode::is_enabled() && output.requires_grad() && use.pending > 0;
  if (!backward) {
    ReleaseUse(id);
    return output;
  }
  if (unit == num_units() - 1) return output;  // backward follows at once: stay gathered
  for (int64_t v : use.units) Release(v);
  awaits_backward_[unit] = true;
  return UnitBoundary::apply(output, this, id, UnitBoundary::kBefore);
}

void ShardedModel::BeforeBackward(int64_t id) {
  const Use& use = uses_.at(id);
  for (int64_t v : use.units) Acquire(v);
  const int64_t unit = use.units.front();
  awaits_backward_[unit] = false;
  if (options_.strategy.zero_stage == 3 && options_.prefetch && unit > 0 &&
      awaits_backward_[unit - 1]) {
    StartGather(unit - 1);
  }
}

void ShardedModel::UseDone(int64_t id) {
  if (--uses_.at(id).pending == 0) ReleaseUse(id);
}

void ShardedModel::ReleaseUse(int64_t id) {
  auto it = uses_.find(id);
  for (int64_t v : it->second.units) Release(v);
  uses_.erase(it);
}

void ShardedModel::UnitGradients(int64_t unit, const std::vector<at::Tensor>& grads) {
  at::NoGradGuard no_grad;
  Unit& u = units_[unit];
  at::Tensor whole;
  {
    // Stage 1 keeps it (the step's whole gradient); above, a bucket on its way to be reduced.
    MemoryScope scope(options_.strategy.zero_stage == 1 ? MemoryComponent::kGradients
                                                        : MemoryComponent::kCommBuffers);
    whole = at::zeros({world_ * u.trainable_shard}, at::TensorOptions(at::kFloat).device(device()));
  }
  for (size_t i = 0; i < u.trainable.entries.size() && i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    const FlatEntry& e = u.trainable.entries[i];
    whole.slice(0, e.offset, e.offset + e.numel).copy_(grads[i].reshape({-1}));
  }
  if (options_.strategy.zero_stage == 1) {
    if (u.grad_whole.defined()) {
      u.grad_whole.add_(whole);
    } else {
      u.grad_whole = whole;
    }
    return;
  }
  ProfileScope profile_scope("comm/reduce_scatter/unit", unit);  // starting it
  PendingReduce reduce{unit, whole, at::Tensor(), nullptr};
  {
    MemoryScope scope(MemoryComponent::kCommBuffers);
    reduce.slice = at::empty({u.trainable_shard}, whole.options());
  }
  reduce.work =
      comm_->StartReduceScatterSum(whole.data_ptr(), reduce.slice.data_ptr(),
                                   static_cast<size_t>(u.trainable_shard), CommDType::kFloat32);
  reduces_.push_back(std::move(reduce));
  while (reduces_.size() > kMaxReducesInFlight) DrainOneReduce();
}

void ShardedModel::DrainOneReduce() {
  PendingReduce reduce = std::move(reduces_.front());
  reduces_.pop_front();
  ProfileScope profile_scope("comm/reduce_scatter/unit", reduce.unit);  // waiting for it
  Check(Annotate(Timed([&] { return reduce.work->Wait(); }),
                 absl::StrCat("reducing the gradients of unit ", reduce.unit)));
  Unit& u = units_[reduce.unit];
  if (u.grad_slice.defined()) {
    u.grad_slice.add_(reduce.slice);
  } else {
    MemoryScope scope(MemoryComponent::kGradients);
    u.grad_slice = reduce.slice.clone();
  }
}

absl::Status ShardedModel::FinishBackward() {
  try {
    at::NoGradGuard no_grad;
    while (!reduces_.empty()) DrainOneReduce();
    for (int64_t index = 0; index < num_units(); ++index) {
      Unit& u = units_[index];
      if (!u.grad_whole.defined()) continue;
      ProfileScope profile_scope("comm/reduce_scatter/unit", index);  // stage 1: the step's one
      MemoryScope scope(MemoryComponent::kGradients);
      u.grad_slice = at::empty({u.trainable_shard}, u.grad_whole.options());
      LATHE_RETURN_IF_ERROR(Annotate(Timed([&] {
                                       return comm_->ReduceScatterSum(
                                           u.grad_whole.data_ptr(), u.grad_slice.data_ptr(),
                                           static_cast<size_t>(u.trainable_shard),
                                           CommDType::kFloat32);
                                     }),
                                     absl::StrCat("reducing the gradients of unit ", index)));
      u.grad_whole = at::Tensor();
    }
    // Uses whose backward never came (no gradient reached them) end with the step.
    while (!uses_.empty()) ReleaseUse(uses_.begin()->first);
    for (int64_t index = 0; index < num_units(); ++index) {
      Unit& u = units_[index];
      // Prefetches left over.
      std::optional<ProfileScope> profile_scope;
      if (!u.gathers.empty()) profile_scope.emplace("comm/all_gather/unit", index);
      for (auto& work : u.gathers) {
        LATHE_RETURN_IF_ERROR(
            Annotate(Timed([&] { return work->Wait(); }), absl::StrCat("gathering unit ", index)));
      }
      u.gathers.clear();
      u.gather_inputs.clear();
      if (options_.strategy.zero_stage == 3 && u.refs == 0 && u.gathered) FreeUnit(u);
      awaits_backward_[index] = false;
    }
  } catch (const c10::Error& e) {
    return error_.ok() ? StatusFromTorchError(e, "finishing backward") : error_;
  }
  return absl::OkStatus();
}

absl::StatusOr<double> ShardedModel::GradNorm() {
  at::NoGradGuard no_grad;
  // As AdamW::GradNorm over the parts of tensors this rank owns (on one rank, the very same
  // float32 arithmetic), then summed over ranks in float64.
  std::vector<at::Tensor> norms;
  for (const Unit& u : units_) {
    if (!u.grad_slice.defined()) continue;
    const FlatRange owned = OwnedRange(u.trainable.numel, rank_, world_);
    for (const FlatEntry& e : u.trainable.entries) {
      const FlatRange part = Intersect(e.range(), owned);
      if (part.size() == 0) continue;
      norms.push_back(
          u.grad_slice.slice(0, part.begin - owned.begin, part.end - owned.begin).norm(2));
    }
  }
  // The sum of squares stays where the gradients are (NCCL reduces device memory) until
  // the reduced value is read.
  const at::Tensor local = norms.empty()
                               ? at::zeros({1}, at::TensorOptions(at::kDouble).device(device()))
                               : at::stack(norms).norm(2).to(at::kDouble).reshape({1});
  const at::Tensor sum_squares = local * local;
  ProfileScope profile_scope("comm/all_reduce/grad_norm");
  LATHE_RETURN_IF_ERROR(Annotate(
      Timed([&] { return comm_->AllReduceSum(sum_squares.data_ptr(), 1, CommDType::kFloat64); }),
      "summing the gradient norm across ranks"));
  return std::sqrt(sum_squares.item<double>());
}

void ShardedModel::ScaleGrads(double factor) {
  at::NoGradGuard no_grad;
  for (Unit& u : units_) {
    if (u.grad_slice.defined()) u.grad_slice.mul_(factor);
  }
}

void ShardedModel::ZeroGrad() {
  for (Unit& u : units_) {
    u.grad_slice = at::Tensor();
    u.grad_whole = at::Tensor();
  }
}

absl::Status ShardedModel::Step(double lr) {
  at::NoGradGuard no_grad;
  ++optimizer_steps_;
  try {
    // Offloaded: every unit's gradient slice to the host (pinned) at once, then one wait.
    std::vector<at::Tensor> host_grads(units_.size());
    for (int64_t index = 0; index < num_units(); ++index) {
      Unit& u = units_[index];
      if (u.pieces.empty() || !u.grad_slice.defined() || u.master.device() == device()) continue;
      MemoryScope scope(MemoryComponent::kOptimizer);
      host_grads[index] = at::empty({u.grad_slice.numel()}, HostOptions(at::kFloat))
                              .copy_(u.grad_slice, /*non_blocking=*/true);
    }
    SynchronizeStream(device());
    for (int64_t index = 0; index < num_units(); ++index) {
      Unit& u = units_[index];
      if (u.pieces.empty()) continue;
      // Every unit's optimizer steps, so that the step counts agree (a unit without a
      // gradient, which never happens in a whole model, would skip its tensors).
      const bool offloaded = !u.master.is_same(u.param_slice);
      std::vector<at::Tensor> grads(u.pieces.size());
      if (u.grad_slice.defined()) {
        const at::Tensor grad = host_grads[index].defined() ? host_grads[index]
                                : offloaded ? u.grad_slice.to(u.master.device(), false, true)
                                            : u.grad_slice;
        for (size_t i = 0; i < u.pieces.size(); ++i) {
          grads[i] = grad.slice(0, u.pieces[i].begin, u.pieces[i].end);
        }
      }
      u.optimizer->Step(lr, grads);
      if (!u.grad_slice.defined()) continue;
      // From pinned memory, asynchronous on the device: the next step's first wait on the
      // stream comes before the host writes the master again.
      if (offloaded) u.param_slice.copy_(u.master, /*non_blocking=*/true);
      if (options_.strategy.zero_stage < 3) {
        // Every rank's updated slice into every rank's whole parameters (in place).
        ProfileScope profile_scope("comm/all_gather/params", index);
        const size_t bytes = static_cast<size_t>(u.trainable_shard) * sizeof(float);
        LATHE_RETURN_IF_ERROR(
            Annotate(Timed([&] {
                       return comm_->AllGather(u.param_slice.data_ptr(),
                                               u.trainable_whole.data_ptr(), bytes);
                     }),
                     absl::StrCat("gathering the updated parameters of unit ", index)));
      }
    }
  } catch (const c10::Error& e) {
    return error_.ok() ? StatusFromTorchError(e, "the optimizer step") : error_;
  }
  ZeroGrad();
  return absl::OkStatus();
}

void ShardedModel::AddShardTo(TensorsToWrite* out) const {
  for (int64_t index = 0; index < num_units(); ++index) {
    const Unit& u = units_[index];
    const int64_t owned = OwnedRange(u.trainable.numel, rank_, world_).size();
    if (owned > 0) out->Add(absl::StrCat("unit.", index, ".param"), u.master.slice(0, 0, owned));
    for (size_t i = 0; i < u.pieces.size(); ++i) {
      const std::vector<Optimizer::StateInfo>& info = u.optimizer->state_info(i);
      for (size_t k = 0; k < info.size(); ++k) {
        const at::Tensor& t = u.optimizer->state_tensor(i, k);
        // Whole-tensor statistics are the same on every rank: rank 0 writes them.
        if (info[k].layout == StateLayout::kWholeTensor ? rank_ != 0 : t.numel() == 0) continue;
        out->Add(absl::StrCat(info[k].kind, ".", u.trainable.entries[i].name, info[k].suffix), t);
      }
    }
  }
}

namespace {

// Reads logical ranges of a unit's flat trainable buffer from a checkpoint of any layout.
class FlatReader {
 public:
  FlatReader(const LoadedCheckpoint& checkpoint) : checkpoint_(checkpoint) {}

  // Copies elements [range) of the parameters of unit `unit` (laid out as `layout`) into
  // out[0, range.size()).
  absl::Status ReadParams(int64_t unit, const FlatLayout& layout, const FlatRange& range,
                          at::Tensor out) const {
    const std::string kind = "param";
    const int64_t world = checkpoint_.state.shard_world;
    if (world == 0) {  // named tensors of a stage-0 run
      for (const FlatEntry& e : layout.entries) {
        const FlatRange part = Intersect(e.range(), range);
        if (part.size() == 0) continue;
        LATHE_ASSIGN_OR_RETURN(at::Tensor t, Tensor(checkpoint_.trainable, e.name, e.numel));
        out.slice(0, part.begin - range.begin, part.end - range.begin)
            .copy_(t.slice(0, part.begin - e.offset, part.end - e.offset));
      }
      return absl::OkStatus();
    }
    for (int64_t r = 0; r < world; ++r) {
      const FlatRange theirs = OwnedRange(layout.numel, r, world);
      const FlatRange part = Intersect(theirs, range);
      if (part.size() == 0) continue;
      LATHE_ASSIGN_OR_RETURN(const std::shared_ptr<const SafetensorsFile>* file, ShardFile(r));
      LATHE_ASSIGN_OR_RETURN(at::Tensor t,
                             Tensor(*file, absl::StrCat("unit.", unit, ".", kind), theirs.size()));
      out.slice(0, part.begin - range.begin, part.end - range.begin)
          .copy_(t.slice(0, part.begin - theirs.begin, part.end - theirs.begin));
    }
    return absl::OkStatus();
  }

  // Copies elements [range) (unit coordinates, inside entry `e`) of the element-wise state
  // tensor `name` (a stage-0 run's, or the pieces each rank of a sharded run wrote) into
  // out[0, range.size()).
  absl::Status ReadPiece(const FlatLayout& layout, const FlatEntry& e, const std::string& name,
                         const FlatRange& range, at::Tensor out) const {
    const int64_t world = checkpoint_.state.shard_world;
    if (world == 0) {
      LATHE_ASSIGN_OR_RETURN(at::Tensor t, Tensor(checkpoint_.optimizer, name, e.numel));
      out.copy_(t.slice(0, range.begin - e.offset, range.end - e.offset));
      return absl::OkStatus();
    }
    for (int64_t r = 0; r < world; ++r) {
      const FlatRange theirs = Intersect(e.range(), OwnedRange(layout.numel, r, world));
      const FlatRange part = Intersect(theirs, range);
      if (part.size() == 0) continue;
      LATHE_ASSIGN_OR_RETURN(const std::shared_ptr<const SafetensorsFile>* file, ShardFile(r));
      LATHE_ASSIGN_OR_RETURN(at::Tensor t, Tensor(*file, name, theirs.size()));
      out.slice(0, part.begin - range.begin, part.end - range.begin)
          .copy_(t.slice(0, part.begin - theirs.begin, part.end - theirs.begin));
    }
    return absl::OkStatus();
  }

  // The state tensor `name` exactly as written (shape and type of `out`): from the optimizer
  // file of a stage-0 run, or from rank `rank`'s file of a sharded one.
  absl::Status ReadExact(const std::string& name, int64_t rank, at::Tensor out) const {
    const std::shared_ptr<const SafetensorsFile>* file = &checkpoint_.optimizer;
    if (checkpoint_.state.shard_world > 0) {
      LATHE_ASSIGN_OR_RETURN(file, ShardFile(rank));
    }
    const TensorView* view = *file ? (*file)->Find(name) : nullptr;
    if (view == nullptr ||
        view->shape != std::vector<int64_t>(out.sizes().begin(), out.sizes().end())) {
      return absl::DataLossError(absl::StrCat(*file ? (*file)->path() : "checkpoint", ": tensor \"",
                                              name, "\" is missing or has another shape"));
    }
    LATHE_ASSIGN_OR_RETURN(at::Tensor t, TensorFromFile({view, *file}, out.scalar_type(), false));
    out.copy_(t);
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<const std::shared_ptr<const SafetensorsFile>*> ShardFile(int64_t rank) const {
    auto file = checkpoint_.files.find(ShardFileName(rank));
    if (file == checkpoint_.files.end()) {
      return absl::DataLossError(
          absl::StrCat(checkpoint_.dir, ": ", ShardFileName(rank), " is missing"));
    }
    return &file->second;
  }

  static absl::StatusOr<at::Tensor> Tensor(const std::shared_ptr<const SafetensorsFile>& file,
                                           const std::string& name, int64_t numel) {
    const TensorView* view = file ? file->Find(name) : nullptr;
    int64_t count = 1;
    if (view != nullptr) {
      for (int64_t d : view->shape) count *= d;
    }
    if (view == nullptr || count != numel) {
      return absl::DataLossError(absl::StrCat(file ? file->path() : "checkpoint", ": tensor \"",
                                              name, "\" is missing or has another size"));
    }
    LATHE_ASSIGN_OR_RETURN(at::Tensor t, TensorFromFile({view, file}, at::kFloat, false));
    return t.reshape({-1});
  }

  const LoadedCheckpoint& checkpoint_;
};

}  // namespace

absl::Status ShardedModel::Restore(const LoadedCheckpoint& checkpoint) {
  at::NoGradGuard no_grad;
  FlatReader reader(checkpoint);
  try {
    for (int64_t index = 0; index < num_units(); ++index) {
      Unit& u = units_[index];
      const FlatRange owned = OwnedRange(u.trainable.numel, rank_, world_);
      if (options_.strategy.zero_stage < 3) {
        // Every rank holds the whole parameters: read them all, no collective needed.
        LATHE_RETURN_IF_ERROR(
            reader.ReadParams(index, u.trainable, {0, u.trainable.numel}, u.trainable_whole));
      } else {
        LATHE_RETURN_IF_ERROR(reader.ReadParams(index, u.trainable, owned, u.param_slice));
      }
      if (!u.master.is_same(u.param_slice)) u.master.copy_(u.param_slice);
      const int64_t base = rank_ * u.trainable_shard;
      for (size_t i = 0; i < u.pieces.size(); ++i) {
        const FlatEntry& e = u.trainable.entries[i];
        const FlatRange mine = {base + u.pieces[i].begin, base + u.pieces[i].end};
        const std::vector<Optimizer::StateInfo>& info = u.optimizer->state_info(i);
        for (size_t k = 0; k < info.size(); ++k) {
          const std::string name = absl::StrCat(info[k].kind, ".", e.name, info[k].suffix);
          at::Tensor& t = u.optimizer->state_tensor(i, k);
          if (info[k].layout == StateLayout::kWholeTensor) {
            LATHE_RETURN_IF_ERROR(reader.ReadExact(name, 0, t));
          } else if (mine.size() == 0) {
            continue;
          } else if (info[k].layout == StateLayout::kElementwise) {
            LATHE_RETURN_IF_ERROR(reader.ReadPiece(u.trainable, e, name, mine, t));
          } else if (checkpoint.state.shard_world == world_) {
            LATHE_RETURN_IF_ERROR(reader.ReadExact(name, rank_, t));
          } else {
            return absl::FailedPreconditionError(absl::StrCat(
                checkpoint.dir, ": its 8-bit optimizer state was written ",
                checkpoint.state.shard_world == 0
                    ? std::string("without ZeRO")
                    : absl::StrCat("on ", checkpoint.state.shard_world, " ranks"),
                ", in blocks of each rank's part of a tensor; resume it on as many ranks"));
          }
        }
      }
      u.optimizer->set_steps(checkpoint.state.optimizer_steps);
    }
  } catch (const c10::Error& e) {
    return StatusFromTorchError(e, absl::StrCat("restoring ", checkpoint.dir));
  }
  optimizer_steps_ = checkpoint.state.optimizer_steps;
  return absl::OkStatus();
}

absl::Status ShardedModel::ForEachTrainableUnit(
    const std::function<absl::Status(int64_t,
                                     const std::vector<std::pair<std::string, at::Tensor>>&)>& fn) {
  at::NoGradGuard no_grad;
  for (int64_t index = 0; index < num_units(); ++index) {
    Unit& u = units_[index];
    if (u.trainable.entries.empty()) continue;
    at::Tensor whole = u.trainable_whole;
    if (options_.strategy.zero_stage == 3) {
      MemoryScope scope(MemoryComponent::kCommBuffers);
      whole = at::empty({world_ * u.trainable_shard}, u.trainable_whole.options());
      at::Tensor in = u.trainable_slice.to(device());
      LATHE_RETURN_IF_ERROR(
          Annotate(comm_->AllGather(in.data_ptr(), whole.data_ptr(),
                                    static_cast<size_t>(in.numel()) * in.element_size()),
                   absl::StrCat("gathering unit ", index)));
    }
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const FlatEntry& e : u.trainable.entries) tensors.emplace_back(e.name, Flat(whole, e));
    LATHE_RETURN_IF_ERROR(fn(index, tensors));
  }
  return absl::OkStatus();
}

ShardBytes ShardedModel::bytes() const {
  // The tensors' own sizes (a gathered unit's even while its storage is freed); gradients
  // exist only during a step, so theirs are counted from the layout.
  auto bytes_of = [](const at::Tensor& t) {
    return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
  };
  ShardBytes b;
  for (const Unit& u : units_) {
    if (options_.strategy.zero_stage == 3) {
      b.frozen += bytes_of(u.frozen_slice) + bytes_of(u.nf4_slice);
      b.trainable += bytes_of(u.trainable_slice);
      b.largest_unit =
          std::max(b.largest_unit,
                   bytes_of(u.frozen_whole) + bytes_of(u.trainable_whole) + bytes_of(u.nf4_whole));
    } else {
      for (const at::Tensor* slot : u.frozen_slots) b.frozen += bytes_of(*slot);
      b.trainable += bytes_of(u.trainable_whole);
    }
    b.gradients += (options_.strategy.zero_stage == 1 ? world_ : 1) * u.trainable_shard * 4;
    b.optimizer += (u.optimizer ? u.optimizer->StateBytes() : 0) +
                   (u.master.is_same(u.param_slice) ? 0 : bytes_of(u.master));
  }
  return b;
}

}  // namespace lathe
