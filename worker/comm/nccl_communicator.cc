#include "worker/comm/nccl_communicator.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/comm/prefix_kv_store.h"

#ifdef LATHE_WITH_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#endif

namespace lathe {

#ifdef LATHE_WITH_NCCL
namespace {

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat(what, ": CUDA error ", cudaGetErrorName(error), ": ",
                                         cudaGetErrorString(error)));
}

absl::Status NcclStatus(ncclResult_t result, absl::string_view what) {
  switch (result) {
    case ncclSuccess:
    case ncclInProgress:
      return absl::OkStatus();
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(absl::StrCat(what, ": NCCL: ", ncclGetErrorString(result)));
    default:
      return absl::AbortedError(absl::StrCat(what, ": NCCL: ", ncclGetErrorString(result)));
  }
}

ncclDataType_t NcclType(CommDType dtype) {
  switch (dtype) {
    case CommDType::kFloat32:
      return ncclFloat32;
    case CommDType::kFloat64:
      return ncclFloat64;
    case CommDType::kInt64:
      return ncclInt64;
  }
  return ncclFloat32;
}

// Short sleeps between polls: a collective on a GPU takes microseconds to milliseconds.
constexpr absl::Duration kPollInterval = absl::Microseconds(50);

// Waits until the communicator's pending operation (initialisation, or an enqueue that
// returned ncclInProgress) has finished; DEADLINE_EXCEEDED at `deadline`.
absl::Status AwaitComm(ncclComm_t comm, absl::Time deadline, absl::string_view what) {
  while (true) {
    ncclResult_t state = ncclSuccess;
    LATHE_RETURN_IF_ERROR(NcclStatus(ncclCommGetAsyncError(comm, &state), what));
    if (state != ncclInProgress) return NcclStatus(state, what);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": not done in time"));
    }
    absl::SleepFor(kPollInterval);
  }
}

class NcclCommunicator;

// A collective enqueued on the communicator's stream: done when its event has completed.
class NcclWork final : public CommWork {
 public:
  NcclWork(NcclCommunicator* comm, cudaEvent_t event, std::string what)
      : comm_(comm), event_(event), what_(std::move(what)) {}
  ~NcclWork() override;
  absl::Status Wait() override;

 private:
  NcclCommunicator* const comm_;
  cudaEvent_t event_;
  const std::string what_;
  bool waited_ = false;
};

class NcclCommunicator final : public StartedCommunicator {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, cudaEvent_t ready,
                   cudaStream_t caller_stream, int device, int rank, int world_size,
                   absl::Duration timeout)
      : comm_(comm),
        stream_(stream),
        ready_(ready),
        caller_stream_(caller_stream),
        device_(device),
        rank_(rank),
        world_size_(world_size),
        timeout_(timeout) {}

  // Destroys the communicator once its stream is idle; aborts it when the stream is still
  // busy after the timeout (a collective that waits for a dead peer), or it broke.
  ~NcclCommunicator() override {
    absl::MutexLock lock(&mu_);
    cudaSetDevice(device_);
    if (comm_ != nullptr) {
      const absl::Time deadline = absl::Now() + timeout_;
      cudaError_t idle;
      while ((idle = cudaStreamQuery(stream_)) == cudaErrorNotReady && absl::Now() < deadline) {
        absl::SleepFor(kPollInterval);
      }
      if (idle == cudaSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    cudaFree(barrier_);
    cudaEventDestroy(ready_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  CommMemory memory() const override { return CommMemory::kCuda; }

  absl::Status Broadcast(void* data, size_t bytes, int root) override {
    LATHE_RETURN_IF_ERROR(comm_internal::CheckBroadcastArgs(data, bytes, root, world_size_));
    if (bytes == 0) return absl::OkStatus();
    return Enqueue(
               "broadcast",
               [&] { return ncclBroadcast(data, data, bytes, ncclUint8, root, comm_, stream_); })
        ->Wait();
  }

  absl::Status Barrier() override {
    {
      absl::MutexLock lock(&mu_);
      if (barrier_ == nullptr) {
        cudaSetDevice(device_);
        LATHE_RETURN_IF_ERROR(
            CudaStatus(cudaMalloc(&barrier_, sizeof(float)), "barrier: cudaMalloc"));
      }
    }
    return Enqueue("barrier",
                   [&] {
                     return ncclAllReduce(barrier_, barrier_, 1, ncclFloat32, ncclSum, comm_,
                                          stream_);
                   })
        ->Wait();
  }

  std::unique_ptr<CommWork> StartAllReduceSum(void* data, size_t count, CommDType dtype) override {
    absl::Status args = comm_internal::CheckAllReduceArgs(data, count, dtype);
    if (!args.ok() || count == 0) return FinishedWork(args);
    return Enqueue("all-reduce", [&] {
      return ncclAllReduce(data, data, count, NcclType(dtype), ncclSum, comm_, stream_);
    });
  }

  std::unique_ptr<CommWork> StartAllGather(const void* in, void* out,
                                           size_t bytes_per_rank) override {
    absl::Status args =
        comm_internal::CheckAllGatherArgs(in, out, bytes_per_rank, rank_, world_size_);
    if (!args.ok() || bytes_per_rank == 0) return FinishedWork(args);
    return Enqueue("all-gather", [&] {
      return ncclAllGather(in, out, bytes_per_rank, ncclUint8, comm_, stream_);
    });
  }

  std::unique_ptr<CommWork> StartReduceScatterSum(const void* in, void* out, size_t count_per_rank,
                                                  CommDType dtype) override {
    absl::Status args =
        comm_internal::CheckReduceScatterArgs(in, out, count_per_rank, dtype, rank_, world_size_);
    if (!args.ok() || count_per_rank == 0) return FinishedWork(args);
    return Enqueue("reduce-scatter", [&] {
      return ncclReduceScatter(in, out, count_per_rank, NcclType(dtype), ncclSum, comm_, stream_);
    });
  }

  // Waits for `event` (a collective's end) within the timeout; on failure the communicator
  // is aborted and stays broken.
  absl::Status WaitFor(cudaEvent_t event, const std::string& what) {
    const absl::Time deadline = absl::Now() + timeout_;
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        if (!broken_.ok()) return Broken(what);
        cudaSetDevice(device_);
        const cudaError_t done = cudaEventQuery(event);
        if (done == cudaSuccess) return absl::OkStatus();
        absl::Status failed;
        if (done != cudaErrorNotReady) {
          failed = CudaStatus(done, what);
        } else {
          ncclResult_t state = ncclSuccess;
          ncclCommGetAsyncError(comm_, &state);
          if (state != ncclSuccess && state != ncclInProgress) {
            failed = NcclStatus(state, what);
          } else if (absl::Now() >= deadline) {
            failed = absl::DeadlineExceededError(absl::StrCat(
                what, ": peers did not take part within ", absl::FormatDuration(timeout_)));
          }
        }
        if (!failed.ok()) return Break(failed);
      }
      absl::SleepFor(kPollInterval);
    }
  }

 private:
  // Enqueues one collective on the stream, after the caller's stream's work so far (ready_,
  // recorded there, is waited for on ours), then an event after it.
  template <typename Fn>
  std::unique_ptr<CommWork> Enqueue(absl::string_view op, Fn&& fn) {
    const std::string what = absl::StrCat(op, " on rank ", rank_, " of ", world_size_);
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) return FinishedWork(Broken(what));
    cudaSetDevice(device_);
    absl::Status status = CudaStatus(cudaEventRecord(ready_, caller_stream_), what);
    if (status.ok()) status = CudaStatus(cudaStreamWaitEvent(stream_, ready_, 0), what);
    if (status.ok()) status = NcclStatus(fn(), what);
    if (status.ok()) status = AwaitComm(comm_, absl::Now() + timeout_, what);
    cudaEvent_t event = nullptr;
    if (status.ok()) {
      status = CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), what);
    }
    if (status.ok()) status = CudaStatus(cudaEventRecord(event, stream_), what);
    if (!status.ok()) {
      if (event != nullptr) cudaEventDestroy(event);
      return FinishedWork(Break(status));
    }
    return std::make_unique<NcclWork>(this, event, what);
  }

  absl::Status Break(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (broken_.ok()) {
      broken_ = status;
      ncclCommAbort(comm_);  // ends this rank's pending work; peers see the failure
      comm_ = nullptr;
    }
    return status;
  }

  absl::Status Broken(absl::string_view what) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return absl::AbortedError(
        absl::StrCat(what, ": the communicator broke earlier: ", broken_.message()));
  }

  absl::Mutex mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_);  // null once aborted
  cudaStream_t stream_;
  cudaEvent_t ready_;                 // reused: recorded and waited for under mu_
  const cudaStream_t caller_stream_;  // null: the legacy default stream
  const int device_;
  const int rank_;
  const int world_size_;
  const absl::Duration timeout_;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  void* barrier_ ABSL_GUARDED_BY(mu_) = nullptr;
};

NcclWork::~NcclWork() {
  if (!waited_) Wait().IgnoreError();
}

absl::Status NcclWork::Wait() {
  if (waited_) return absl::FailedPreconditionError(absl::StrCat(what_, ": waited twice"));
  waited_ = true;
  absl::Status status = comm_->WaitFor(event_, what_);
  cudaEventDestroy(event_);
  return status;
}

}  // namespace
#endif  // LATHE_WITH_NCCL

absl::StatusOr<std::unique_ptr<Communicator>> ConnectNccl(KvStore* store, int rank, int world_size,
                                                          const NcclOptions& options) {
  LATHE_RETURN_IF_ERROR(comm_internal::CheckConnectArgs("nccl", rank, world_size, options.timeout));
  if (store == nullptr) {
    return absl::InvalidArgumentError("nccl: connecting needs a rendezvous store");
  }
#ifdef LATHE_WITH_NCCL
  const std::string where = absl::StrCat("nccl connect, rank ", rank, " of ", world_size);
  int devices = 0;
  LATHE_RETURN_IF_ERROR(CudaStatus(cudaGetDeviceCount(&devices), where));
  if (options.device < 0 || options.device >= devices) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": CUDA device ", options.device,
                                                   " does not exist (", devices, " visible)"));
  }
  LATHE_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options.device), where));

  // Rank 0's unique id reaches every rank through the store.
  PrefixKvStore prefixed(store, options.key_prefix);
  ncclUniqueId id;
  if (rank == 0) {
    LATHE_RETURN_IF_ERROR(NcclStatus(ncclGetUniqueId(&id), where));
    LATHE_RETURN_IF_ERROR(Annotate(
        prefixed.Set("id", absl::string_view(reinterpret_cast<const char*>(&id), sizeof(id))),
        where));
  } else {
    absl::StatusOr<std::string> value = prefixed.Get("id", options.timeout);
    if (!value.ok()) return Annotate(value.status(), where);
    if (value->size() != sizeof(id)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the store's unique id has ",
                                                     value->size(), " bytes, not ", sizeof(id)));
    }
    std::memcpy(&id, value->data(), sizeof(id));
  }

  cudaStream_t stream = nullptr;
  LATHE_RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), where));
  cudaEvent_t ready = nullptr;
  if (absl::Status made =
          CudaStatus(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), where);
      !made.ok()) {
    cudaStreamDestroy(stream);
    return made;
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so that a peer that never comes cannot hang this rank
  ncclComm_t comm = nullptr;
  absl::Status status =
      NcclStatus(ncclCommInitRankConfig(&comm, world_size, id, rank, &config), where);
  if (status.ok()) status = AwaitComm(comm, absl::Now() + options.timeout, where);
  if (!status.ok()) {
    if (comm != nullptr) ncclCommAbort(comm);
    cudaEventDestroy(ready);
    cudaStreamDestroy(stream);
    return status;
  }
  return std::make_unique<NcclCommunicator>(comm, stream, ready,
                                            static_cast<cudaStream_t>(options.stream),
                                            options.device, rank, world_size, options.timeout);
#else
  return absl::FailedPreconditionError(absl::StrCat(
      "nccl: this build of Lathe has no NCCL (found with the CUDA toolkit), so a group of ",
      world_size, " cannot connect on CUDA"));
#endif
}

}  // namespace lathe
