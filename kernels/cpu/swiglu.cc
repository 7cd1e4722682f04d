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

namespace {

constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

}  // namespace

template <typename T>
LATHE_CPU_DISPATCH void GeGluForward(const T* gate, const T* up, int64_t cols, int64_t begin,
                                     int64_t end, T* y) {
  const T* __restrict g = gate + begin * cols;
  const T* __restrict u = up + begin * cols;
  T* __restrict out = y + begin * cols;
  const int64_t n = (end - begin) * cols;
  for (int64_t i = 0; i < n; ++i) {
    const float a = Load(g[i]);
    const float s = Sigmoid(2.0f * kGeluBeta * (a + kGeluKappa * a * a * a));
    out[i] = Store<T>(a * s * Load(u[i]));
  }
}

template <typename T>
LATHE_CPU_DISPATCH void GeGluBackward(const T* dy, const T* gate, const T* up, int64_t cols,
                                      int64_t begin, int64_t end, T* dgate, T* dup) {
  const T* __restrict d = dy + begin * cols;
  const T* __restrict g = gate + begin * cols;
  const T* __restrict u = up + begin * cols;
  T* __restrict dg = dgate + begin * cols;
  T* __restrict du = dup + begin * cols;
  const int64_t n = (end - begin) * cols;
  for (int64_t i = 0; i < n; ++i) {
    const float a = Load(g[i]);
    const float a2 = a * a;
    const float s = Sigmoid(2.0f * kGeluBeta * (a + kGeluKappa * a2 * a));
    const float slope = s + 2.0f * a * s * (1.0f - s) * kGeluBeta * (1.0f + 3.0f * kGeluKappa * a2);
    const float grad = Load(d[i]);
    dg[i] = Store<T>(grad * Load(u[i]) * slope);
    du[i] = Store<T>(grad * a * s);
  }
}

#define LATHE_INSTANTIATE(T)                                                                   \
  template void SwiGluForward<T>(const T*, const T*, int64_t, int64_t, int64_t, T*);           \
  template void SwiGluBackward<T>(const T*, const T*, const T*, int64_t, int64_t, int64_t, T*, \
                                  T*);                                                         \
  template void GeGluForward<T>(const T*, const T*, int64_t, int64_t, int64_t, T*);            \
  template void GeGluBackward<T>(const T*, const T*, const T*, int64_t, int64_t, int64_t, T*, T*);
LATHE_INSTANTIATE(float)
LATHE_INSTANTIATE(BFloat16)
LATHE_INSTANTIATE(Half)
#undef LATHE_INSTANTIATE

}  // namespace lathe::kernels::cpu
