#include "kernels/ops/dropout.h"

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

#include "kernels/cpu/dropout.h"
#include "kernels/ops/kernel_dispatch.h"

#ifdef LATHE_TORCH_CUDA
#include "kernels/cuda/dropout.h"
#endif

namespace lathe::kernels {

at::Tensor ApplyDropoutMask(const at::Tensor& x, double p, uint64_t seed) {
  TORCH_CHECK(p >= 0 && p < 1, "dropout probability ", p, " is not in [0, 1)");
  const at::Tensor in = x.contiguous();
  const int64_t cols = in.dim() == 0 ? 1 : in.size(-1);
  const int64_t rows = cols == 0 ? 0 : in.numel() / cols;
  at::Tensor out = at::empty_like(in);
  DispatchKernelType(in.scalar_type(), "ApplyDropoutMask", [&](auto tag) {
    using T = decltype(tag);
#ifdef LATHE_TORCH_CUDA
    if (in.is_cuda()) {
      const c10::cuda::CUDAGuard device_guard(in.device());
      C10_CUDA_CHECK(kernels::cuda::Dropout(Data<T>(in), seed, p, rows, cols, MutableData<T>(out),
                                            CurrentStream(in.device())));
      return;
    }
#endif
    at::parallel_for(0, rows, RowGrain(cols), [&](int64_t begin, int64_t end) {
      kernels::cpu::Dropout(Data<T>(in), seed, p, cols, begin, end, MutableData<T>(out));
    });
  });
  return out;
}

uint64_t DrawDropoutSeed(std::optional<at::Generator> generator) {
  at::Generator gen = generator.has_value() ? *generator : at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
}

}  // namespace lathe::kernels
