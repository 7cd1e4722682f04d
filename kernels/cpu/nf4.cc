#include "kernels/cpu/nf4.h"

#include <algorithm>
#include <cmath>

namespace lathe::kernels::cpu {

const double kNf4Levels[16] = {-1.0,
                               -0.6961928009986877,
                               -0.5250730514526367,
                               -0.39491748809814453,
                               -0.28444138169288635,
                               -0.18477343022823334,
                               -0.09105003625154495,
                               0.0,
                               0.07958029955625534,
                               0.16093020141124725,
                               0.24611230194568634,
                               0.33791524171829224,
                               0.44070982933044434,
                               0.5626170039176941,
                               0.7229568362236023,
                               1.0};

namespace {

// The index of the nearest of `count` ascending levels to `x`: how many midpoints are below
// it (a value on a midpoint takes the lower level).
int Nearest(const double* midpoints, int count, double x) {
  return static_cast<int>(std::lower_bound(midpoints, midpoints + count - 1, x) - midpoints);
}

// The code of 0 in an ascending map that holds it.
int ZeroCode(const double* midpoints, int count) { return Nearest(midpoints, count, 0.0); }

}  // namespace

void QuantizeNf4(const float* weights, int64_t n, const float* dynamic_map, uint8_t* codes,
                 uint8_t* absmax_codes, float* absmax2, float* offset) {
  double nf4_mid[15];
  for (int k = 0; k < 15; ++k) nf4_mid[k] = (kNf4Levels[k] + kNf4Levels[k + 1]) / 2;
  double map_mid[255];
  for (int k = 0; k < 255; ++k) {
    map_mid[k] =
        (static_cast<double>(dynamic_map[k]) + static_cast<double>(dynamic_map[k + 1])) / 2;
  }
  const int64_t blocks = (n + kNf4Block - 1) / kNf4Block;
  std::fill(codes, codes + blocks * kNf4Block / 2, uint8_t{0});
  // Level 1: each block of 64 against its largest magnitude.
  double sum = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kNf4Block, end = std::min(n, begin + kNf4Block);
    float absmax = 0.0f;
    for (int64_t i = begin; i < end; ++i) absmax = std::max(absmax, std::fabs(weights[i]));
    for (int64_t i = begin; i < end; ++i) {
      const int level = absmax == 0.0f
                            ? ZeroCode(nf4_mid, 16)
                            : Nearest(nf4_mid, 16, static_cast<double>(weights[i]) / absmax);
      codes[i / 2] |= static_cast<uint8_t>(level << ((i % 2) * 4));
    }
    sum += absmax;
  }
  // Level 2 needs the maxima again: recomputed, block by block (cheaper than a buffer of B).
  const float mean = static_cast<float>(sum / static_cast<double>(blocks));
  *offset = mean;
  auto block_max = [&](int64_t b) {
    const int64_t begin = b * kNf4Block, end = std::min(n, begin + kNf4Block);
    float absmax = 0.0f;
    for (int64_t i = begin; i < end; ++i) absmax = std::max(absmax, std::fabs(weights[i]));
    return absmax - mean;  // float arithmetic
  };
  const int64_t groups = (blocks + kNf4AbsmaxBlock - 1) / kNf4AbsmaxBlock;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t begin = g * kNf4AbsmaxBlock, end = std::min(blocks, begin + kNf4AbsmaxBlock);
    float scale = 0.0f;
    for (int64_t b = begin; b < end; ++b) scale = std::max(scale, std::fabs(block_max(b)));
    absmax2[g] = scale;
    for (int64_t b = begin; b < end; ++b) {
      const int code = scale == 0.0f
                           ? ZeroCode(map_mid, 256)
                           : Nearest(map_mid, 256, static_cast<double>(block_max(b)) / scale);
      absmax_codes[b] = static_cast<uint8_t>(code);
    }
  }
}

void DequantizeNf4(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax2,
                   float offset, const float* dynamic_map, int64_t begin, int64_t end, float* out) {
  float levels[16];
  for (int k = 0; k < 16; ++k) levels[k] = static_cast<float>(kNf4Levels[k]);
  int64_t i = begin;
  while (i < end) {
    const int64_t b = i / kNf4Block;
    const int64_t block_end = std::min(end, (b + 1) * kNf4Block);
    const float product = dynamic_map[absmax_codes[b]] * absmax2[b / kNf4AbsmaxBlock];
    const float absmax = product + offset;
    for (; i < block_end; ++i) {
      const int level = (codes[i / 2] >> ((i % 2) * 4)) & 0xF;
      *out++ = levels[level] * absmax;
    }
  }
}

}  // namespace lathe::kernels::cpu
