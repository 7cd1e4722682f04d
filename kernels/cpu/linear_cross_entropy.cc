#include "kernels/cpu/linear_cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/linear_cross_entropy_layout.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/vector_math.h"
#include "kernels/linear_cross_entropy_workspace.h"

namespace lathe::kernels::cpu {
namespace {

// tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|): no overflow, absolute error a few
// ulp of 1.
inline float Tanh(float x) {
  const float e = Exp(-2.0f * std::fabs(x));
  return std::copysign((1.0f - e) / (1.0f + e), x);
}

void BFloat16ToFloat(const BFloat16* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Load(src[i]);
}

void FloatToBFloat16(const float* __restrict src, BFloat16* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Store<BFloat16>(src[i]);
}

float RowMax(const float* __restrict row, int64_t n) {
  float partial[kLanes];
  std::fill(partial, partial + kLanes, -std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      partial[l] = row[j + l] > partial[l] ? row[j + l] : partial[l];
    }
  }
  for (int l = 0; j < n; ++j, ++l) partial[l] = row[j] > partial[l] ? row[j] : partial[l];
  return *std::max_element(partial, partial + kLanes);
}

float RowSumExp(const float* __restrict row, int64_t n, float shift) {
  float partial[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) partial[l] += Exp(row[j + l] - shift);
  }
  for (int l = 0; j < n; ++j, ++l) partial[l] += Exp(row[j] - shift);
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += partial[l];
  return sum;
}

void SoftCapRow(float* __restrict row, int64_t n, float cap) {
  const float inv_cap = 1.0f / cap;
  for (int64_t j = 0; j < n; ++j) row[j] = cap * Tanh(row[j] * inv_cap);
}

// row[j] <- exp(row[j] - shift); returns their sum.
float RowExpInPlace(float* __restrict row, int64_t n, float shift) {
  float partial[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      row[j + l] = Exp(row[j + l] - shift);
      partial[l] += row[j + l];
    }
  }
  for (int l = 0; j < n; ++j, ++l) {
    row[j] = Exp(row[j] - shift);
    partial[l] += row[j];
  }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += partial[l];
  return sum;
}

// row (soft-capped logits z_j) <- exp(z_j - shift) * (1 - (z_j / cap)^2), the exponential
// times dz/dlogit; returns the sum of the exponentials alone.
float RowExpSlopeInPlace(float* __restrict row, int64_t n, float shift, float cap) {
  const float inv_cap = 1.0f / cap;
  float partial[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float e = Exp(row[j + l] - shift);
      const float t = row[j + l] * inv_cap;
      partial[l] += e;
      row[j + l] = e * (1.0f - t * t);
    }
  }
  for (int l = 0; j < n; ++j, ++l) {
    const float e = Exp(row[j] - shift);
    const float t = row[j] * inv_cap;
    partial[l] += e;
    row[j] = e * (1.0f - t * t);
  }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += partial[l];
  return sum;
}

void ScaleRow(float* __restrict row, int64_t n, float factor) {
  for (int64_t j = 0; j < n; ++j) row[j] *= factor;
}

// row (raw logits a_j) <- scale * d(loss)/d(a_j) for the row's non-target entries:
// scale * exp(z_j - lse) * (1 + 2 z_loss_weight lse) * dz_j/da_j.
void GradientRow(float* __restrict row, int64_t n, float lse, float factor, float cap) {
  if (cap > 0.0f) {
    const float inv_cap = 1.0f / cap;
    for (int64_t j = 0; j < n; ++j) {
      const float t = Tanh(row[j] * inv_cap);
      row[j] = factor * Exp(cap * t - lse) * (1.0f - t * t);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) row[j] = factor * Exp(row[j] - lse);
  }
}

// C = A B + beta C for row-major matrices, A and B of type `input`, C float; A is [m, k] (or
// its transpose is, with trans_a), B is [k, n] (or its transpose is, with trans_b).
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
          const void* b, int64_t ldb, float beta, float* c, int64_t ldc,
          MatmulInput input = MatmulInput::kFloat32) {
  Matmul({m, n, k, trans_a, trans_b, lda, ldb, ldc, input}, a, b, c, 1.0f, beta);
}

// Each array starts on a 64-byte boundary of the (64-byte aligned) workspace: a cache line.
// Chunk c of the tokens holds at least one non-ignored target.
std::vector<char> ChunksWithTargets(const Sizes& s, const int64_t* targets, int64_t ignore_index) {
  std::vector<char> any((s.n + s.tn - 1) / s.tn, 0);
  for (int64_t i = 0; i < s.n; ++i) {
    if (targets[i] != ignore_index) any[i / s.tn] = 1;
  }
  return any;
}

// The chunk products' operands: hidden rows [n0, n0 + tn), weight rows [v0, v0 + tv) and the
// gradient tile, all of type input():
//  - float32: the inputs themselves;
//  - bfloat16: float32 copies in the stages (hidden only when the stage does not already hold
//    these rows);
//  - float32 hidden with a bfloat16 weight, where the CPU multiplies bfloat16 natively: the
//    weight itself, the hidden rows (once per token chunk, as above) and the gradient tile
//    rounded to bfloat16, as autocast would multiply them;
//  - float32 hidden with a bfloat16 weight otherwise: the hidden rows themselves and the weight
//    rows widened to float32, a vocabulary chunk at a time.
class ChunkOperands {
 public:
  ChunkOperands(const Sizes& s, const void* hidden, const void* weight, float* hidden_stage,
                float* weight_stage, const BFloat16WeightStages& bf16_weight, bool native,
                const ParallelFor& parallel_for)
      : s_(s),
        hidden_(hidden),
        weight_(weight),
        hidden_stage_(hidden_stage),
        weight_stage_(s.bf16_weight_only ? bf16_weight.weight : weight_stage),
        bf16_weight_(bf16_weight),
        native_(s.bf16_weight_only && native),
        parallel_for_(parallel_for) {}

  MatmulInput input() const { return native_ ? MatmulInput::kBFloat16 : MatmulInput::kFloat32; }

  const void* Hidden(int64_t n0, int64_t tn) {
    if (!s_.bf16 && !native_) return static_cast<const float*>(hidden_) + n0 * s_.h;
    if (staged_hidden_row_ != n0) {
      if (native_) {
        Round(static_cast<const float*>(hidden_) + n0 * s_.h, bf16_weight_.hidden, tn, s_.h);
      } else {
        Widen(static_cast<const BFloat16*>(hidden_) + n0 * s_.h, hidden_stage_, tn);
      }
      staged_hidden_row_ = n0;
    }
    return native_ ? static_cast<const void*>(bf16_weight_.hidden) : hidden_stage_;
  }

  const void* Weight(int64_t v0, int64_t tv) {
    if (!s_.bf16 && !s_.bf16_weight_only) return static_cast<const float*>(weight_) + v0 * s_.h;
    if (native_) return static_cast<const BFloat16*>(weight_) + v0 * s_.h;
    Widen(static_cast<const BFloat16*>(weight_) + v0 * s_.h, weight_stage_, tv);
    return weight_stage_;
  }

  // The gradient tile [tn, tv] for the products.
  const void* Gradient(const float* tile, int64_t tn, int64_t tv) {
    if (!native_) return tile;
    Round(tile, bf16_weight_.tile, tn, tv);
    return bf16_weight_.tile;
  }

 private:
  void Widen(const BFloat16* src, float* dst, int64_t rows) {
    const int64_t h = s_.h;
    parallel_for_(rows, [&](int64_t begin, int64_t end) {
      BFloat16ToFloat(src + begin * h, dst + begin * h, (end - begin) * h);
    });
  }

  void Round(const float* src, BFloat16* dst, int64_t rows, int64_t cols) {
    parallel_for_(rows, [&](int64_t begin, int64_t end) {
      FloatToBFloat16(src + begin * cols, dst + begin * cols, (end - begin) * cols);
    });
  }

  const Sizes& s_;
  const void* hidden_;
  const void* weight_;
  float* hidden_stage_;
  float* weight_stage_;
  BFloat16WeightStages bf16_weight_;
  bool native_;
  const ParallelFor& parallel_for_;
  int64_t staged_hidden_row_ = -1;
};

void FillZero(float* data, int64_t rows, int64_t cols, const ParallelFor& parallel_for) {
  parallel_for(rows, [&](int64_t begin, int64_t end) {
    std::fill(data + begin * cols, data + end * cols, 0.0f);
  });
}

void StoreRows(const float* src, BFloat16* dst, int64_t rows, int64_t cols,
               const ParallelFor& parallel_for) {
  parallel_for(rows, [&](int64_t begin, int64_t end) {
    FloatToBFloat16(src + begin * cols, dst + begin * cols, (end - begin) * cols);
  });
}

}  // namespace

void SerialFor(int64_t n, const std::function<void(int64_t begin, int64_t end)>& body) {
  if (n > 0) body(0, n);
}

double LinearCrossEntropyForward(const LinearCrossEntropyProblem& problem,
                                 const LinearCrossEntropyChunks& chunks, const void* hidden,
                                 const int64_t* targets, const void* weight, float grad_scale,
                                 float* lse, void* grad_hidden, void* workspace,
                                 const ParallelFor& parallel_for) {
  const Sizes s(problem, chunks);
  const bool native = s.bf16_weight_only && NativeBFloat16Products();
  WorkspaceLayout layout(workspace);
  const ForwardWorkspace w = CarveForward(s, grad_hidden != nullptr, native, layout);
  // The hidden gradient's float32 sums: the output itself in float32.
  float* hidden_sum = grad_hidden == nullptr ? nullptr
                      : s.bf16               ? w.grad_hidden
                                             : static_cast<float*>(grad_hidden);
  if (s.n == 0) return 0.0;
  std::fill(w.row_max, w.row_max + s.n, -std::numeric_limits<float>::infinity());
  std::fill(w.row_sum, w.row_sum + s.n, 0.0f);
  std::fill(w.row_target, w.row_target + s.n, 0.0f);
  if (hidden_sum != nullptr) FillZero(hidden_sum, s.n, s.h, parallel_for);
  const std::vector<char> has_targets = ChunksWithTargets(s, targets, problem.ignore_index);
  ChunkOperands operands(s, hidden, weight, w.hidden_stage, w.weight_stage, w.bf16_weight, native,
                         parallel_for);
  const MatmulInput input = operands.input();
  const float cap = problem.softcap;

  // Vocabulary chunks outside, so that each weight row is read (and converted) once.
  for (int64_t v0 = 0; v0 < s.v; v0 += s.tv) {
    const int64_t tv = std::min(s.tv, s.v - v0);
    const void* weight_rows = operands.Weight(v0, tv);
    for (int64_t n0 = 0; n0 < s.n; n0 += s.tn) {
      if (!has_targets[n0 / s.tn]) continue;
      const int64_t tn = std::min(s.tn, s.n - n0);
      Gemm(false, true, tn, tv, s.h, operands.Hidden(n0, tn), s.h, weight_rows, s.h, 0.0f, w.tile,
           tv, input);
      parallel_for(tn, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const int64_t i = n0 + r;
          const int64_t target = targets[i];
          float* row = w.tile + r * tv;
          if (target == problem.ignore_index) {
            if (hidden_sum != nullptr) std::fill(row, row + tv, 0.0f);
            continue;
          }
          if (cap > 0.0f) SoftCapRow(row, tv, cap);
          if (target >= v0 && target < v0 + tv) w.row_target[i] = row[target - v0];
          const float old_max = w.row_max[i];
          const float new_max = std::max(old_max, RowMax(row, tv));
          const float rescale = std::exp(old_max - new_max);  // 0 for the first chunk
          if (hidden_sum == nullptr) {
            w.row_sum[i] = w.row_sum[i] * rescale + RowSumExp(row, tv, new_max);
          } else {
            // As flash attention's output: the sum over the vocabulary so far of
            // exp(z - max) dz/dlogit W_j, rescaled whenever the running maximum grows; the
            // chunk's share is added by the product below.
            w.row_sum[i] =
                w.row_sum[i] * rescale + (cap > 0.0f ? RowExpSlopeInPlace(row, tv, new_max, cap)
                                                     : RowExpInPlace(row, tv, new_max));
            if (rescale != 1.0f) {
              float* sum_row = hidden_sum + i * s.h;
              for (int64_t k = 0; k < s.h; ++k) sum_row[k] *= rescale;
            }
          }
          w.row_max[i] = new_max;
        }
      });
      if (hidden_sum != nullptr) {
        Gemm(false, false, tn, s.h, tv, operands.Gradient(w.tile, tn, tv), tv, weight_rows, s.h,
             1.0f, hidden_sum + n0 * s.h, s.h, input);
      }
    }
  }

  // lse, the loss and (normalising the sums, less the target's row of W) the hidden gradient.
  std::vector<double> row_loss(s.n, 0.0);
  parallel_for(s.n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t target = targets[i];
      if (target == problem.ignore_index) {
        lse[i] = 0.0f;
        continue;  // the gradient row is still zero
      }
      const double row_lse = static_cast<double>(w.row_max[i]) + std::log(w.row_sum[i]);
      lse[i] = static_cast<float>(row_lse);
      row_loss[i] = row_lse - w.row_target[i] + problem.z_loss_weight * row_lse * row_lse;
      if (hidden_sum == nullptr) continue;
      const float t = cap > 0.0f ? w.row_target[i] / cap : 0.0f;
      const float target_scale = grad_scale * (1.0f - t * t);
      const float sum_scale = static_cast<float>(
          grad_scale * (1.0 + 2.0 * problem.z_loss_weight * row_lse) / w.row_sum[i]);
      float* sum_row = hidden_sum + i * s.h;
      if (s.bf16 || s.bf16_weight_only) {
        const BFloat16* weight_row = static_cast<const BFloat16*>(weight) + target * s.h;
        for (int64_t k = 0; k < s.h; ++k) {
          sum_row[k] = sum_scale * sum_row[k] - target_scale * Load(weight_row[k]);
        }
      } else {
        const float* weight_row = static_cast<const float*>(weight) + target * s.h;
        for (int64_t k = 0; k < s.h; ++k) {
          sum_row[k] = sum_scale * sum_row[k] - target_scale * weight_row[k];
        }
      }
    }
  });
  if (hidden_sum != nullptr && s.bf16) {
    StoreRows(hidden_sum, static_cast<BFloat16*>(grad_hidden), s.n, s.h, parallel_for);
  }
  double loss = 0.0;
  for (int64_t i = 0; i < s.n; ++i) loss += row_loss[i];
  return loss;
}

void LinearCrossEntropyBackward(const LinearCrossEntropyProblem& problem,
                                const LinearCrossEntropyChunks& chunks, const void* hidden,
                                const int64_t* targets, const void* weight, const float* lse,
                                float grad_scale, void* grad_hidden, void* grad_weight,
                                void* workspace, const ParallelFor& parallel_for) {
  const Sizes s(problem, chunks);
  if (grad_hidden == nullptr && grad_weight == nullptr) return;
  const bool native = s.bf16_weight_only && NativeBFloat16Products();
  WorkspaceLayout layout(workspace);
  const BackwardWorkspace w =
      CarveBackward(s, grad_hidden != nullptr, grad_weight != nullptr, native, layout);
  const std::vector<char> has_targets =
      s.n == 0 ? std::vector<char>() : ChunksWithTargets(s, targets, problem.ignore_index);
  ChunkOperands operands(s, hidden, weight, w.hidden_stage, w.weight_stage, w.bf16_weight, native,
                         parallel_for);
  const MatmulInput input = operands.input();
  const float cap = problem.softcap;
  const bool one_vocab_chunk = s.vocab_chunks() == 1;

  // Where the float gradients accumulate: the outputs themselves in float32; in bfloat16 the
  // workspace, stored into the outputs once complete.
  float* hidden_sum = nullptr;
  if (grad_hidden != nullptr) {
    hidden_sum = s.bf16 ? w.sums.grad_hidden : static_cast<float*>(grad_hidden);
    if (!s.bf16 || !one_vocab_chunk) FillZero(hidden_sum, s.n, s.h, parallel_for);
  }
  if (grad_weight != nullptr && !s.bf16) {
    FillZero(static_cast<float*>(grad_weight), s.v, s.h, parallel_for);
  }

  for (int64_t v0 = 0; v0 < s.v; v0 += s.tv) {
    const int64_t tv = std::min(s.tv, s.v - v0);
    const void* weight_rows = operands.Weight(v0, tv);
    float* weight_sum = nullptr;
    if (grad_weight != nullptr) {
      weight_sum = s.bf16 ? w.sums.grad_weight : static_cast<float*>(grad_weight) + v0 * s.h;
      if (s.bf16) FillZero(weight_sum, tv, s.h, parallel_for);
    }
    for (int64_t n0 = 0; n0 < s.n; n0 += s.tn) {
      const int64_t tn = std::min(s.tn, s.n - n0);
      // With one vocabulary chunk a bfloat16 hidden gradient is finished chunk by chunk.
      const bool hidden_by_chunk = hidden_sum != nullptr && s.bf16 && one_vocab_chunk;
      if (!has_targets[n0 / s.tn]) {
        if (hidden_by_chunk) {
          std::memset(static_cast<BFloat16*>(grad_hidden) + n0 * s.h, 0,
                      tn * s.h * sizeof(BFloat16));
        }
        continue;
      }
      const void* hidden_rows = operands.Hidden(n0, tn);
      Gemm(false, true, tn, tv, s.h, hidden_rows, s.h, weight_rows, s.h, 0.0f, w.tile, tv, input);
      parallel_for(tn, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const int64_t i = n0 + r;
          const int64_t target = targets[i];
          float* row = w.tile + r * tv;
          if (target == problem.ignore_index) {
            std::fill(row, row + tv, 0.0f);
            continue;
          }
          const bool target_here = target >= v0 && target < v0 + tv;
          const float target_logit = target_here ? row[target - v0] : 0.0f;
          GradientRow(row, tv, lse[i], grad_scale * (1.0f + 2.0f * problem.z_loss_weight * lse[i]),
                      cap);
          if (target_here) {
            const float t = cap > 0.0f ? Tanh(target_logit / cap) : 0.0f;
            row[target - v0] -= grad_scale * (1.0f - t * t);
          }
        }
      });
      if (hidden_sum != nullptr) {
        float* rows = hidden_by_chunk ? hidden_sum : hidden_sum + n0 * s.h;
        Gemm(false, false, tn, s.h, tv, operands.Gradient(w.tile, tn, tv), tv, weight_rows, s.h,
             hidden_by_chunk ? 0.0f : 1.0f, rows, s.h, input);
        if (hidden_by_chunk) {
          StoreRows(rows, static_cast<BFloat16*>(grad_hidden) + n0 * s.h, tn, s.h, parallel_for);
        }
      }
      if (weight_sum != nullptr) {
        Gemm(true, false, tv, s.h, tn, w.tile, tv, hidden_rows, s.h, 1.0f, weight_sum, s.h);
      }
    }
    if (weight_sum != nullptr && s.bf16) {
      StoreRows(weight_sum, static_cast<BFloat16*>(grad_weight) + v0 * s.h, tv, s.h, parallel_for);
    }
  }
  if (hidden_sum != nullptr && s.bf16 && !one_vocab_chunk) {
    StoreRows(hidden_sum, static_cast<BFloat16*>(grad_hidden), s.n, s.h, parallel_for);
  }
}

double LinearCrossEntropySinglePass(const LinearCrossEntropyProblem& problem, int64_t token_chunk,
                                    const void* hidden, const int64_t* targets, const void* weight,
                                    float grad_scale, float* lse, void* grad_hidden,
                                    void* grad_weight, void* workspace,
                                    const ParallelFor& parallel_for) {
  const Sizes s(problem, {token_chunk, problem.vocab});
  WorkspaceLayout layout(workspace);
  float* tile = CarveSinglePass(s, layout);
  const float* w = static_cast<const float*>(weight);
  float* dh = static_cast<float*>(grad_hidden);
  float* dw = static_cast<float*>(grad_weight);
  if (dw != nullptr) FillZero(dw, s.v, s.h, parallel_for);
  if (s.n == 0) return 0.0;
  const std::vector<char> has_targets = ChunksWithTargets(s, targets, problem.ignore_index);
  const float cap = problem.softcap;
  std::vector<double> row_loss(s.n, 0.0);

  for (int64_t n0 = 0; n0 < s.n; n0 += s.tn) {
    const int64_t tn = std::min(s.tn, s.n - n0);
    if (!has_targets[n0 / s.tn]) {
      std::fill(lse + n0, lse + n0 + tn, 0.0f);
      if (dh != nullptr) FillZero(dh + n0 * s.h, tn, s.h, parallel_for);
      continue;
    }
    const float* h = static_cast<const float*>(hidden) + n0 * s.h;
    Gemm(false, true, tn, s.v, s.h, h, s.h, w, s.h, 0.0f, tile, s.v);
    parallel_for(tn, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t i = n0 + r;
        const int64_t target = targets[i];
        float* row = tile + r * s.v;
        if (target == problem.ignore_index) {
          lse[i] = 0.0f;
          std::fill(row, row + s.v, 0.0f);
          continue;
        }
        if (cap > 0.0f) SoftCapRow(row, s.v, cap);
        const float target_logit = row[target];
        const float max = RowMax(row, s.v);
        // The row becomes exp(z - max) dz/dlogit; the softmax is that over the sum.
        const float sum =
            cap > 0.0f ? RowExpSlopeInPlace(row, s.v, max, cap) : RowExpInPlace(row, s.v, max);
        const float row_lse = max + std::log(sum);
        ScaleRow(row, s.v, grad_scale * (1.0f + 2.0f * problem.z_loss_weight * row_lse) / sum);
        const float t = cap > 0.0f ? target_logit / cap : 0.0f;
        row[target] -= grad_scale * (1.0f - t * t);
        lse[i] = row_lse;
        row_loss[i] = static_cast<double>(row_lse) - target_logit +
                      static_cast<double>(problem.z_loss_weight) * row_lse * row_lse;
      }
    });
    if (dh != nullptr) {
      Gemm(false, false, tn, s.h, s.v, tile, s.v, w, s.h, 0.0f, dh + n0 * s.h, s.h);
    }
    if (dw != nullptr) Gemm(true, false, s.v, s.h, tn, tile, s.v, h, s.h, 1.0f, dw, s.h);
  }
  double loss = 0.0;
  for (int64_t i = 0; i < s.n; ++i) loss += row_loss[i];
  return loss;
}

}  // namespace lathe::kernels::cpu
