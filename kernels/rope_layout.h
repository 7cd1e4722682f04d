// The memory layout of a RoPE operand, shared by the CPU and CUDA RoPE kernels
// (kernels/cpu/rope.h, kernels/cuda/rope.h).
//
// A tensor is a [batch, heads, seq, head_dim] logical array with arbitrary strides for its
// first three dimensions and a contiguous last one, so both [batch, heads, seq, head_dim] and
// the projection's [batch, seq, heads, head_dim] memory order (a transposed view) work
// without a copy. Rows are the (batch, seq, head) vectors of head_dim elements, numbered in
// that order: row = (b * seq + s) * heads + h, so consecutive rows share a position (and a
// row of the cos/sin tables).
#ifndef LATHE_KERNELS_ROPE_LAYOUT_H_
#define LATHE_KERNELS_ROPE_LAYOUT_H_

#include <cstdint>

#include "kernels/host_device.h"

namespace lathe::kernels {

struct RopeLayout {
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t seq = 0;
  int64_t head_dim = 0;  // even
  // Strides in elements.
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t seq_stride = 0;

  LATHE_HOST_DEVICE int64_t rows() const { return batch * seq * heads; }
  // Offset of row `row`'s first element.
  LATHE_HOST_DEVICE int64_t Offset(int64_t row) const {
    const int64_t h = row % heads;
    const int64_t s = (row / heads) % seq;
    const int64_t b = row / (heads * seq);
    return b * batch_stride + h * head_stride + s * seq_stride;
  }
  // Its position: the row of the cos/sin tables.
  LATHE_HOST_DEVICE int64_t Position(int64_t row) const { return (row / heads) % seq; }
};

}  // namespace lathe::kernels

#endif  // LATHE_KERNELS_ROPE_LAYOUT_H_
