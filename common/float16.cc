#include "common/float16.h"

#include <cmath>
#include <cstring>

namespace lathe {
namespace {

uint32_t Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

float FromBits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

}  // namespace

uint16_t FloatToBFloat16(float value) {
  uint32_t bits = Bits(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float BFloat16ToFloat(uint16_t bits) { return FromBits(static_cast<uint32_t>(bits) << 16); }

uint16_t FloatToHalf(float value) {
  uint32_t bits = Bits(value);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  uint32_t abs_bits = bits & 0x7FFFFFFF;
  if (abs_bits >= 0x7F800000) {  // inf or NaN
    return sign | 0x7C00 | (abs_bits > 0x7F800000 ? 0x200 : 0);
  }
  if (abs_bits >= 0x477FF000) return sign | 0x7C00;  // rounds to >= 65520: overflow to inf
  if (abs_bits < 0x38800000) {                       // below the smallest normal half
    // Scale so that the subnormal half's unit is one, then round to nearest even.
    float scaled = FromBits(abs_bits) * 16777216.0f;  // 2^24
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  uint32_t mantissa_rounding = 0xFFF + ((abs_bits >> 13) & 1);
  uint32_t rounded = abs_bits + mantissa_rounding;
  return sign | static_cast<uint16_t>((rounded - 0x38000000) >> 13);
}

float HalfToFloat(uint16_t bits) {
  uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  uint32_t exponent = (bits >> 10) & 0x1F;
  uint32_t mantissa = bits & 0x3FF;
  if (exponent == 0) {
    float magnitude = static_cast<float>(mantissa) / 16777216.0f;  // 2^-24 units
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return FromBits(sign | 0x7F800000 | (mantissa << 13));
  return FromBits(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

}  // namespace lathe
