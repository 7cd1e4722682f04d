// How the CPU linear cross-entropy carves its workspace (kernels/cpu/linear_cross_entropy.h):
// shared by the kernel and the size functions (linear_cross_entropy_workspace.cc), which the
// planner links without the kernel and its oneDNN products.
//
// Thread-safety: pure functions.
#ifndef LATHE_KERNELS_CPU_LINEAR_CROSS_ENTROPY_LAYOUT_H_
#define LATHE_KERNELS_CPU_LINEAR_CROSS_ENTROPY_LAYOUT_H_

#include <cstdint>

#include "kernels/linear_cross_entropy_workspace.h"

namespace lathe::kernels::cpu {

using WorkspaceLayout = LinearCrossEntropyWorkspaceLayout<64>;
using Sizes = LinearCrossEntropySizes;

struct ForwardWorkspace {
  float* tile;
  float* row_max;
  float* row_sum;
  float* row_target;
  float* hidden_stage;  // bfloat16 only
  float* weight_stage;  // bfloat16 only
  float* grad_hidden;   // bfloat16 with the hidden gradient only: its float32 sums, [N, H]
};

inline ForwardWorkspace CarveForward(const Sizes& s, bool grad_hidden, WorkspaceLayout& layout) {
  ForwardWorkspace w;
  w.tile = layout.Take<float>(s.tn * s.tv);
  w.row_max = layout.Take<float>(s.n);
  w.row_sum = layout.Take<float>(s.n);
  w.row_target = layout.Take<float>(s.n);
  w.hidden_stage = s.bf16 ? layout.Take<float>(s.tn * s.h) : nullptr;
  w.weight_stage = s.bf16 ? layout.Take<float>(s.tv * s.h) : nullptr;
  w.grad_hidden = s.bf16 && grad_hidden ? layout.Take<float>(s.n * s.h) : nullptr;
  return w;
}

struct BackwardWorkspace {
  float* tile;
  float* hidden_stage;  // bfloat16 only
  float* weight_stage;  // bfloat16 only
  LinearCrossEntropyGradientSums sums;
};

inline BackwardWorkspace CarveBackward(const Sizes& s, bool grad_hidden, bool grad_weight,
                                       WorkspaceLayout& layout) {
  BackwardWorkspace w{};
  w.tile = layout.Take<float>(s.tn * s.tv);
  if (s.bf16) {
    w.hidden_stage = layout.Take<float>(s.tn * s.h);
    w.weight_stage = layout.Take<float>(s.tv * s.h);
  }
  w.sums = TakeGradientSums(s, grad_hidden, grad_weight, layout);
  return w;
}

// The single pass: one [tn, V] tile (float32 only).
inline float* CarveSinglePass(const Sizes& s, WorkspaceLayout& layout) {
  return layout.Take<float>(s.tn * s.v);
}

}  // namespace lathe::kernels::cpu

#endif  // LATHE_KERNELS_CPU_LINEAR_CROSS_ENTROPY_LAYOUT_H_
