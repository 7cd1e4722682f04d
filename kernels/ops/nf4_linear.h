// QLoRA's frozen weights: the 8-bit dynamic quantization map (also 8-bit AdamW's), NF4
// quantization of a weight (kernels/cpu/nf4.h for the layout), and the linear layer that
// multiplies by an NF4 weight a tile at a time, so that the layer's full-precision weight
// never exists whole (docs/kernels.md "NF4").
//
// Thread-safety: as any ATen op.
#ifndef LATHE_KERNELS_OPS_NF4_LINEAR_H_
#define LATHE_KERNELS_OPS_NF4_LINEAR_H_

#include <cstdint>

#include "kernels/ops/torch_compat.h"

namespace lathe::kernels {

// The 256 values (ascending, float32, CPU) of the dynamic quantization map of "8-bit
// Optimizers via Block-wise Quantization": signed (with negative values) or unsigned. For
// i = 0..6, F = 2^i + 1 points (2^(i+1) + 1 unsigned) b_j = 0.1 + 0.9 j / (F - 1), their
// midpoints times 10^(i - 6) (and, signed, their negatives), and 0 and 1; computed in double,
// rounded to float, sorted.
at::Tensor DynamicQuantizationMap(bool is_signed);

// A weight [rows, cols] in NF4 with double-quantized block maxima, on one device.
struct Nf4Weight {
  at::Tensor codes;         // uint8 [ceil(n / 64) * 32]
  at::Tensor absmax_codes;  // uint8 [ceil(n / 64)]
  at::Tensor absmax2;       // float32 [ceil(n / 64 / 256)]
  double offset = 0.0;      // a float value
  int64_t rows = 0, cols = 0;

  bool defined() const { return codes.defined(); }
  // Bytes held (codes, block codes, second-level maxima).
  int64_t nbytes() const;
};

// Quantizes a 2-D float tensor (widened from bfloat16/float16 first) to NF4 on `device`
// (quantization runs on the CPU).
Nf4Weight QuantizeNf4(const at::Tensor& weight, at::Device device);

// Elements [begin, end) of the flattened weight, dequantized: float32, on its device (the CPU
// loop, or on CUDA kernels/cuda/nf4.h's kernel, bit for bit the same values).
// REQUIRES: the weight on the CPU, or on a CUDA device when libtorch has CUDA.
at::Tensor DequantizeNf4(const Nf4Weight& weight, int64_t begin, int64_t end);

// y = x W^T for x [..., cols] (float32), W the NF4 weight dequantized a tile of rows at a
// time (each tile about a megabyte, freed before the next); backward gives x's gradient the
// same way (W is frozen). Saved for backward: the weight's quantized tensors only.
at::Tensor Nf4Linear(const at::Tensor& x, const Nf4Weight& weight);

}  // namespace lathe::kernels

#endif  // LATHE_KERNELS_OPS_NF4_LINEAR_H_
