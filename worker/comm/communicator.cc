#include "worker/comm/communicator.h"

#include <cstring>
#include <limits>

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

absl::Status CheckAllGatherArgs(const void* in, const void* out, size_t bytes_per_rank, int rank,
                                int world_size) {
  if (bytes_per_rank > std::numeric_limits<size_t>::max() / static_cast<size_t>(world_size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "all-gather: ", world_size, " x ", bytes_per_rank, " bytes overflow the address space"));
  }
  if (bytes_per_rank == 0) return absl::OkStatus();
  if (in == nullptr || out == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("all-gather: null ", in == nullptr ? "input" : "output", " buffer for ",
                     bytes_per_rank, " bytes per rank"));
  }
  // Compare as integers: relational operators on unrelated pointers are unspecified.
  const auto in_begin = reinterpret_cast<uintptr_t>(in);
  const auto out_begin = reinterpret_cast<uintptr_t>(out);
  const uintptr_t own_slot = out_begin + static_cast<uintptr_t>(rank) * bytes_per_rank;
  const uintptr_t out_end = out_begin + static_cast<uintptr_t>(world_size) * bytes_per_rank;
  const bool overlaps = in_begin < out_end && out_begin < in_begin + bytes_per_rank;
  if (overlaps && in_begin != own_slot) {
    return absl::InvalidArgumentError(
        absl::StrCat("all-gather: the input overlaps the output but is not rank ", rank,
                     "'s own slot (out + rank * bytes_per_rank)"));
  }
  return absl::OkStatus();
}

}  // namespace comm_internal

namespace {

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

  absl::Status Barrier() override { return absl::OkStatus(); }
};

}  // namespace

std::unique_ptr<Communicator> MakeSingleRankCommunicator() {
  return std::make_unique<SingleRankCommunicator>();
}

}  // namespace lathe
