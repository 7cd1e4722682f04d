// Inline helpers for the CPU kernels, written so that GCC and Clang vectorise the loops that
// use them at -O2/-O3 without -ffast-math: fixed-width partial sums instead of one serial
// accumulator (a float reduction is not reassociated otherwise), and an exp without libm
// calls or branches.
//
// Thread-safety: pure functions.
#ifndef LATHE_KERNELS_CPU_VECTOR_MATH_H_
#define LATHE_KERNELS_CPU_VECTOR_MATH_H_

#include <cstdint>
#include <cstring>

#include "kernels/float16.h"
#include "kernels/host_device.h"

// On x86-64 with GCC, a kernel marked LATHE_CPU_DISPATCH is compiled twice, for the baseline
// (SSE2) and for x86-64-v3 (AVX2, FMA, F16C: Haswell, Zen and later), and the loader picks
// the clone by the CPU's feature bits (an ifunc), as ATen does with its CPU_CAPABILITY builds:
// 8-wide loops where the machine has them, without -march flags that would tie the binary to
// it. ("arch=haswell" would test the CPU model, which is false on AMD.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LATHE_CPU_DISPATCH __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define LATHE_CPU_DISPATCH
#endif

namespace lathe::kernels::cpu {

// Partial sums per lane; 16 floats fill two AVX or four SSE registers.
inline constexpr int kLanes = 16;

// sum_i a[i] * b[i] over n elements, in float, whatever T is.
template <typename A, typename B>
LATHE_KERNEL_INLINE float Dot(const A* __restrict a, const B* __restrict b, int64_t n) {
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) partial[j] += Load(a[i + j]) * Load(b[i + j]);
  }
  for (int j = 0; i < n; ++i, ++j) partial[j] += Load(a[i]) * Load(b[i]);
  float sum = 0.0f;
  for (int j = 0; j < kLanes; ++j) sum += partial[j];
  return sum;
}

// sum_i a[i] * b[i] * c[i] over n elements, in float.
template <typename A, typename B, typename C>
LATHE_KERNEL_INLINE float Dot3(const A* __restrict a, const B* __restrict b, const C* __restrict c,
                               int64_t n) {
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      partial[j] += Load(a[i + j]) * Load(b[i + j]) * Load(c[i + j]);
    }
  }
  for (int j = 0; i < n; ++i, ++j) partial[j] += Load(a[i]) * Load(b[i]) * Load(c[i]);
  float sum = 0.0f;
  for (int j = 0; j < kLanes; ++j) sum += partial[j];
  return sum;
}

// exp(x) for float x, within 2 ulp of expf over [-87.3, 88.3]; clamps x to that range (so
// exp(88.3) ~ 2e38 instead of inf above it, never a subnormal below), which is what sigmoid
// needs. NaN stays NaN. Cephes' expf: x = n ln2 + r with |r| <= ln2/2, a degree-5 polynomial
// for exp(r), 2^n built in the exponent bits.
LATHE_KERNEL_INLINE float Exp(float x) {
  x = Select(x < -87.3f, -87.3f, x);
  x = Select(x > 88.3f, 88.3f, x);
  // n = round(x / ln2): adding and subtracting 1.5 * 2^23 rounds to nearest (no roundps
  // before SSE4.1, and a ?: here would keep GCC from vectorising the loop). A NaN x gives
  // n = 0, which keeps the int conversion below defined; p stays NaN.
  const float rounded = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float n = Select(rounded == rounded, rounded, 0.0f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t scale_bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof(scale));
  return p * scale;
}

// 1 / (1 + exp(-x)).
LATHE_KERNEL_INLINE float Sigmoid(float x) { return 1.0f / (1.0f + Exp(-x)); }

}  // namespace lathe::kernels::cpu

#endif  // LATHE_KERNELS_CPU_VECTOR_MATH_H_
