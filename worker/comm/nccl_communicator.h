// The GPU backend of Communicator: NCCL on CUDA device memory. Every buffer passed to its
// calls is a device pointer on the communicator's device; the collectives run on a stream
// of its own, in the order they were issued, each after the work the caller's stream
// (NcclOptions::stream) had enqueued when it was called (an event, not a device-wide sync),
// and a Start* handle's Wait returns when the collective's work on that stream has finished:
// its output may then be read by work enqueued afterwards on any stream.
//
// ConnectNccl meets the other ranks through a KvStore: rank 0 creates NCCL's unique id and
// publishes it under "<key_prefix>/id"; every rank then creates its communicator
// (ncclCommInitRankConfig, non-blocking). Each call, the initialisation included, is bounded
// by `timeout`: a rank that waits longer (a peer died or hangs) aborts the communicator
// (ncclCommAbort) and returns DEADLINE_EXCEEDED, and every later call returns ABORTED, as
// communicator.h says. NCCL's own errors map to ABORTED (a peer or the transport failed) or
// INVALID_ARGUMENT (bad usage).
//
// Built whenever CUDA and NCCL are found (LATHE_WITH_NCCL); without them ConnectNccl returns
// FAILED_PRECONDITION. No libtorch: cudart and NCCL only.
//
// Thread-safety: thread-safe; calls are serialized.
#ifndef LATHE_WORKER_COMM_NCCL_COMMUNICATOR_H_
#define LATHE_WORKER_COMM_NCCL_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"
#include "worker/comm/kv_store.h"

namespace lathe {

struct NcclOptions {
  int device = 0;  // the CUDA device of this rank (as the process sees it)
  // The stream (a cudaStream_t) whose work writes the buffers passed in: each collective
  // waits for what it had enqueued. Null: the legacy default stream, libtorch's default.
  void* stream = nullptr;
  absl::Duration timeout = absl::Seconds(60);
  // Namespace of this communicator's keys in the store: one per communicator sharing a store.
  std::string key_prefix = "nccl";
};

// Connects rank `rank` of a group of `world_size`. Blocks until every rank has joined.
// INVALID_ARGUMENT for a bad rank, world size, timeout, store or device; DEADLINE_EXCEEDED
// when some rank did not join within options.timeout; the store's own error when a store
// call fails; ABORTED for NCCL or CUDA failures; FAILED_PRECONDITION when this build has no
// NCCL. REQUIRES: `store` outlives this call (it is not used afterwards).
absl::StatusOr<std::unique_ptr<Communicator>> ConnectNccl(KvStore* store, int rank, int world_size,
                                                          const NcclOptions& options);

}  // namespace lathe

#endif  // LATHE_WORKER_COMM_NCCL_COMMUNICATOR_H_
