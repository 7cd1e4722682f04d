// Communicators whose buffers are CUDA device memory, besides NCCL (nccl_communicator.h):
//
//   - MakeCudaSingleRankCommunicator: the group of one of a CUDA job (a ZeRO run on one
//     GPU): every collective is the identity; AllGather and ReduceScatterSum copy device to
//     device on the caller's stream, in stream order, so nothing waits on the host.
//   - MakeCudaStagedCommunicator: any host-memory communicator (gloo) over device buffers.
//     Each call copies its device buffers into pinned host buffers (after the work the
//     caller's stream had enqueued), runs the host collective and copies the result back,
//     then waits for that copy. NCCL refuses two ranks on one GPU; through this, several
//     ranks share one (the one-GPU test of the sharded code's CUDA path), or a machine
//     without NCCL's transports still trains. Start* calls complete before they return.
//
// Both keep the contract of communicator.h (argument checks first, zero counts return at
// once) and report CommMemory::kCuda. CUDA errors are ABORTED naming the call.
//
// Built when the CUDA toolkit is found (LATHE_WITH_CUDART); otherwise both return
// FAILED_PRECONDITION. No libtorch: cudart only.
//
// Thread-safety: as the wrapped communicator; the staged one serializes its calls.
#ifndef LATHE_WORKER_COMM_CUDA_COMMUNICATOR_H_
#define LATHE_WORKER_COMM_CUDA_COMMUNICATOR_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

namespace lathe {

struct CudaCommOptions {
  int device = 0;  // the CUDA device of this rank (as the process sees it)
  // The stream (a cudaStream_t) the caller's device work runs on; every call is ordered
  // after what was enqueued on it. Null: the legacy default stream, libtorch's default.
  void* stream = nullptr;
};

absl::StatusOr<std::unique_ptr<Communicator>> MakeCudaSingleRankCommunicator(
    const CudaCommOptions& options);

// REQUIRES: host->memory() is CommMemory::kHost.
absl::StatusOr<std::unique_ptr<Communicator>> MakeCudaStagedCommunicator(
    std::unique_ptr<Communicator> host, const CudaCommOptions& options);

}  // namespace lathe

#endif  // LATHE_WORKER_COMM_CUDA_COMMUNICATOR_H_
