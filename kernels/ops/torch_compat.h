// The one place that includes libtorch for the engine: pip's torch 2.11 (CUDA 13 build) on
// every machine, CPU-only ones included. Engine code includes this header instead of
// <torch/torch.h> (which costs ~30 s per file); what needs libtorch's CUDA API (only present
// with LATHE_TORCH_CUDA) is behind a helper here.
//
// It lives in kernels/ops, the lowest floor that includes libtorch, so that kernels/ops and
// worker/engine both include it downwards. It is also their precompiled header.
#ifndef LATHE_KERNELS_OPS_TORCH_COMPAT_H_
#define LATHE_KERNELS_OPS_TORCH_COMPAT_H_

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/generated/variable_factories.h>
#include <torch/version.h>

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"

namespace lathe {

// Converts a libtorch exception into a status at the engine boundary: INTERNAL with the
// first line of the message and `context` prepended (RESOURCE_EXHAUSTED for allocation
// failures, so callers can tell "does not fit").
absl::Status StatusFromTorchError(const c10::Error& error, absl::string_view context);

// Bytes that libtorch's CUDA caching allocator has handed out on `device` (not its cached
// reserve): now, and at most since the last ResetCudaPeak. nullopt when this libtorch was
// built without CUDA (LATHE_TORCH_CUDA unset).
struct CudaMemory {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
};
std::optional<CudaMemory> CudaMemoryOf(int device);
void ResetCudaPeak(int device);
// The CUDA device's name ("NVIDIA H100 80GB HBM3"); empty without CUDA.
std::string CudaDeviceName(int device);
// The CUDA device's total memory in bytes; 0 without CUDA.
uint64_t CudaTotalMemory(int device);
// Waits until the work enqueued so far on `device`'s current stream has finished (a
// libtorch CUDA device; nothing on the CPU).
void SynchronizeStream(const at::Device& device);

}  // namespace lathe

#endif  // LATHE_KERNELS_OPS_TORCH_COMPAT_H_
