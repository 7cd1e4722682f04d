#include "kernels/cpu/dropout.h"

#include "kernels/cpu/vector_math.h"
#include "kernels/dropout_mask.h"

namespace lathe::kernels::cpu {

template <typename T>
LATHE_CPU_DISPATCH void Dropout(const T* x, uint64_t seed, double p, int64_t cols, int64_t begin,
                                int64_t end, T* y) {
  const uint32_t threshold = DropoutThreshold(p);
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  for (int64_t r = begin; r < end; ++r) {
    const uint64_t key = DropoutRowKey(seed, r);
    const T* in = x + r * cols;
    T* out = y + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      out[c] = Store<T>(Load(in[c]) * Select(DropoutKeep(key, c, threshold), scale, 0.0f));
    }
  }
}

template void Dropout<float>(const float*, uint64_t, double, int64_t, int64_t, int64_t, float*);
template void Dropout<BFloat16>(const BFloat16*, uint64_t, double, int64_t, int64_t, int64_t,
                                BFloat16*);
template void Dropout<Half>(const Half*, uint64_t, double, int64_t, int64_t, int64_t, Half*);

}  // namespace lathe::kernels::cpu
