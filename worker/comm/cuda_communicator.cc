#include "worker/comm/cuda_communicator.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

#ifdef LATHE_WITH_CUDART
#include <cuda_runtime_api.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#endif

namespace lathe {

#ifdef LATHE_WITH_CUDART
namespace {

absl::Status Cuda(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat(what, ": CUDA error ", cudaGetErrorName(error), ": ",
                                         cudaGetErrorString(error)));
}

cudaStream_t StreamOf(const CudaCommOptions& options) {
  return static_cast<cudaStream_t>(options.stream);
}

class CudaSingleRankCommunicator final : public Communicator {
 public:
  explicit CudaSingleRankCommunicator(const CudaCommOptions& options) : options_(options) {}

  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  CommMemory memory() const override { return CommMemory::kCuda; }

  absl::Status AllReduceSum(void* data, size_t count, CommDType dtype) override {
    return comm_internal::CheckAllReduceArgs(data, count, dtype);
  }

  absl::Status Broadcast(void* data, size_t bytes, int root) override {
    return comm_internal::CheckBroadcastArgs(data, bytes, root, 1);
  }

  absl::Status AllGather(const void* in, void* out, size_t bytes_per_rank) override {
    LATHE_RETURN_IF_ERROR(comm_internal::CheckAllGatherArgs(in, out, bytes_per_rank, 0, 1));
    return Copy(out, in, bytes_per_rank, "all-gather");
  }

  absl::Status ReduceScatterSum(const void* in, void* out, size_t count_per_rank,
                                CommDType dtype) override {
    LATHE_RETURN_IF_ERROR(
        comm_internal::CheckReduceScatterArgs(in, out, count_per_rank, dtype, 0, 1));
    return Copy(out, in, count_per_rank * CommDTypeSize(dtype), "reduce-scatter");
  }

  absl::Status Barrier() override { return absl::OkStatus(); }

 private:
  // On the caller's stream: ordered after what wrote `in`, before what reads `out`.
  absl::Status Copy(void* out, const void* in, size_t bytes, absl::string_view what) {
    if (bytes == 0 || in == out) return absl::OkStatus();
    LATHE_RETURN_IF_ERROR(Cuda(cudaSetDevice(options_.device), what));
    return Cuda(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, StreamOf(options_)),
                what);
  }

  const CudaCommOptions options_;
};

// Pinned host memory that grows to the largest call's size.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { cudaFreeHost(data_); }

  absl::StatusOr<char*> Get(size_t bytes, absl::string_view what) {
    if (bytes > size_) {
      cudaFreeHost(data_);
      data_ = nullptr;
      size_ = 0;
      void* data = nullptr;
      LATHE_RETURN_IF_ERROR(Cuda(cudaHostAlloc(&data, bytes, cudaHostAllocDefault),
                                 absl::StrCat(what, ": pinning ", bytes, " bytes")));
      data_ = static_cast<char*>(data);
      size_ = bytes;
    }
    return data_;
  }

 private:
  char* data_ = nullptr;
  size_t size_ = 0;
};

class CudaStagedCommunicator final : public Communicator {
 public:
  CudaStagedCommunicator(std::unique_ptr<Communicator> host, const CudaCommOptions& options)
      : host_(std::move(host)), options_(options) {}

  int rank() const override { return host_->rank(); }
  int world_size() const override { return host_->world_size(); }
  CommMemory memory() const override { return CommMemory::kCuda; }

  absl::Status AllReduceSum(void* data, size_t count, CommDType dtype) override {
    LATHE_RETURN_IF_ERROR(comm_internal::CheckAllReduceArgs(data, count, dtype));
    if (count == 0) return absl::OkStatus();
    const size_t bytes = count * CommDTypeSize(dtype);
    absl::MutexLock lock(&mu_);
    LATHE_ASSIGN_OR_RETURN(char* in, ToHost(in_, data, bytes, "all-reduce"));
    LATHE_RETURN_IF_ERROR(host_->AllReduceSum(in, count, dtype));
    return ToDevice(data, in, bytes, "all-reduce");
  }

  absl::Status Broadcast(void* data, size_t bytes, int root) override {
    LATHE_RETURN_IF_ERROR(comm_internal::CheckBroadcastArgs(data, bytes, root, world_size()));
    if (bytes == 0) return absl::OkStatus();
    absl::MutexLock lock(&mu_);
    LATHE_ASSIGN_OR_RETURN(char* in, ToHost(in_, data, bytes, "broadcast"));
    LATHE_RETURN_IF_ERROR(host_->Broadcast(in, bytes, root));
    return ToDevice(data, in, bytes, "broadcast");
  }

  absl::Status AllGather(const void* in, void* out, size_t bytes_per_rank) override {
    LATHE_RETURN_IF_ERROR(
        comm_internal::CheckAllGatherArgs(in, out, bytes_per_rank, rank(), world_size()));
    if (bytes_per_rank == 0) return absl::OkStatus();
    const size_t total = bytes_per_rank * static_cast<size_t>(world_size());
    absl::MutexLock lock(&mu_);
    LATHE_ASSIGN_OR_RETURN(char* whole, out_.Get(total, "all-gather"));
    char* mine = whole + static_cast<size_t>(rank()) * bytes_per_rank;
    LATHE_RETURN_IF_ERROR(Download(mine, in, bytes_per_rank, "all-gather"));
    LATHE_RETURN_IF_ERROR(host_->AllGather(mine, whole, bytes_per_rank));
    return ToDevice(out, whole, total, "all-gather");
  }

  absl::Status ReduceScatterSum(const void* in, void* out, size_t count_per_rank,
                                CommDType dtype) override {
    LATHE_RETURN_IF_ERROR(comm_internal::CheckReduceScatterArgs(in, out, count_per_rank, dtype,
                                                                rank(), world_size()));
    if (count_per_rank == 0) return absl::OkStatus();
    const size_t block = count_per_rank * CommDTypeSize(dtype);
    const size_t total = block * static_cast<size_t>(world_size());
    absl::MutexLock lock(&mu_);
    LATHE_ASSIGN_OR_RETURN(char* whole, ToHost(in_, in, total, "reduce-scatter"));
    LATHE_ASSIGN_OR_RETURN(char* part, out_.Get(block, "reduce-scatter"));
    LATHE_RETURN_IF_ERROR(host_->ReduceScatterSum(whole, part, count_per_rank, dtype));
    return ToDevice(out, part, block, "reduce-scatter");
  }

  absl::Status Barrier() override { return host_->Barrier(); }

  // The Start* forms run the call at once (communicator.h allows it): the staging waits for
  // the stream anyway.
  std::unique_ptr<CommWork> StartAllReduceSum(void* data, size_t count, CommDType dtype) override {
    return FinishedWork(AllReduceSum(data, count, dtype));
  }
  std::unique_ptr<CommWork> StartAllGather(const void* in, void* out,
                                           size_t bytes_per_rank) override {
    return FinishedWork(AllGather(in, out, bytes_per_rank));
  }
  std::unique_ptr<CommWork> StartReduceScatterSum(const void* in, void* out, size_t count_per_rank,
                                                  CommDType dtype) override {
    return FinishedWork(ReduceScatterSum(in, out, count_per_rank, dtype));
  }

 private:
  // Copies `bytes` of device memory into `to` (pinned), after the stream's work so far.
  absl::Status Download(char* to, const void* device, size_t bytes, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    LATHE_RETURN_IF_ERROR(Cuda(cudaSetDevice(options_.device), what));
    LATHE_RETURN_IF_ERROR(
        Cuda(cudaMemcpyAsync(to, device, bytes, cudaMemcpyDeviceToHost, StreamOf(options_)),
             absl::StrCat(what, ": copying to the host")));
    return Cuda(cudaStreamSynchronize(StreamOf(options_)), what);
  }

  absl::StatusOr<char*> ToHost(PinnedBuffer& buffer, const void* device, size_t bytes,
                               absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    LATHE_ASSIGN_OR_RETURN(char* host, buffer.Get(bytes, what));
    LATHE_RETURN_IF_ERROR(Download(host, device, bytes, what));
    return host;
  }

  // Copies the host result back and waits for it, so that the pinned buffer may be reused.
  absl::Status ToDevice(void* device, const char* host, size_t bytes, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    LATHE_RETURN_IF_ERROR(
        Cuda(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, StreamOf(options_)),
             absl::StrCat(what, ": copying to the device")));
    return Cuda(cudaStreamSynchronize(StreamOf(options_)), what);
  }

  const std::unique_ptr<Communicator> host_;
  const CudaCommOptions options_;
  absl::Mutex mu_;
  PinnedBuffer in_ ABSL_GUARDED_BY(mu_);
  PinnedBuffer out_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeCudaSingleRankCommunicator(
    const CudaCommOptions& options) {
  int devices = 0;
  LATHE_RETURN_IF_ERROR(Cuda(cudaGetDeviceCount(&devices), "cuda communicator"));
  if (options.device < 0 || options.device >= devices) {
    return absl::InvalidArgumentError(absl::StrCat("cuda communicator: CUDA device ",
                                                   options.device, " does not exist (", devices,
                                                   " visible)"));
  }
  return std::make_unique<CudaSingleRankCommunicator>(options);
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeCudaStagedCommunicator(
    std::unique_ptr<Communicator> host, const CudaCommOptions& options) {
  if (host == nullptr || host->memory() != CommMemory::kHost) {
    return absl::InvalidArgumentError(
        "cuda staged communicator: needs a communicator of host memory to stage through");
  }
  LATHE_RETURN_IF_ERROR(MakeCudaSingleRankCommunicator(options).status());  // the device check
  return std::make_unique<CudaStagedCommunicator>(std::move(host), options);
}

#else  // !LATHE_WITH_CUDART

absl::StatusOr<std::unique_ptr<Communicator>> MakeCudaSingleRankCommunicator(
    const CudaCommOptions&) {
  return absl::FailedPreconditionError(
      "cuda communicator: this build of Lathe has no CUDA runtime (the CUDA toolkit was not "
      "found)");
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeCudaStagedCommunicator(
    std::unique_ptr<Communicator>, const CudaCommOptions& options) {
  return MakeCudaSingleRankCommunicator(options).status();
}

#endif  // LATHE_WITH_CUDART

}  // namespace lathe
