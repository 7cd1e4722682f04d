// Dropout with the counter-based mask of kernels/dropout_mask.h: the same call applies the
// mask in forward (to x) and in backward (to the gradient), given the same seed.
//
// Raw-pointer kernel without libtorch. Each call processes rows [begin, end) of row-major
// [rows, cols] buffers on the calling thread; ops/ splits the rows across threads.
// Thread-safety: calls on disjoint row ranges may run concurrently.
#ifndef LATHE_KERNELS_CPU_DROPOUT_H_
#define LATHE_KERNELS_CPU_DROPOUT_H_

#include <cstdint>

#include "kernels/float16.h"

namespace lathe::kernels::cpu {

// y[r, c] = x[r, c] / (1 - p) where the mask of `seed` keeps (r, c), else 0, for rows
// [begin, end). y may be x (in place). REQUIRES: 0 <= p < 1.
template <typename T>
void Dropout(const T* x, uint64_t seed, double p, int64_t cols, int64_t begin, int64_t end, T* y);

}  // namespace lathe::kernels::cpu

#endif  // LATHE_KERNELS_CPU_DROPOUT_H_
