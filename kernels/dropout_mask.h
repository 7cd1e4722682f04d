// The dropout mask of the fused LoRA projection (docs/kernels.md, "LoRA linear"), shared by
// the CPU and CUDA dropout kernels.
//
// The mask is a counter-based hash of (seed, row, column) rather than a stored tensor: the
// forward and the backward (and a recomputation under activation checkpointing) regenerate
// the same mask from a 64-bit seed, so nothing of x's size is saved for backward. Element
// (r, c) of a row-major [rows, cols] tensor is kept when
//   h = Mix32(Mix32(c ^ lo(k)) + hi(k)),  k = SplitMix64(seed + r * 0x9E3779B97F4A7C15)
//   (h >> 8) >= DropoutThreshold(p)
// i.e. with probability 1 - round(p * 2^24) / 2^24; a kept element is scaled by 1 / (1 - p).
// The masks differ from at::dropout's for the same generator state.
#ifndef LATHE_KERNELS_DROPOUT_MASK_H_
#define LATHE_KERNELS_DROPOUT_MASK_H_

#include <cstdint>

#include "kernels/host_device.h"

namespace lathe::kernels {

// MurmurHash3's 32-bit finaliser: a bijection with full avalanche.
LATHE_HOST_DEVICE uint32_t Mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// The key of row `row` of the mask drawn with `seed`.
LATHE_HOST_DEVICE uint64_t DropoutRowKey(uint64_t seed, int64_t row) {
  uint64_t z = seed + static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Whether column `col` of the row with key `row_key` is kept.
LATHE_HOST_DEVICE bool DropoutKeep(uint64_t row_key, int64_t col, uint32_t threshold) {
  uint32_t h = Mix32(static_cast<uint32_t>(col) ^ static_cast<uint32_t>(row_key));
  h = Mix32(h + static_cast<uint32_t>(row_key >> 32));
  return (h >> 8) >= threshold;
}

// The 24-bit threshold for drop probability p. REQUIRES: 0 <= p < 1.
LATHE_HOST_DEVICE uint32_t DropoutThreshold(double p) {
  return static_cast<uint32_t>(p * 16777216.0 + 0.5);
}

}  // namespace lathe::kernels

#endif  // LATHE_KERNELS_DROPOUT_MASK_H_
