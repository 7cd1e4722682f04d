#include "kernels/cpu/rms_norm.h"

#include <cmath>

#include "kernels/cpu/vector_math.h"

namespace lathe::kernels::cpu {

template <typename T>
LATHE_CPU_DISPATCH void RmsNormForward(const T* x, const float* weight, int64_t hidden, float eps,
                                       int64_t begin, int64_t end, T* y, float* rstd) {
  const float* __restrict w = weight;
  for (int64_t r = begin; r < end; ++r) {
    const T* __restrict in = x + r * hidden;
    T* __restrict out = y + r * hidden;
    const float s = 1.0f / std::sqrt(Dot(in, in, hidden) / static_cast<float>(hidden) + eps);
    for (int64_t j = 0; j < hidden; ++j) out[j] = Store<T>(Load(in[j]) * s * w[j]);
    rstd[r] = s;
  }
}

template <typename T>
LATHE_CPU_DISPATCH void RmsNormBackward(const T* dy, const T* x, const float* weight,
                                        const float* rstd, int64_t hidden, int64_t begin,
                                        int64_t end, T* dx, float* dweight) {
  const float* __restrict w = weight;
  for (int64_t r = begin; r < end; ++r) {
    const T* __restrict g = dy + r * hidden;
    const T* __restrict in = x + r * hidden;
    T* __restrict out = dx + r * hidden;
    const float s = rstd[r];
    // d/dx of x * s(x): s * g w - x * s^3 * mean(g w x).
    const float c = s * s * s * Dot3(g, w, in, hidden) / static_cast<float>(hidden);
    for (int64_t j = 0; j < hidden; ++j) {
      out[j] = Store<T>(s * Load(g[j]) * w[j] - c * Load(in[j]));
    }
  }
  if (dweight == nullptr) return;
  float* __restrict dw = dweight;
  for (int64_t j = 0; j < hidden; ++j) dw[j] = 0.0f;
  for (int64_t r = begin; r < end; ++r) {
    const T* __restrict g = dy + r * hidden;
    const T* __restrict in = x + r * hidden;
    const float s = rstd[r];
    for (int64_t j = 0; j < hidden; ++j) dw[j] += Load(g[j]) * Load(in[j]) * s;
  }
}

#define LATHE_INSTANTIATE(T)                                                                    \
  template void RmsNormForward<T>(const T*, const float*, int64_t, float, int64_t, int64_t, T*, \
                                  float*);                                                      \
  template void RmsNormBackward<T>(const T*, const T*, const float*, const float*, int64_t,     \
                                   int64_t, int64_t, T*, float*);
LATHE_INSTANTIATE(float)
LATHE_INSTANTIATE(BFloat16)
LATHE_INSTANTIATE(Half)
#undef LATHE_INSTANTIATE

}  // namespace lathe::kernels::cpu
