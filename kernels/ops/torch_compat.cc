#include "kernels/ops/torch_compat.h"

#if LATHE_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "absl/strings/str_cat.h"

namespace lathe {

absl::Status StatusFromTorchError(const c10::Error& error, absl::string_view context) {
  std::string message = error.what_without_backtrace();
  if (size_t newline = message.find('\n'); newline != std::string::npos) message.resize(newline);
  bool out_of_memory = message.find("out of memory") != std::string::npos ||
                       message.find("DefaultCPUAllocator: can't allocate") != std::string::npos;
  std::string text = absl::StrCat(context, ": ", message);
  return out_of_memory ? absl::ResourceExhaustedError(text) : absl::InternalError(text);
}

#if LATHE_TORCH_CUDA
// torch 2.x's statistics live in c10's device-generic CachingDeviceAllocator::DeviceStats,
// indexed by c10::CachingAllocator::StatType.
std::optional<CudaMemory> CudaMemoryOf(int device) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  const auto& bytes =
      stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  return CudaMemory{bytes.current, bytes.peak};
}

void ResetCudaPeak(int device) { c10::cuda::CUDACachingAllocator::resetPeakStats(device); }

std::string CudaDeviceName(int device) { return at::cuda::getDeviceProperties(device)->name; }

uint64_t CudaTotalMemory(int device) {
  return at::cuda::getDeviceProperties(device)->totalGlobalMem;
}

void SynchronizeStream(const at::Device& device) {
  if (device.is_cuda()) at::cuda::getCurrentCUDAStream(device.index()).synchronize();
}
#else
void SynchronizeStream(const at::Device&) {}
std::optional<CudaMemory> CudaMemoryOf(int) { return std::nullopt; }
void ResetCudaPeak(int) {}
std::string CudaDeviceName(int) { return ""; }
uint64_t CudaTotalMemory(int) { return 0; }
#endif

}  // namespace lathe
