// NF4 dequantization on CUDA: elements [begin, end) of a tensor in kernels/cpu/nf4.h's layout,
// bit for bit the values of cpu::DequantizeNf4, launched on `stream`; one thread per element
// (grid-stride). The float arithmetic is the CPU's, rounded the same way:
//   c_b = float(map[absmax_codes[b]] * absmax2[b / 256]) + offset
//   w_i = float(kNf4Levels[level_i]) * c_(i / 64)
// written with __fmul_rn and __fadd_rn, which nvcc never contracts into a fused multiply-add
// (it would contract a plain `x * y + z`; the CPU kernel is built without -mfma, so its two
// operations stay two roundings).
//
// The lookup tables (16 levels and the 256-entry dynamic map, 1088 bytes) travel by value in
// the launch's parameters, which CUDA copies when the kernel is launched; each block copies
// them into shared memory once. So there is no device state: nothing to allocate, upload or
// cache per device, and the caller's Nf4Tables may go away as soon as the call returns.
//
// Raw-pointer kernel without libtorch. Returns the launch's error (cudaGetLastError()),
// cudaSuccess when the range is empty.
// Thread-safety: stateless; calls on different streams may run concurrently.
#ifndef LATHE_KERNELS_CUDA_NF4_H_
#define LATHE_KERNELS_CUDA_NF4_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace lathe::kernels::cuda {

// The values dequantization looks up, as floats.
struct Nf4Tables {
  float levels[16];        // float(cpu::kNf4Levels[k])
  float dynamic_map[256];  // the signed 8-bit dynamic map, ascending
};

// The tables for `dynamic_map` (256 floats in host memory; kernels/ops/nf4_linear.h's
// DynamicQuantizationMap(true)) and cpu::kNf4Levels.
Nf4Tables Nf4TablesFor(const float* dynamic_map);

// Elements [begin, end) of the flattened tensor into `out` (end - begin floats). `codes`,
// `absmax_codes`, `absmax2` and `out` are device buffers on the current device, laid out as
// kernels/cpu/nf4.h says; `out` must not alias them.
// REQUIRES: 0 <= begin <= end <= the tensor's element count.
cudaError_t DequantizeNf4(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax2,
                          float offset, const Nf4Tables& tables, int64_t begin, int64_t end,
                          float* out, cudaStream_t stream);

}  // namespace lathe::kernels::cuda

#endif  // LATHE_KERNELS_CUDA_NF4_H_
