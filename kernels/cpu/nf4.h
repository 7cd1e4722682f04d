// 4-bit NormalFloat (NF4) with double-quantized block maxima, QLoRA's storage for frozen
// weights (docs/kernels.md "NF4"; Dettmers et al., "QLoRA", 2023). Raw-pointer CPU code, no
// libtorch: quantization (at model load) and dequantization of an element range (the
// forward and backward passes dequantize a tile at a time, kernels/ops/nf4_linear.h).
//
// Layout of an n-element tensor (flattened row-major):
//   codes          uint8 [ceil(n / 64) * 32]: element i's 4-bit level in byte i / 2, the low
//                  nibble for even i; whole blocks of 64 (a partial last block padded).
//   absmax_codes   uint8 [B], B = ceil(n / 64): block b's largest magnitude c_b, stored as the
//                  8-bit code of (c_b - offset) / absmax2[b / 256] in the signed dynamic map.
//   absmax2        float [ceil(B / 256)]: the largest |c_b - offset| of each group of 256.
//   offset         the mean of the c_b.
// A level is the index of the nearest of kNf4Levels to w / c_b, decided in double precision
// (a value on a midpoint takes the lower level); an 8-bit code likewise. Dequantized:
//   c_b = float(map[absmax_codes[b]] * absmax2[b / 256]) + offset    (float arithmetic)
//   w_i = float(kNf4Levels[level_i]) * c_(i / 64)
//
// Thread-safety: pure functions over caller-owned buffers.
#ifndef LATHE_KERNELS_CPU_NF4_H_
#define LATHE_KERNELS_CPU_NF4_H_

#include <cstdint>

namespace lathe::kernels::cpu {

inline constexpr int64_t kNf4Block = 64;
inline constexpr int64_t kNf4AbsmaxBlock = 256;

// The 16 NF4 levels as the QLoRA paper publishes them, ascending, from -1 to 1.
extern const double kNf4Levels[16];

// Quantizes `n` floats. `dynamic_map`: the 256 ascending floats of the signed 8-bit dynamic
// map (kernels/ops/quantization.h). Output buffers sized as above.
void QuantizeNf4(const float* weights, int64_t n, const float* dynamic_map, uint8_t* codes,
                 uint8_t* absmax_codes, float* absmax2, float* offset);

// Elements [begin, end) of the tensor, dequantized into `out` (end - begin floats).
void DequantizeNf4(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax2,
                   float offset, const float* dynamic_map, int64_t begin, int64_t end, float* out);

}  // namespace lathe::kernels::cpu

#endif  // LATHE_KERNELS_CPU_NF4_H_
