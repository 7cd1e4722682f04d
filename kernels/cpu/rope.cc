#include "kernels/cpu/rope.h"

#include "kernels/cpu/vector_math.h"

namespace lathe::kernels::cpu {
namespace {

// One row: out = [a * c_lo - b * n_lo, b * c_hi + a * n_hi] with a, b the halves of `in`.
// The forward rotation has sign -1, its transpose (backward) uses the other table half.
template <typename T>
LATHE_KERNEL_INLINE void RotateRow(const T* __restrict in, const T* __restrict c,
                                   const T* __restrict n, int64_t half, bool transpose,
                                   T* __restrict out) {
  const T* __restrict a = in;
  const T* __restrict b = in + half;
  if (!transpose) {
    for (int64_t i = 0; i < half; ++i) {
      out[i] = Store<T>(Load(a[i]) * Load(c[i]) - Load(b[i]) * Load(n[i]));
      out[i + half] = Store<T>(Load(b[i]) * Load(c[i + half]) + Load(a[i]) * Load(n[i + half]));
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      out[i] = Store<T>(Load(a[i]) * Load(c[i]) + Load(b[i]) * Load(n[i + half]));
      out[i + half] = Store<T>(Load(b[i]) * Load(c[i + half]) - Load(a[i]) * Load(n[i]));
    }
  }
}

template <typename T>
LATHE_CPU_DISPATCH void Rope(const T* x, const T* cos, const T* sin, const RopeLayout& layout,
                             int64_t begin, int64_t end, bool transpose, T* y) {
  const int64_t dim = layout.head_dim;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t offset = layout.Offset(r);
    const int64_t table = layout.Position(r) * dim;
    RotateRow(x + offset, cos + table, sin + table, dim / 2, transpose, y + offset);
  }
}

}  // namespace

template <typename T>
void RopeForward(const T* x, const T* cos, const T* sin, const RopeLayout& layout, int64_t begin,
                 int64_t end, T* y) {
  Rope(x, cos, sin, layout, begin, end, /*transpose=*/false, y);
}

template <typename T>
void RopeBackward(const T* dy, const T* cos, const T* sin, const RopeLayout& layout, int64_t begin,
                  int64_t end, T* dx) {
  Rope(dy, cos, sin, layout, begin, end, /*transpose=*/true, dx);
}

#define LATHE_INSTANTIATE(T)                                                                       \
  template void RopeForward<T>(const T*, const T*, const T*, const RopeLayout&, int64_t, int64_t,  \
                               T*);                                                                \
  template void RopeBackward<T>(const T*, const T*, const T*, const RopeLayout&, int64_t, int64_t, \
                                T*);
LATHE_INSTANTIATE(float)
LATHE_INSTANTIATE(BFloat16)
LATHE_INSTANTIATE(Half)
#undef LATHE_INSTANTIATE

}  // namespace lathe::kernels::cpu
