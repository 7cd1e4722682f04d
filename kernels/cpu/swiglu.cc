#include "kernels/cpu/swiglu.h"

#include "kernels/cpu/vector_math.h"

namespace lathe::kernels::cpu {

template <typename T>
LATHE_CPU_DISPATCH void SwiGluForward(const T* gate, const T* up, int64_t cols, int64_t begin,
                                      int64_t end, T* y) {
  const T* __restrict g = gate + begin * cols;
  const T* __restrict u = up + begin * cols;
  T* __restrict out = y + begin * cols;
  const int64_t n = (end - begin) * cols;
  for (int64_t i = 0; i < n; ++i) {
    const float a = Load(g[i]);
    out[i] = Store<T>(a * Sigmoid(a) * Load(u[i]));
  }
}

template <typename T>
LATHE_CPU_DISPATCH void SwiGluBackward(const T* dy, const T* gate, const T* up, int64_t cols,
                                       int64_t begin, int64_t end, T* dgate, T* dup) {
  const T* __restrict d = dy + begin * cols;
  const T* __restrict g = gate + begin * cols;
  const T* __restrict u = up + begin * cols;
  T* __restrict dg = dgate + begin * cols;
  T* __restrict du = dup + begin * cols;
  const int64_t n = (end - begin) * cols;
  for (int64_t i = 0; i < n; ++i) {
    const float a = Load(g[i]);
    const float s = Sigmoid(a);
    const float grad = Load(d[i]);
    dg[i] = Store<T>(grad * Load(u[i]) * s * (1.0f + a * (1.0f - s)));
    du[i] = Store<T>(grad * a * s);
  }
}

#define LATHE_INSTANTIATE(T)                                                         \
  template void SwiGluForward<T>(const T*, const T*, int64_t, int64_t, int64_t, T*); \
  template void SwiGluBackward<T>(const T*, const T*, const T*, int64_t, int64_t, int64_t, T*, T*);
LATHE_INSTANTIATE(float)
LATHE_INSTANTIATE(BFloat16)
LATHE_INSTANTIATE(Half)
#undef LATHE_INSTANTIATE

}  // namespace lathe::kernels::cpu
