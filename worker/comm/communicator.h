// The collectives that the ranks of one attempt run together: all-reduce, broadcast,
// all-gather and barrier over raw host buffers. Backends: gloo over TCP (gloo_communicator.h),
// an in-process group for tests (fake_communicator.h) and the single-rank identity
// (MakeSingleRankCommunicator below). NCCL comes later behind the same interface.
//
// No libtorch here: buffers are raw pointers with an element count and a CommDType, so the
// engine, the shard layer and the tests can all call it cheaply.
//
// Contract shared by every backend (tests/comm/communicator_contract_test.cc checks it):
//   - Every rank of the group makes the same sequence of calls with the same counts, dtype
//     and root. A rank that calls something different leaves the group in an undefined
//     state (the fake backend reports INVALID_ARGUMENT; gloo may time out or break).
//   - Calls are synchronous: they return when this rank's part is complete and its buffers
//     may be reused. (Asynchronous work handles, as c10d's Work, can come later.)
//   - Errors: INVALID_ARGUMENT for bad local arguments (null buffer, root out of range),
//     checked before any communication. ABORTED when a peer vanished or the transport broke;
//     the communicator is unusable afterwards and every later call returns ABORTED too, so
//     the caller should end the attempt. DEADLINE_EXCEEDED when peers did not take part
//     within the backend's timeout (the communicator is then unusable as well).
//   - A call with zero elements or bytes returns OK at once without communicating.
//
// Thread-safety: an implementation may be called from several threads, but calls are
// serialized internally; the order in which they run must still match across ranks.
#ifndef LATHE_WORKER_COMM_COMMUNICATOR_H_
#define LATHE_WORKER_COMM_COMMUNICATOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace lathe {

// Element types a reduction understands. Broadcast and AllGather move bytes and need none.
enum class CommDType {
  kFloat32,
  kFloat64,
  kInt64,
};

// Bytes per element (4, 8, 8).
size_t CommDTypeSize(CommDType dtype);
// "float32", "float64", "int64".
absl::string_view CommDTypeName(CommDType dtype);

class Communicator {
 public:
  virtual ~Communicator() = default;

  // This rank, in [0, world_size()).
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Replaces data[0, count) on every rank by the element-wise sum over all ranks.
  // REQUIRES: data holds count elements of dtype (may be null when count is 0).
  // Floating-point sums may be added in a backend-specific order; integer-valued inputs
  // that fit the type exactly give identical results on every backend.
  virtual absl::Status AllReduceSum(void* data, size_t count, CommDType dtype) = 0;

  // Copies root's data[0, bytes) into data on every other rank.
  // REQUIRES: 0 <= root < world_size(); data holds `bytes` bytes on every rank.
  virtual absl::Status Broadcast(void* data, size_t bytes, int root) = 0;

  // Concatenates every rank's `in` in rank order into `out` on every rank: rank r's bytes
  // land at out + r * bytes_per_rank.
  // REQUIRES: out holds world_size() * bytes_per_rank bytes; in holds bytes_per_rank bytes
  // and either equals out + rank() * bytes_per_rank (in place) or does not overlap out.
  virtual absl::Status AllGather(const void* in, void* out, size_t bytes_per_rank) = 0;

  // Returns once every rank has entered the barrier.
  virtual absl::Status Barrier() = 0;
};

// The communicator of a group of one: every collective is the identity (AllGather copies
// in to out). Needs no networking.
std::unique_ptr<Communicator> MakeSingleRankCommunicator();

namespace comm_internal {

// The local argument checks every backend makes before communicating: INVALID_ARGUMENT
// naming the call and the problem, OK otherwise.
absl::Status CheckAllReduceArgs(const void* data, size_t count, CommDType dtype);
absl::Status CheckBroadcastArgs(const void* data, size_t bytes, int root, int world_size);
absl::Status CheckAllGatherArgs(const void* in, const void* out, size_t bytes_per_rank, int rank,
                                int world_size);

}  // namespace comm_internal
}  // namespace lathe

#endif  // LATHE_WORKER_COMM_COMMUNICATOR_H_
