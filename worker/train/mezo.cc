#include "worker/train/mezo.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <functional>
#include <mutex>

namespace lathe {
namespace {

// Calls `fn(param, z)` for each parameter with its direction, drawn in order.
void ForEachDirection(const std::vector<NamedParameter>& params, uint64_t seed,
                      const std::function<void(at::Tensor&, at::Tensor)>& fn) {
  at::NoGradGuard no_grad;
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>();
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_current_seed(seed);
  }
  for (const NamedParameter& p : params) {
    at::Tensor param = p.tensor;
    at::Tensor z = at::randn(p.tensor.sizes(), generator, at::TensorOptions().dtype(at::kFloat));
    fn(param, z.to(param.device()));
  }
}

}  // namespace

uint64_t MezoSeed(uint64_t seed, int64_t step) {
  return seed + static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull;
}

std::vector<NamedParameter> MezoOrder(std::vector<NamedParameter> params) {
  std::sort(params.begin(), params.end(),
            [](const NamedParameter& a, const NamedParameter& b) { return a.name < b.name; });
  return params;
}

void MezoPerturb(const std::vector<NamedParameter>& params, uint64_t seed, double scale) {
  ForEachDirection(params, seed,
                   [scale](at::Tensor& param, at::Tensor z) { param.add_(z, scale); });
}

void MezoUpdate(const std::vector<NamedParameter>& params, uint64_t seed, double projected,
                double lr, double weight_decay) {
  size_t i = 0;
  ForEachDirection(params, seed, [&](at::Tensor& param, at::Tensor z) {
    at::Tensor d = z.mul_(projected);
    if (params[i++].weight_decay && weight_decay != 0.0) d.add_(param, weight_decay);
    param.add_(d, -lr);
  });
}

}  // namespace lathe
