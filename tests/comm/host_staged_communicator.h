// Lets the Communicator contract suite, written over host buffers, run against NCCL, whose
// buffers live on a GPU: each call copies its host buffers to fresh device buffers, runs the
// device communicator's call on them, and copies the results back. Local argument checks
// happen on the host pointers first, as every backend makes them.
#ifndef LATHE_TESTS_COMM_HOST_STAGED_COMMUNICATOR_H_
#define LATHE_TESTS_COMM_HOST_STAGED_COMMUNICATOR_H_

#include <cuda_runtime_api.h>

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/comm/communicator.h"

namespace lathe::testing {

class HostStagedCommunicator final : public Communicator {
 public:
  HostStagedCommunicator(std::unique_ptr<Communicator> device, int cuda_device)
      : device_(std::move(device)), cuda_device_(cuda_device) {}

  int rank() const override { return device_->rank(); }
  int world_size() const override { return device_->world_size(); }

  absl::Status AllReduceSum(void* data, size_t count, CommDType dtype) override {
    LATHE_RETURN_IF_ERROR(comm_internal::CheckAllReduceArgs(data, count, dtype));
    if (count == 0) return absl::OkStatus();
    const size_t bytes = count * CommDTypeSize(dtype);
    DeviceBuffer buffer(bytes, cuda_device_);
    LATHE_RETURN_IF_ERROR(buffer.From(data, bytes));
    LATHE_RETURN_IF_ERROR(device_->AllReduceSum(buffer.get(), count, dtype));
    return buffer.To(data, bytes);
  }

  absl::Status Broadcast(void* data, size_t bytes, int root) override {
    LATHE_RETURN_IF_ERROR(comm_internal::CheckBroadcastArgs(data, bytes, root, world_size()));
    if (bytes == 0) return absl::OkStatus();
    DeviceBuffer buffer(bytes, cuda_device_);
    LATHE_RETURN_IF_ERROR(buffer.From(data, bytes));
    LATHE_RETURN_IF_ERROR(device_->Broadcast(buffer.get(), bytes, root));
    return buffer.To(data, bytes);
  }

  absl::Status AllGather(const void* in, void* out, size_t bytes_per_rank) override {
    LATHE_RETURN_IF_ERROR(
        comm_internal::CheckAllGatherArgs(in, out, bytes_per_rank, rank(), world_size()));
    if (bytes_per_rank == 0) return absl::OkStatus();
    const size_t total = bytes_per_rank * static_cast<size_t>(world_size());
    DeviceBuffer part(bytes_per_rank, cuda_device_), whole(total, cuda_device_);
    LATHE_RETURN_IF_ERROR(part.From(in, bytes_per_rank));
    LATHE_RETURN_IF_ERROR(device_->AllGather(part.get(), whole.get(), bytes_per_rank));
    return whole.To(out, total);
  }

  absl::Status ReduceScatterSum(const void* in, void* out, size_t count_per_rank,
                                CommDType dtype) override {
    LATHE_RETURN_IF_ERROR(comm_internal::CheckReduceScatterArgs(in, out, count_per_rank, dtype,
                                                                rank(), world_size()));
    if (count_per_rank == 0) return absl::OkStatus();
    const size_t block = count_per_rank * CommDTypeSize(dtype);
    const size_t total = block * static_cast<size_t>(world_size());
    DeviceBuffer whole(total, cuda_device_), part(block, cuda_device_);
    LATHE_RETURN_IF_ERROR(whole.From(in, total));
    LATHE_RETURN_IF_ERROR(
        device_->ReduceScatterSum(whole.get(), part.get(), count_per_rank, dtype));
    return part.To(out, block);
  }

  absl::Status Barrier() override { return device_->Barrier(); }

 private:
  class DeviceBuffer {
   public:
    DeviceBuffer(size_t bytes, int device) {
      cudaSetDevice(device);
      if (cudaMalloc(&data_, bytes) != cudaSuccess) data_ = nullptr;
    }
    ~DeviceBuffer() { cudaFree(data_); }
    void* get() const { return data_; }
    absl::Status From(const void* host, size_t bytes) {
      return Copy(data_, host, bytes, cudaMemcpyHostToDevice);
    }
    absl::Status To(void* host, size_t bytes) const {
      return Copy(host, data_, bytes, cudaMemcpyDeviceToHost);
    }

   private:
    static absl::Status Copy(void* to, const void* from, size_t bytes, cudaMemcpyKind kind) {
      if (to == nullptr || from == nullptr) return absl::InternalError("cudaMalloc failed");
      const cudaError_t error = cudaMemcpy(to, from, bytes, kind);
      if (error == cudaSuccess) return absl::OkStatus();
      return absl::InternalError(absl::StrCat("cudaMemcpy: ", cudaGetErrorString(error)));
    }
    void* data_ = nullptr;
  };

  const std::unique_ptr<Communicator> device_;
  const int cuda_device_;
};

}  // namespace lathe::testing

#endif  // LATHE_TESTS_COMM_HOST_STAGED_COMMUNICATOR_H_
