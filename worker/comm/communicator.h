// The collectives that the ranks of one attempt run together: all-reduce, reduce-scatter,
// broadcast, all-gather and barrier over raw buffers. Backends: gloo over TCP on host memory
// (gloo_communicator.h), NCCL on CUDA device memory (nccl_communicator.h), an in-process
// group for tests (fake_communicator.h) and the single-rank identity
// (MakeSingleRankCommunicator below).
//
// No libtorch here: buffers are raw pointers with an element count and a CommDType, so the
// engine, the shard layer and the tests can all call it cheaply.
//
// Contract shared by every backend (tests/comm/communicator_contract_test.cc checks it):
//   - Every rank of the group makes the same sequence of calls with the same counts, dtype
//     and root. A rank that calls something different leaves the group in an undefined
//     state (the fake backend reports INVALID_ARGUMENT; gloo may time out or break).
//   - The plain calls are synchronous: they return when this rank's part is complete and
//     its buffers may be reused. The Start* forms return a CommWork at once (as c10d's Work),
//     so that an all-gather can run while a block computes; their buffers must stay valid
//     and untouched until Wait returns. A backend may also complete a Start* call before it
//     returns (the fake and single-rank ones do). Synchronous and asynchronous calls run in
//     the order they were issued.
//   - Every call is bounded by the communicator's timeout, given when it is made: a peer that
//     does not take part within it fails the call with DEADLINE_EXCEEDED instead of hanging
//     this rank.
//   - Errors: INVALID_ARGUMENT for bad local arguments (null buffer, root out of range),
//     checked before any communication. ABORTED when a peer vanished or the transport broke;
//     the communicator is unusable afterwards and every later call returns ABORTED too, so
//     the caller should end the attempt. DEADLINE_EXCEEDED as above (the communicator is then
//     unusable as well).
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
#include "absl/time/time.h"

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

// Where a communicator's buffers live. A CUDA job's ranks pass device pointers: NCCL, or a
// host backend staged through pinned host memory (cuda_communicator.h).
enum class CommMemory {
  kHost,
  kCuda,
};

// A collective started by one of Communicator's Start* calls. REQUIRES: waited for or
// destroyed before its communicator.
class CommWork {
 public:
  // Waits for the collective if Wait was not called, so that its buffers are never written
  // after the handle is gone.
  virtual ~CommWork() = default;

  // Blocks until the collective is complete on this rank and returns its status (the codes
  // of the file comment). Call at most once.
  virtual absl::Status Wait() = 0;
};

// A handle of a collective that has already ended with `status`.
std::unique_ptr<CommWork> FinishedWork(absl::Status status);

class Communicator {
 public:
  virtual ~Communicator() = default;

  // This rank, in [0, world_size()).
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Where every buffer passed to this communicator must be.
  virtual CommMemory memory() const { return CommMemory::kHost; }

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

  // Sums `in` (world_size() blocks of count_per_rank elements) element-wise over every rank
  // and leaves block rank() of the sum in `out` (count_per_rank elements).
  // REQUIRES: in holds world_size() * count_per_rank elements of dtype; out holds
  // count_per_rank of them and either equals in's own block (in + rank() * count_per_rank
  // elements: in place) or does not overlap in. `in` is not modified.
  virtual absl::Status ReduceScatterSum(const void* in, void* out, size_t count_per_rank,
                                        CommDType dtype) = 0;

  // Returns once every rank has entered the barrier.
  virtual absl::Status Barrier() = 0;

  // The asynchronous forms of AllReduceSum, AllGather and ReduceScatterSum (see the file
  // comment). Argument errors come back from Wait. The default runs the call before
  // returning.
  virtual std::unique_ptr<CommWork> StartAllReduceSum(void* data, size_t count, CommDType dtype);
  virtual std::unique_ptr<CommWork> StartAllGather(const void* in, void* out,
                                                   size_t bytes_per_rank);
  virtual std::unique_ptr<CommWork> StartReduceScatterSum(const void* in, void* out,
                                                          size_t count_per_rank, CommDType dtype);
};

// The base of a backend whose every collective is started (gloo on its own thread, NCCL on
// its stream): the synchronous AllReduceSum, AllGather and ReduceScatterSum start the call
// and wait for it, so that they keep their place in the issue order.
class StartedCommunicator : public Communicator {
 public:
  absl::Status AllReduceSum(void* data, size_t count, CommDType dtype) final {
    return StartAllReduceSum(data, count, dtype)->Wait();
  }
  absl::Status AllGather(const void* in, void* out, size_t bytes_per_rank) final {
    return StartAllGather(in, out, bytes_per_rank)->Wait();
  }
  absl::Status ReduceScatterSum(const void* in, void* out, size_t count_per_rank,
                                CommDType dtype) final {
    return StartReduceScatterSum(in, out, count_per_rank, dtype)->Wait();
  }

  std::unique_ptr<CommWork> StartAllReduceSum(void* data, size_t count,
                                              CommDType dtype) override = 0;
  std::unique_ptr<CommWork> StartAllGather(const void* in, void* out,
                                           size_t bytes_per_rank) override = 0;
  std::unique_ptr<CommWork> StartReduceScatterSum(const void* in, void* out, size_t count_per_rank,
                                                  CommDType dtype) override = 0;
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
absl::Status CheckReduceScatterArgs(const void* in, const void* out, size_t count_per_rank,
                                    CommDType dtype, int rank, int world_size);
// What every Connect* checks first: INVALID_ARGUMENT "<backend>: ..." for a rank outside
// [0, world_size), a world size below 1 or a timeout that is not positive.
absl::Status CheckConnectArgs(absl::string_view backend, int rank, int world_size,
                              absl::Duration timeout);

}  // namespace comm_internal
}  // namespace lathe

#endif  // LATHE_WORKER_COMM_COMMUNICATOR_H_
