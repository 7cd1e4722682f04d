#include "worker/engine/peak_flops.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/flops.h"
#include "kernels/ops/matmul.h"

namespace lathe {
namespace {

constexpr int64_t kSize = 2048;

double Measure(bool bf16) {
  constexpr int kRuns = 4;  // the first warms the threads and the caches up
  at::NoGradGuard no_grad;
  const at::ScalarType type = bf16 ? at::kBFloat16 : at::kFloat;
  const at::Tensor a = at::rand({kSize, kSize}, at::kFloat).to(type);
  const at::Tensor b = at::rand({kSize, kSize}, at::kFloat).to(type);
  at::Tensor c = at::empty({kSize, kSize}, at::kFloat);
  double best = 0.0;
  for (int run = 0; run < kRuns; ++run) {
    const auto start = std::chrono::steady_clock::now();
    kernels::MatmulOut(c, a, b);  // the engine's own products (oneDNN)
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (run > 0 && seconds > 0) best = std::max(best, 2.0 * kSize * kSize * kSize / seconds);
  }
  return best;
}

}  // namespace

double MeasureCpuMatmulFlops(bool bf16) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* measured ABSL_GUARDED_BY(mu) = new std::map<std::pair<int, bool>, double>();
  absl::MutexLock lock(&mu);
  double& peak = (*measured)[{at::get_num_threads(), bf16}];
  if (peak <= 0) peak = Measure(bf16);
  return peak;
}

double PeakFlopsFor(const at::Device& device, Precision precision, double configured) {
  if (configured > 0) return configured;
  if (device.is_cuda()) {
    return CudaPeakFlops(CudaDeviceName(device.has_index() ? device.index() : 0), precision)
        .value_or(0.0);
  }
  // bf16 jobs multiply bf16 natively where the CPU can (kernels/ops/matmul.h): their peak is
  // that product's.
  return MeasureCpuMatmulFlops(precision == Precision::kBf16 &&
                               kernels::NativeBFloat16Product(kSize, kSize, kSize));
}

}  // namespace lathe
