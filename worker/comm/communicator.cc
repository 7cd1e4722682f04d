#include "worker/comm/communicator.h"

#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace lathe {

size_t CommDTypeSize(CommDType dtype) {
  switch (dtype) {
    case CommDType::kFloat32:
      return 4;
    case CommDType::kFloat64:
    case CommDType::kInt64:
      return 8;
  }
  return 0;
}

absl::string_view CommDTypeName(CommDType dtype) {
  switch (dtype) {
    case CommDType::kFloat32:
      return "float32";
    case CommDType::kFloat64:
      return "float64";
    case CommDType::kInt64:
      return "int64";
  }
  return "unknown";
}

namespace comm_internal {

absl::Status CheckAllReduceArgs(const void* data, size_t count, CommDType dtype) {
  const size_t element_size = CommDTypeSize(dtype);
  if (element_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("all-reduce: unknown dtype ", static_cast<int>(dtype)));
  }
  if (count > std::numeric_limits<size_t>::max() / element_size) {
    return absl::InvalidArgumentError(absl::StrCat("all-reduce: ", count, " elements of ",
                                                   CommDTypeName(dtype),
                                                   " overflow the address space"));
  }
  if (data == nullptr && count > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("all-reduce: null buffer for ", count, " elements"));
  }
  return absl::OkStatus();
}

absl::Status CheckBroadcastArgs(const void* data, size_t bytes, int root, int world_size) {
  if (root < 0 || root >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("broadcast: root ", root, " is not a rank of a group of ", world_size));
  }
  if (data == nullptr && bytes > 0) {
    return absl::InvalidArgumentError(absl::StrCat("broadcast: null buffer for ", bytes, " bytes"));
  }
  return absl::OkStatus();
}

namespace {

// The checks all-gather and reduce-scatter share: `whole` holds world_size blocks of
// `block_bytes`, `part` one block, and they either do not overlap or `part` is rank's own
// block of `whole`.
absl::Status CheckBlocks(absl::string_view op, const void* whole, const void* part,
                         size_t block_bytes, int rank, int world_size) {
  if (block_bytes > std::numeric_limits<size_t>::max() / static_cast<size_t>(world_size)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", world_size, " x ", block_bytes,
                                                   " bytes overflow the address space"));
  }
  if (block_bytes == 0) return absl::OkStatus();
  if (whole == nullptr || part == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": null buffer for ", block_bytes, " bytes per rank"));
  }
  // Compare as integers: relational operators on unrelated pointers are unspecified.
  const auto part_begin = reinterpret_cast<uintptr_t>(part);
  const auto whole_begin = reinterpret_cast<uintptr_t>(whole);
  const uintptr_t own_block = whole_begin + static_cast<uintptr_t>(rank) * block_bytes;
  const uintptr_t whole_end = whole_begin + static_cast<uintptr_t>(world_size) * block_bytes;
  const bool overlaps = part_begin < whole_end && whole_begin < part_begin + block_bytes;
  if (overlaps && part_begin != own_block) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": the rank's block overlaps the whole buffer but is not rank ", rank,
                     "'s own block (whole + rank * block)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckAllGatherArgs(const void* in, const void* out, size_t bytes_per_rank, int rank,
                                int world_size) {
  return CheckBlocks("all-gather", out, in, bytes_per_rank, rank, world_size);
}

absl::Status CheckReduceScatterArgs(const void* in, const void* out, size_t count_per_rank,
                                    CommDType dtype, int rank, int world_size) {
  const size_t element_size = CommDTypeSize(dtype);
  if (element_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("reduce-scatter: unknown dtype ", static_cast<int>(dtype)));
  }
  if (count_per_rank > std::numeric_limits<size_t>::max() / element_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("reduce-scatter: ", count_per_rank, " elements overflow the address space"));
  }
  return CheckBlocks("reduce-scatter", in, out, count_per_rank * element_size, rank, world_size);
}

absl::Status CheckConnectArgs(absl::string_view backend, int rank, int world_size,
                              absl::Duration timeout) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(backend, ": rank ", rank, " is not a rank of a group of ", world_size));
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(backend, ": timeout must be positive, got ", absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

}  // namespace comm_internal

namespace {

class FinishedCommWork final : public CommWork {
 public:
  explicit FinishedCommWork(absl::Status status) : status_(std::move(status)) {}
  absl::Status Wait() override { return status_; }

 private:
  const absl::Status status_;
};

class SingleRankCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }

  absl::Status AllReduceSum(void* data, size_t count, CommDType dtype) override {
    return comm_internal::CheckAllReduceArgs(data, count, dtype);
  }

  absl::Status Broadcast(void* data, size_t bytes, int root) override {
    return comm_internal::CheckBroadcastArgs(data, bytes, root, 1);
  }

  absl::Status AllGather(const void* in, void* out, size_t bytes_per_rank) override {
    LATHE_RETURN_IF_ERROR(comm_internal::CheckAllGatherArgs(in, out, bytes_per_rank, 0, 1));
    if (bytes_per_rank > 0 && in != out) std::memcpy(out, in, bytes_per_rank);
    return absl::OkStatus();
  }

  absl::Status ReduceScatterSum(const void* in, void* out, size_t count_per_rank,
                                CommDType dtype) override {
    LATHE_RETURN_IF_ERROR(
        comm_internal::CheckReduceScatterArgs(in, out, count_per_rank, dtype, 0, 1));
    const size_t bytes = count_per_rank * CommDTypeSize(dtype);
    if (bytes > 0 && in != out) std::memcpy(out, in, bytes);
    return absl::OkStatus();
  }

  absl::Status Barrier() override { return absl::OkStatus(); }
};

}  // namespace

std::unique_ptr<CommWork> FinishedWork(absl::Status status) {
  return std::make_unique<FinishedCommWork>(std::move(status));
}

std::unique_ptr<CommWork> Communicator::StartAllReduceSum(void* data, size_t count,
                                                          CommDType dtype) {
  return FinishedWork(AllReduceSum(data, count, dtype));
}

std::unique_ptr<CommWork> Communicator::StartAllGather(const void* in, void* out,
                                                       size_t bytes_per_rank) {
  return FinishedWork(AllGather(in, out, bytes_per_rank));
}

std::unique_ptr<CommWork> Communicator::StartReduceScatterSum(const void* in, void* out,
                                                              size_t count_per_rank,
                                                              CommDType dtype) {
  return FinishedWork(ReduceScatterSum(in, out, count_per_rank, dtype));
}

std::unique_ptr<Communicator> MakeSingleRankCommunicator() {
  return std::make_unique<SingleRankCommunicator>();
}

}  // namespace lathe
