#include "kernels/cpu/swiglu.h"

#include "kernels/cpu/vector_math.h"

namespace lathe::kernels::cpu {

namespace {

constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

// The gate's activations, z(a) = a * s(a): S gives s(a); GateGrad gives gu * z'(a), where gu
// is the incoming gradient times up.
struct Silu {
  static LATHE_KERNEL_INLINE float S(float a) { return Sigmoid(a); }
  static LATHE_KERNEL_INLINE float GateGrad(float gu, float a, float s) {
    return gu * s * (1.0f + a * (1.0f - s));
  }
};
struct GeluTanh {  // transformers' gelu_pytorch_tanh
  static LATHE_KERNEL_INLINE float S(float a) {
    return Sigmoid(2.0f * kGeluBeta * (a + kGeluKappa * a * a * a));
  }
  static LATHE_KERNEL_INLINE float GateGrad(float gu, float a, float s) {
    const float a2 = a * a;
    return gu * (s + 2.0f * a * s * (1.0f - s) * kGeluBeta * (1.0f + 3.0f * kGeluKappa * a2));
  }
};

// y = z(gate) * up over rows [begin, end); inlined into each dispatched kernel.
template <typename Act, typename T>
LATHE_KERNEL_INLINE void GluForward(const T* gate, const T* up, int64_t cols, int64_t begin,
                                    int64_t end, T* y) {
  const T* __restrict g = gate + begin * cols;
  const T* __restrict u = up + begin * cols;
  T* __restrict out = y + begin * cols;
  const int64_t n = (end - begin) * cols;
  for (int64_t i = 0; i < n; ++i) {
    const float a = Load(g[i]);
    out[i] = Store<T>(a * Act::S(a) * Load(u[i]));
  }
}

// dgate = dy * up * z'(gate), dup = dy * z(gate) over rows [begin, end).
template <typename Act, typename T>
LATHE_KERNEL_INLINE void GluBackward(const T* dy, const T* gate, const T* up, int64_t cols,
                                     int64_t begin, int64_t end, T* dgate, T* dup) {
  const T* __restrict d = dy + begin * cols;
  const T* __restrict g = gate + begin * cols;
  const T* __restrict u = up + begin * cols;
  T* __restrict dg = dgate + begin * cols;
  T* __restrict du = dup + begin * cols;
  const int64_t n = (end - begin) * cols;
  for (int64_t i = 0; i < n; ++i) {
    const float a = Load(g[i]);
    const float s = Act::S(a);
    const float grad = Load(d[i]);
    dg[i] = Store<T>(Act::GateGrad(grad * Load(u[i]), a, s));
    du[i] = Store<T>(grad * a * s);
  }
}

}  // namespace

template <typename T>
LATHE_CPU_DISPATCH void SwiGluForward(const T* gate, const T* up, int64_t cols, int64_t begin,
                                      int64_t end, T* y) {
  GluForward<Silu>(gate, up, cols, begin, end, y);
}

template <typename T>
LATHE_CPU_DISPATCH void SwiGluBackward(const T* dy, const T* gate, const T* up, int64_t cols,
                                       int64_t begin, int64_t end, T* dgate, T* dup) {
  GluBackward<Silu>(dy, gate, up, cols, begin, end, dgate, dup);
}

template <typename T>
LATHE_CPU_DISPATCH void GeGluForward(const T* gate, const T* up, int64_t cols, int64_t begin,
                                     int64_t end, T* y) {
  GluForward<GeluTanh>(gate, up, cols, begin, end, y);
}

template <typename T>
LATHE_CPU_DISPATCH void GeGluBackward(const T* dy, const T* gate, const T* up, int64_t cols,
                                      int64_t begin, int64_t end, T* dgate, T* dup) {
  GluBackward<GeluTanh>(dy, gate, up, cols, begin, end, dgate, dup);
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
