// Conversions between float and the two 16-bit floating formats of model files, for code
// that must not include libtorch (tools, tests). Round to nearest even; NaN stays NaN.
//
// Thread-safety: pure functions.
#ifndef LATHE_COMMON_FLOAT16_H_
#define LATHE_COMMON_FLOAT16_H_

#include <cstdint>

namespace lathe {

uint16_t FloatToBFloat16(float value);
float BFloat16ToFloat(uint16_t bits);
uint16_t FloatToHalf(float value);
float HalfToFloat(uint16_t bits);

}  // namespace lathe

#endif  // LATHE_COMMON_FLOAT16_H_
