#include "worker/engine/peak_flops.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/flops.h"
#include "kernels/ops/matmul.h"

namespace lathe {
namespace {

double Measure() {
  constexpr int64_t kSize = 2048;
  constexpr int kRuns = 4;  // the first warms the threads and the caches up
  at::NoGradGuard no_grad;
  const at::Tensor a = at::rand({kSize, kSize}, at::kFloat);
  const at::Tensor b = at::rand({kSize, kSize}, at::kFloat);
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

double MeasureCpuMatmulFlops() {
  static absl::Mutex mu(absl::kConstInit);
  static auto* measured ABSL_GUARDED_BY(mu) = new std::map<int, double>();
  absl::MutexLock lock(&mu);
  double& peak = (*measured)[at::get_num_threads()];
  if (peak <= 0) peak = Measure();
  return peak;
}

double PeakFlopsFor(const at::Device& device, Precision precision, double configured) {
  if (configured > 0) return configured;
  if (device.is_cuda()) {
    return CudaPeakFlops(CudaDeviceName(device.has_index() ? device.index() : 0), precision)
        .value_or(0.0);
  }
  return MeasureCpuMatmulFlops();
}

}  // namespace lathe
