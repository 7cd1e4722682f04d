// The 16-bit element types of the raw-pointer kernels (kernels/cpu, kernels/cuda), and their
// conversions to and from float for the CPU kernels.
//
// BFloat16 and Half are storage only: 16 bits with the layout of c10::BFloat16 / c10::Half and
// of CUDA's __nv_bfloat16 / __half, so ops/ passes a tensor's data pointer with a
// reinterpret_cast. Kernels compute in float: Load() widens an element, Store() rounds a float
// to nearest even (NaN stays NaN). These are inline and branch-free (mask selects) so that the
// loops calling them vectorise; common/float16.h has the out-of-line equivalents.
//
// Thread-safety: pure functions.
#ifndef LATHE_KERNELS_FLOAT16_H_
#define LATHE_KERNELS_FLOAT16_H_

#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace lathe::kernels {

struct BFloat16 {
  uint16_t bits;
};

struct Half {
  uint16_t bits;
};

static_assert(sizeof(BFloat16) == 2 && alignof(BFloat16) == 2);
static_assert(sizeof(Half) == 2 && alignof(Half) == 2);

namespace float16_internal {

LATHE_KERNEL_INLINE uint32_t Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

LATHE_KERNEL_INLINE float FromBits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// c ? a : b without a branch. GCC leaves some ?: on floats (those it cannot turn into
// min/max under IEEE semantics) as control flow that stops the loop vectoriser; a mask
// select vectorises.
LATHE_KERNEL_INLINE uint32_t SelectBits(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (mask & a) | (~mask & b);
}

}  // namespace float16_internal

// c ? a : b for floats, without a branch (see SelectBits).
LATHE_KERNEL_INLINE float Select(bool c, float a, float b) {
  using float16_internal::Bits;
  return float16_internal::FromBits(float16_internal::SelectBits(c, Bits(a), Bits(b)));
}

LATHE_KERNEL_INLINE float Load(float value) { return value; }

LATHE_KERNEL_INLINE float Load(BFloat16 value) {
  return float16_internal::FromBits(static_cast<uint32_t>(value.bits) << 16);
}

// After F. Giesen's half_to_float (public domain): rebias the exponent, then fix up
// infinities/NaN and subnormals.
LATHE_KERNEL_INLINE float Load(Half value) {
  using float16_internal::Bits;
  using float16_internal::FromBits;
  const uint32_t shifted_exponent = 0x7C00u << 13;
  uint32_t magnitude = static_cast<uint32_t>(value.bits & 0x7FFF) << 13;
  const uint32_t exponent = magnitude & shifted_exponent;
  magnitude += (127 - 15) << 23;
  const uint32_t inf_nan = magnitude + ((128 - 16) << 23);
  const uint32_t subnormal = Bits(FromBits(magnitude + (1 << 23)) - FromBits(113u << 23));
  using float16_internal::SelectBits;
  magnitude = SelectBits(exponent == shifted_exponent, inf_nan, magnitude);
  magnitude = SelectBits(exponent == 0, subnormal, magnitude);
  return FromBits(magnitude | (static_cast<uint32_t>(value.bits & 0x8000) << 16));
}

// Store<T>(x): x rounded to T.
template <typename T>
T Store(float value);

template <>
LATHE_KERNEL_INLINE float Store<float>(float value) {
  return value;
}

template <>
LATHE_KERNEL_INLINE BFloat16 Store<BFloat16>(float value) {
  const uint32_t bits = float16_internal::Bits(value);
  const uint32_t rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40;
  const bool nan = (bits & 0x7FFFFFFF) > 0x7F800000;
  return BFloat16{static_cast<uint16_t>(float16_internal::SelectBits(nan, quiet_nan, rounded))};
}

// After F. Giesen's float_to_half_fast3_rtne (public domain).
template <>
LATHE_KERNEL_INLINE Half Store<Half>(float value) {
  using float16_internal::Bits;
  using float16_internal::FromBits;
  const uint32_t f32_infinity = 255u << 23;
  const uint32_t f16_max = (127u + 16) << 23;
  const uint32_t denormal_magic = ((127u - 15) + (23 - 10) + 1) << 23;
  uint32_t bits = Bits(value);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  using float16_internal::SelectBits;
  const uint32_t overflow = SelectBits(bits > f32_infinity, 0x7E00, 0x7C00);
  const uint32_t subnormal = Bits(FromBits(bits) + FromBits(denormal_magic)) - denormal_magic;
  const uint32_t mantissa_odd = (bits >> 13) & 1;
  const uint32_t normal = (bits + ((15u - 127) << 23) + 0xFFF + mantissa_odd) >> 13;
  uint32_t result = SelectBits(bits < (113u << 23), subnormal, normal);
  result = SelectBits(bits >= f16_max, overflow, result);
  return Half{static_cast<uint16_t>(result | (sign >> 16))};
}

}  // namespace lathe::kernels

#endif  // LATHE_KERNELS_FLOAT16_H_
