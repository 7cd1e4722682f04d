// RMSNorm over the last dimension, forward and backward (docs/kernels.md, "RMSNorm"):
//   rstd = 1 / sqrt(mean(x^2) + eps),  y = x * rstd * weight
// per row of `hidden` elements, statistics in float32 whatever the element type T (float,
// BFloat16, Half), one rounding of y to T.
//
// Raw-pointer kernels without libtorch. Each call processes rows [begin, end) of row-major
// [rows, hidden] buffers on the calling thread; ops/ splits the rows across threads.
// Thread-safety: calls on disjoint row ranges (and disjoint dweight buffers) may run
// concurrently. Output buffers must not alias inputs.
#ifndef LATHE_KERNELS_CPU_RMS_NORM_H_
#define LATHE_KERNELS_CPU_RMS_NORM_H_

#include <cstdint>

#include "kernels/float16.h"

namespace lathe::kernels::cpu {

// Writes y[r, :] and rstd[r] for every row r in [begin, end).
// REQUIRES: hidden >= 1; 0 <= begin <= end <= rows.
template <typename T>
void RmsNormForward(const T* x, const float* weight, int64_t hidden, float eps, int64_t begin,
                    int64_t end, T* y, float* rstd);

// Given dy and the forward's x and rstd, writes dx[r, :] for every row r in [begin, end) and,
// when dweight is not null, dweight[j] = sum over those rows of dy[r, j] * x[r, j] * rstd[r]
// (overwritten, not accumulated: the caller sums the partial results of its row ranges).
//   dx = rstd * (dy * weight - x * rstd^2 * mean(dy * weight * x))
template <typename T>
void RmsNormBackward(const T* dy, const T* x, const float* weight, const float* rstd,
                     int64_t hidden, int64_t begin, int64_t end, T* dx, float* dweight);

}  // namespace lathe::kernels::cpu

#endif  // LATHE_KERNELS_CPU_RMS_NORM_H_
