#include "kernels/cpu/nf4.h"
#include "kernels/cuda/device_types.cuh"
#include "kernels/cuda/nf4.h"

namespace lathe::kernels::cuda {
namespace {

constexpr int kTableEntries = 16 + 256;

// __grid_constant__: the kernel reads the tables where the launch put them (the parameter
// space) instead of a per-thread copy, which indexing them by threadIdx would otherwise need.
__global__ void DequantizeNf4Kernel(const uint8_t* __restrict__ codes,
                                    const uint8_t* __restrict__ absmax_codes,
                                    const float* __restrict__ absmax2, float offset,
                                    const __grid_constant__ Nf4Tables tables, int64_t begin,
                                    int64_t count, float* __restrict__ out) {
  // Levels first, then the map, as in Nf4Tables; a warp reads up to 16 levels at once, which
  // shared memory serves in one pass and the parameter (constant) cache would not.
  __shared__ float table[kTableEntries];
  for (int k = threadIdx.x; k < kTableEntries; k += blockDim.x) {
    table[k] = k < 16 ? tables.levels[k] : tables.dynamic_map[k - 16];
  }
  __syncthreads();
  const float* levels = table;
  const float* map = table + 16;
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < count;
       j += step) {
    const int64_t i = begin + j;
    const int64_t b = i / cpu::kNf4Block;
    const float absmax =
        __fadd_rn(__fmul_rn(map[absmax_codes[b]], absmax2[b / cpu::kNf4AbsmaxBlock]), offset);
    const int level = (codes[i / 2] >> ((i % 2) * 4)) & 0xF;
    out[j] = __fmul_rn(levels[level], absmax);
  }
}

}  // namespace

Nf4Tables Nf4TablesFor(const float* dynamic_map) {
  Nf4Tables tables;
  for (int k = 0; k < 16; ++k) tables.levels[k] = static_cast<float>(cpu::kNf4Levels[k]);
  for (int k = 0; k < 256; ++k) tables.dynamic_map[k] = dynamic_map[k];
  return tables;
}

cudaError_t DequantizeNf4(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax2,
                          float offset, const Nf4Tables& tables, int64_t begin, int64_t end,
                          float* out, cudaStream_t stream) {
  const int64_t count = end - begin;
  if (count <= 0) return cudaSuccess;
  DequantizeNf4Kernel<<<GridFor(count), kBlockThreads, 0, stream>>>(
      codes, absmax_codes, absmax2, offset, tables, begin, count, out);
  return cudaGetLastError();
}

}  // namespace lathe::kernels::cuda
