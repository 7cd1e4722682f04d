// How the CPU linear cross-entropy carves its workspace (kernels/cpu/linear_cross_entropy.h):
// shared by the kernel and the size functions (linear_cross_entropy_workspace.cc), which the
// planner links without the kernel and its oneDNN products.
//
// Thread-safety: pure functions.
#ifndef LATHE_KERNELS_CPU_LINEAR_CROSS_ENTROPY_LAYOUT_H_
#define LATHE_KERNELS_CPU_LINEAR_CROSS_ENTROPY_LAYOUT_H_

#include <algorithm>
#include <cstdint>

#include "kernels/float16.h"
#include "kernels/linear_cross_entropy_workspace.h"

namespace lathe::kernels::cpu {

using WorkspaceLayout = LinearCrossEntropyWorkspaceLayout<64>;
using Sizes = LinearCrossEntropySizes;

// The stages of float32 hidden with a bfloat16 weight. With native bfloat16 products
// (NativeBFloat16Products() in kernels/cpu/matmul.h): the token chunk's hidden rows rounded to
// bfloat16 and, where the hidden gradient is formed, the gradient tile rounded to bfloat16;
// otherwise the vocabulary chunk's weight rows widened to float32.
struct BFloat16WeightStages {
  BFloat16* hidden = nullptr;  // [tn, H]
  BFloat16* tile = nullptr;    // [tn, tv]
  float* weight = nullptr;     // [tv, H]
};

inline BFloat16WeightStages TakeBFloat16WeightStages(const Sizes& s, bool grad_hidden, bool native,
                                                     WorkspaceLayout& layout) {
  BFloat16WeightStages stages;
  if (native) {
    stages.hidden = layout.Take<BFloat16>(s.tn * s.h);
    if (grad_hidden) stages.tile = layout.Take<BFloat16>(s.tn * s.tv);
  } else {
    stages.weight = layout.Take<float>(s.tv * s.h);
  }
  return stages;
}

// Either way's stages in one region sized for the larger, rather than sizes that take the way
// as a parameter: the sizes then depend on neither the CPU nor LATHE_CPU_BF16, so the planner
// (on the coordinator, without oneDNN) gets the same sizes as every worker, and the chunks
// chosen from them fit the budget either way. It costs the fallback up to 2 tn (H + tv) bytes
// that it does not use, and the native way up to 4 tv H.
inline BFloat16WeightStages CarveBFloat16WeightStages(const Sizes& s, bool grad_hidden, bool native,
                                                      WorkspaceLayout& layout) {
  WorkspaceLayout native_size(nullptr);
  WorkspaceLayout fallback_size(nullptr);
  TakeBFloat16WeightStages(s, grad_hidden, true, native_size);
  TakeBFloat16WeightStages(s, grad_hidden, false, fallback_size);
  WorkspaceLayout region(layout.Take<char>(std::max(native_size.bytes(), fallback_size.bytes())));
  return TakeBFloat16WeightStages(s, grad_hidden, native, region);
}

struct ForwardWorkspace {
  float* tile;
  float* row_max;
  float* row_sum;
  float* row_target;
  float* hidden_stage;  // bfloat16 only
  float* weight_stage;  // bfloat16 only
  float* grad_hidden;   // bfloat16 with the hidden gradient only: its float32 sums, [N, H]
  BFloat16WeightStages bf16_weight;  // float32 hidden with a bfloat16 weight only
};

// `native`: whether the products multiply bfloat16 natively; for float32 hidden with a
// bfloat16 weight it changes which arrays lie in the workspace, not its size.
inline ForwardWorkspace CarveForward(const Sizes& s, bool grad_hidden, bool native,
                                     WorkspaceLayout& layout) {
  ForwardWorkspace w{};
  w.tile = layout.Take<float>(s.tn * s.tv);
  w.row_max = layout.Take<float>(s.n);
  w.row_sum = layout.Take<float>(s.n);
  w.row_target = layout.Take<float>(s.n);
  w.hidden_stage = s.bf16 ? layout.Take<float>(s.tn * s.h) : nullptr;
  w.weight_stage = s.bf16 ? layout.Take<float>(s.tv * s.h) : nullptr;
  w.grad_hidden = s.bf16 && grad_hidden ? layout.Take<float>(s.n * s.h) : nullptr;
  if (s.bf16_weight_only) {
    w.bf16_weight = CarveBFloat16WeightStages(s, grad_hidden, native, layout);
  }
  return w;
}

struct BackwardWorkspace {
  float* tile;
  float* hidden_stage;  // bfloat16 only
  float* weight_stage;  // bfloat16 only
  LinearCrossEntropyGradientSums sums;
  BFloat16WeightStages bf16_weight;  // float32 hidden with a bfloat16 weight only
};

inline BackwardWorkspace CarveBackward(const Sizes& s, bool grad_hidden, bool grad_weight,
                                       bool native, WorkspaceLayout& layout) {
  BackwardWorkspace w{};
  w.tile = layout.Take<float>(s.tn * s.tv);
  if (s.bf16) {
    w.hidden_stage = layout.Take<float>(s.tn * s.h);
    w.weight_stage = layout.Take<float>(s.tv * s.h);
  }
  w.sums = TakeGradientSums(s, grad_hidden, grad_weight, layout);
  if (s.bf16_weight_only) {
    w.bf16_weight = CarveBFloat16WeightStages(s, grad_hidden, native, layout);
  }
  return w;
}

// The single pass: one [tn, V] tile (float32 only).
inline float* CarveSinglePass(const Sizes& s, WorkspaceLayout& layout) {
  return layout.Take<float>(s.tn * s.v);
}

}  // namespace lathe::kernels::cpu

#endif  // LATHE_KERNELS_CPU_LINEAR_CROSS_ENTROPY_LAYOUT_H_
