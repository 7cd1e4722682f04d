#include "worker/comm/fake_communicator.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"

namespace lathe {
namespace {

enum class Op { kAllReduce, kReduceScatter, kBroadcast, kAllGather, kBarrier };

// What one rank asked for in one round. `size` counts elements for all-reduce and
// reduce-scatter (per rank), bytes otherwise.
struct Call {
  Op op = Op::kBarrier;
  const void* in = nullptr;
  size_t size = 0;
  CommDType dtype = CommDType::kFloat32;
  int root = 0;

  bool operator==(const Call& other) const {
    return op == other.op && size == other.size && root == other.root &&
           ((op != Op::kAllReduce && op != Op::kReduceScatter) || dtype == other.dtype);
  }
};

std::string Describe(const Call& call) {
  switch (call.op) {
    case Op::kAllReduce:
      return absl::StrCat("all-reduce of ", call.size, " ", CommDTypeName(call.dtype));
    case Op::kReduceScatter:
      return absl::StrCat("reduce-scatter of ", call.size, " ", CommDTypeName(call.dtype),
                          " per rank");
    case Op::kBroadcast:
      return absl::StrCat("broadcast of ", call.size, " bytes from rank ", call.root);
    case Op::kAllGather:
      return absl::StrCat("all-gather of ", call.size, " bytes per rank");
    case Op::kBarrier:
      return "barrier";
  }
  return "?";
}

// acc += in, element-wise. acc's bytes carry no alignment guarantee, hence memcpy.
template <typename T>
void SumInto(std::string& acc, const void* in, size_t count) {
  const auto* b = static_cast<const T*>(in);
  for (size_t i = 0; i < count; ++i) {
    T a;
    std::memcpy(&a, acc.data() + i * sizeof(T), sizeof(T));
    a += b[i];
    std::memcpy(acc.data() + i * sizeof(T), &a, sizeof(T));
  }
}

// The outcome of one round, shared read-only by its ranks.
struct Round {
  absl::Status status;
  std::string result;  // the reduced, broadcast or gathered bytes
};

class FakeGroupImpl final : public FakeGroup, public std::enable_shared_from_this<FakeGroupImpl> {
 public:
  FakeGroupImpl(int world_size, FakeGroupOptions options)
      : world_size_(world_size), options_(options), calls_(world_size) {}

  std::vector<std::unique_ptr<Communicator>> Members() override;

  void Break(absl::Status status) override {
    absl::MutexLock lock(&mu_);
    if (broken_.ok()) broken_ = std::move(status);
  }

  int world_size() const { return world_size_; }

  // Deposits `call` for this round and returns the round once every rank has arrived.
  absl::StatusOr<std::shared_ptr<const Round>> Meet(int rank, const Call& call) {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) return broken_;
    const int64_t my_round = round_;
    calls_[rank] = call;
    if (++arrived_ == world_size_) {
      // The others are blocked below, so their buffers are stable while we read them.
      last_ = Compute();
      for (std::optional<Call>& c : calls_) c.reset();
      arrived_ = 0;
      ++round_;
      return last_;
    }
    auto done = [this, my_round]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return round_ != my_round || !broken_.ok();
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&done), options_.timeout)) {
      std::vector<int> missing;
      for (int r = 0; r < world_size_; ++r) {
        if (!calls_[r].has_value()) missing.push_back(r);
      }
      broken_ = absl::DeadlineExceededError(absl::StrCat(
          "fake group: rank ", rank, " waited ", absl::FormatDuration(options_.timeout), " in ",
          Describe(call), " for rank(s) ", absl::StrJoin(missing, ", ")));
    }
    if (round_ != my_round) return last_;
    return broken_;
  }

 private:
  std::shared_ptr<const Round> Compute() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto round = std::make_shared<Round>();
    const Call& first = *calls_[0];
    for (int r = 1; r < world_size_; ++r) {
      if (!(*calls_[r] == first)) {
        round->status = absl::InvalidArgumentError(
            absl::StrCat("fake group: ranks disagree: rank 0 called ", Describe(first), ", rank ",
                         r, " called ", Describe(*calls_[r])));
        return round;
      }
    }
    switch (first.op) {
      case Op::kAllReduce:
      case Op::kReduceScatter: {
        // A reduce-scatter sums every rank's whole input; each takes its block.
        const size_t count = first.op == Op::kAllReduce ? first.size : first.size * world_size_;
        round->result.assign(static_cast<const char*>(first.in),
                             count * CommDTypeSize(first.dtype));
        for (int r = 1; r < world_size_; ++r) {
          switch (first.dtype) {
            case CommDType::kFloat32:
              SumInto<float>(round->result, calls_[r]->in, count);
              break;
            case CommDType::kFloat64:
              SumInto<double>(round->result, calls_[r]->in, count);
              break;
            case CommDType::kInt64:
              SumInto<int64_t>(round->result, calls_[r]->in, count);
              break;
          }
        }
        break;
      }
      case Op::kBroadcast:
        round->result.assign(static_cast<const char*>(calls_[first.root]->in), first.size);
        break;
      case Op::kAllGather:
        round->result.reserve(first.size * world_size_);
        for (int r = 0; r < world_size_; ++r) {
          round->result.append(static_cast<const char*>(calls_[r]->in), first.size);
        }
        break;
      case Op::kBarrier:
        break;
    }
    return round;
  }

  const int world_size_;
  const FakeGroupOptions options_;
  absl::Mutex mu_;
  std::vector<std::optional<Call>> calls_ ABSL_GUARDED_BY(mu_);
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t round_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<const Round> last_ ABSL_GUARDED_BY(mu_);
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

class FakeMember final : public Communicator {
 public:
  FakeMember(std::shared_ptr<FakeGroupImpl> group, int rank)
      : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return group_->world_size(); }

  absl::Status AllReduceSum(void* data, size_t count, CommDType dtype) override {
    LATHE_RETURN_IF_ERROR(comm_internal::CheckAllReduceArgs(data, count, dtype));
    if (count == 0) return absl::OkStatus();
    return Collective({Op::kAllReduce, data, count, dtype, 0}, data);
  }

  absl::Status Broadcast(void* data, size_t bytes, int root) override {
    LATHE_RETURN_IF_ERROR(comm_internal::CheckBroadcastArgs(data, bytes, root, world_size()));
    if (bytes == 0) return absl::OkStatus();
    return Collective({Op::kBroadcast, data, bytes, CommDType::kFloat32, root},
                      root == rank_ ? nullptr : data);
  }

  absl::Status AllGather(const void* in, void* out, size_t bytes_per_rank) override {
    LATHE_RETURN_IF_ERROR(
        comm_internal::CheckAllGatherArgs(in, out, bytes_per_rank, rank_, world_size()));
    if (bytes_per_rank == 0) return absl::OkStatus();
    return Collective({Op::kAllGather, in, bytes_per_rank, CommDType::kFloat32, 0}, out);
  }

  absl::Status ReduceScatterSum(const void* in, void* out, size_t count_per_rank,
                                CommDType dtype) override {
    LATHE_RETURN_IF_ERROR(
        comm_internal::CheckReduceScatterArgs(in, out, count_per_rank, dtype, rank_, world_size()));
    if (count_per_rank == 0) return absl::OkStatus();
    const size_t block = count_per_rank * CommDTypeSize(dtype);
    return Collective({Op::kReduceScatter, in, count_per_rank, dtype, 0}, out,
                      static_cast<size_t>(rank_) * block, block);
  }

  absl::Status Barrier() override {
    return Collective({Op::kBarrier, nullptr, 0, CommDType::kFloat32, 0}, nullptr);
  }

 private:
  // Meets the other ranks and copies `bytes` of the round's result from `offset` (all of it
  // when `bytes` is npos) to `out` (when not null).
  absl::Status Collective(const Call& call, void* out, size_t offset = 0,
                          size_t bytes = std::string::npos) {
    absl::MutexLock lock(&mu_);
    LATHE_ASSIGN_OR_RETURN(std::shared_ptr<const Round> round, group_->Meet(rank_, call));
    LATHE_RETURN_IF_ERROR(round->status);
    if (out != nullptr && !round->result.empty()) {
      const size_t n = std::min(bytes, round->result.size() - offset);
      std::memcpy(out, round->result.data() + offset, n);
    }
    return absl::OkStatus();
  }

  const std::shared_ptr<FakeGroupImpl> group_;
  const int rank_;
  absl::Mutex mu_;  // serializes this member's calls
};

std::vector<std::unique_ptr<Communicator>> FakeGroupImpl::Members() {
  std::vector<std::unique_ptr<Communicator>> members;
  members.reserve(world_size_);
  for (int r = 0; r < world_size_; ++r) {
    members.push_back(std::make_unique<FakeMember>(shared_from_this(), r));
  }
  return members;
}

}  // namespace

std::shared_ptr<FakeGroup> FakeGroup::Create(int world_size, FakeGroupOptions options) {
  return std::make_shared<FakeGroupImpl>(world_size, options);
}

std::vector<std::unique_ptr<Communicator>> MakeFakeGroup(int world_size, FakeGroupOptions options) {
  return FakeGroup::Create(world_size, options)->Members();
}

}  // namespace lathe
