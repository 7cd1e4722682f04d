// Helpers shared by the ops/ wrappers (not a public header): the kernel element type of a
// tensor's dtype, typed data pointers, row grains for at::parallel_for, and the CUDA stream.
#ifndef LATHE_KERNELS_OPS_KERNEL_DISPATCH_H_
#define LATHE_KERNELS_OPS_KERNEL_DISPATCH_H_

#include <algorithm>
#include <cstdint>

#include "kernels/float16.h"
#include "kernels/ops/torch_compat.h"

#ifdef LATHE_TORCH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace lathe::kernels {

// Calls f(T{}) with T the kernel element type of `type` (float, kernels::BFloat16 or
// kernels::Half); other dtypes are an error naming `op`.
template <typename F>
void DispatchKernelType(at::ScalarType type, const char* op, F&& f) {
  switch (type) {
    case at::kFloat:
      f(float{});
      return;
    case at::kBFloat16:
      f(kernels::BFloat16{});
      return;
    case at::kHalf:
      f(kernels::Half{});
      return;
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", type, " (float32, bfloat16 or float16)");
  }
}

// The data of `t` as kernel element type T. REQUIRES: t's dtype is T's.
template <typename T>
const T* Data(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}
template <typename T>
T* MutableData(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// Rows per at::parallel_for task: at least ~16K elements each, so that small tensors stay on
// the calling thread.
inline int64_t RowGrain(int64_t cols) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1));
}

#ifdef LATHE_TORCH_CUDA
// libtorch's current stream on `device`. Callers hold a c10::cuda::CUDAGuard for `device`
// while they launch, so that the kernel runs on the tensors' GPU.
inline cudaStream_t CurrentStream(const at::Device& device) {
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}
#endif

}  // namespace lathe::kernels

#endif  // LATHE_KERNELS_OPS_KERNEL_DISPATCH_H_
