#include "kernels/cuda/linear_cross_entropy.h"

#include <cublas_v2.h>

#include <algorithm>
#include <unordered_map>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/linear_cross_entropy_kernels.h"
#include "kernels/linear_cross_entropy_workspace.h"

namespace lathe::kernels::cuda {
namespace {

using Dtype = LinearCrossEntropyDtype;

#define LATHE_RETURN_IF_CUDA_ERROR(expr)                                                           \
  do {                                                                                             \
    const cudaError_t lathe_cuda_error = (expr);                                                   \
    if (lathe_cuda_error != cudaSuccess) {                                                         \
      return absl::InternalError(absl::StrCat(#expr, ": ", cudaGetErrorString(lathe_cuda_error))); \
    }                                                                                              \
  } while (false)

// This thread's cuBLAS handle for the current device, bound to `stream`. Handles are kept for
// the life of the thread and never destroyed: destroying one after the CUDA context is gone
// (at exit) crashes.
absl::StatusOr<cublasHandle_t> Handle(cudaStream_t stream) {
  int device = 0;
  const cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaGetDevice: ", cudaGetErrorString(error)));
  }
  thread_local std::unordered_map<int, cublasHandle_t> handles;
  auto it = handles.find(device);
  if (it == handles.end()) {
    cublasHandle_t handle = nullptr;
    const cublasStatus_t status = cublasCreate(&handle);
    if (status != CUBLAS_STATUS_SUCCESS) {
      return absl::InternalError(absl::StrCat("cublasCreate: ", cublasGetStatusString(status)));
    }
    it = handles.emplace(device, handle).first;
  }
  const cublasStatus_t status = cublasSetStream(it->second, stream);
  if (status != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cublasSetStream: ", cublasGetStatusString(status)));
  }
  return it->second;
}

cudaDataType DataType(Dtype dtype) { return dtype == Dtype::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F; }

absl::Status CheckOneDtype(const LinearCrossEntropyProblem& problem) {
  if (problem.dtype == Dtype::kFloat32HiddenBFloat16Weight) {
    return absl::InvalidArgumentError(
        "float32 hidden with a bfloat16 weight has no CUDA kernel (the CPU's only)");
  }
  return absl::OkStatus();
}

// Column-major C [m, n] = op(A) op(B) + beta C, A and B of `type`, C float32, computed in
// float32 (no TF32). The callers pass row-major matrices as their column-major transposes.
absl::Status Gemm(cublasHandle_t handle, cublasOperation_t op_a, cublasOperation_t op_b, int64_t m,
                  int64_t n, int64_t k, const void* a, int64_t lda, const void* b, int64_t ldb,
                  cudaDataType type, float beta, float* c, int64_t ldc) {
  const float alpha = 1.0f;
  const cublasStatus_t status = cublasGemmEx(
      handle, op_a, op_b, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &alpha, a,
      type, static_cast<int>(lda), b, type, static_cast<int>(ldb), &beta, c, CUDA_R_32F,
      static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (status != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cublasGemmEx [", m, ", ", n, ", ", k, "]: ", cublasGetStatusString(status)));
  }
  return absl::OkStatus();
}

// Each array starts on a 256-byte boundary of the (256-byte aligned) workspace, as cudaMalloc
// would place it.
using WorkspaceLayout = LinearCrossEntropyWorkspaceLayout<256>;
using Sizes = LinearCrossEntropySizes;

struct ForwardWorkspace {
  float* tile;
  float* row_max;
  float* row_sum;
  float* row_target;
};

ForwardWorkspace CarveForward(const Sizes& s, WorkspaceLayout& layout) {
  ForwardWorkspace w;
  w.tile = layout.Take<float>(s.tn * s.tv);
  w.row_max = layout.Take<float>(s.n);
  w.row_sum = layout.Take<float>(s.n);
  w.row_target = layout.Take<float>(s.n);
  return w;
}

struct BackwardWorkspace {
  float* tile;
  uint16_t* tile_bf16;  // bfloat16 only: the gradient chunk for the products
  LinearCrossEntropyGradientSums sums;
};

BackwardWorkspace CarveBackward(const Sizes& s, bool grad_hidden, bool grad_weight,
                                WorkspaceLayout& layout) {
  BackwardWorkspace w{};
  w.tile = layout.Take<float>(s.tn * s.tv);
  if (s.bf16) w.tile_bf16 = layout.Take<uint16_t>(s.tn * s.tv);
  w.sums = TakeGradientSums(s, grad_hidden, grad_weight, layout);
  return w;
}

}  // namespace

int64_t LinearCrossEntropyForwardWorkspaceBytes(const LinearCrossEntropyProblem& problem,
                                                const LinearCrossEntropyChunks& chunks) {
  WorkspaceLayout layout(nullptr);
  CarveForward(Sizes(problem, chunks), layout);
  return layout.bytes();
}

int64_t LinearCrossEntropyBackwardWorkspaceBytes(const LinearCrossEntropyProblem& problem,
                                                 const LinearCrossEntropyChunks& chunks,
                                                 bool grad_hidden, bool grad_weight) {
  WorkspaceLayout layout(nullptr);
  CarveBackward(Sizes(problem, chunks), grad_hidden, grad_weight, layout);
  return layout.bytes();
}

absl::Status LinearCrossEntropyForward(const LinearCrossEntropyProblem& problem,
                                       const LinearCrossEntropyChunks& chunks, const void* hidden,
                                       const int64_t* targets, const void* weight, float* lse,
                                       float* loss, void* workspace, cudaStream_t stream) {
  LATHE_RETURN_IF_ERROR(CheckOneDtype(problem));
  const Sizes s(problem, chunks);
  if (s.n == 0) {
    LATHE_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(loss, 0, sizeof(float), stream));
    return absl::OkStatus();
  }
  LATHE_ASSIGN_OR_RETURN(cublasHandle_t handle, Handle(stream));
  WorkspaceLayout layout(workspace);
  const ForwardWorkspace w = CarveForward(s, layout);
  const cudaDataType type = DataType(problem.dtype);

  for (int64_t v0 = 0; v0 < s.v; v0 += s.tv) {
    const int64_t tv = std::min(s.tv, s.v - v0);
    for (int64_t n0 = 0; n0 < s.n; n0 += s.tn) {
      const int64_t tn = std::min(s.tn, s.n - n0);
      // tile [tn, tv] = hidden rows x weight rows^T; column-major: tile^T = W h^T.
      LATHE_RETURN_IF_ERROR(Gemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, tv, tn, s.h, s.Row(weight, v0),
                                 s.h, s.Row(hidden, n0), s.h, type, 0.0f, w.tile, tv));
      LATHE_RETURN_IF_CUDA_ERROR(internal::LaunchChunkLogSumExp(
          w.tile, tn, tv, n0, v0, targets, problem.ignore_index, problem.softcap, v0 == 0,
          w.row_max, w.row_sum, w.row_target, stream));
    }
  }
  LATHE_RETURN_IF_CUDA_ERROR(
      internal::LaunchFinishForward(s.n, targets, problem.ignore_index, problem.z_loss_weight,
                                    w.row_max, w.row_sum, w.row_target, lse, loss, stream));
  return absl::OkStatus();
}

absl::Status LinearCrossEntropyBackward(const LinearCrossEntropyProblem& problem,
                                        const LinearCrossEntropyChunks& chunks, const void* hidden,
                                        const int64_t* targets, const void* weight,
                                        const float* lse, const float* grad_scale,
                                        void* grad_hidden, void* grad_weight, void* workspace,
                                        cudaStream_t stream) {
  LATHE_RETURN_IF_ERROR(CheckOneDtype(problem));
  const Sizes s(problem, chunks);
  if (grad_hidden == nullptr && grad_weight == nullptr) return absl::OkStatus();
  LATHE_ASSIGN_OR_RETURN(cublasHandle_t handle, Handle(stream));
  WorkspaceLayout layout(workspace);
  const BackwardWorkspace w =
      CarveBackward(s, grad_hidden != nullptr, grad_weight != nullptr, layout);
  const cudaDataType type = DataType(problem.dtype);
  const bool one_vocab_chunk = s.vocab_chunks() == 1;
  // The gradient chunk the products read: the tile itself in float32, its bfloat16 copy
  // otherwise (cuBLAS wants both factors of one type).
  const void* gradient = s.bf16 ? static_cast<const void*>(w.tile_bf16) : w.tile;

  // Float32 gradients accumulate in the outputs; bfloat16 ones in the workspace, rounded into
  // the outputs once complete.
  float* hidden_sum = nullptr;
  if (grad_hidden != nullptr) {
    hidden_sum = s.bf16 ? w.sums.grad_hidden : static_cast<float*>(grad_hidden);
    if (!s.bf16 || !one_vocab_chunk) {
      LATHE_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(hidden_sum, 0, s.n * s.h * sizeof(float), stream));
    }
  }
  if (grad_weight != nullptr && !s.bf16) {
    LATHE_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(grad_weight, 0, s.v * s.h * sizeof(float), stream));
  }

  for (int64_t v0 = 0; v0 < s.v; v0 += s.tv) {
    const int64_t tv = std::min(s.tv, s.v - v0);
    float* weight_sum = nullptr;
    if (grad_weight != nullptr) {
      weight_sum = s.bf16 ? w.sums.grad_weight : static_cast<float*>(grad_weight) + v0 * s.h;
      if (s.bf16) {
        LATHE_RETURN_IF_CUDA_ERROR(
            cudaMemsetAsync(weight_sum, 0, tv * s.h * sizeof(float), stream));
      }
    }
    for (int64_t n0 = 0; n0 < s.n; n0 += s.tn) {
      const int64_t tn = std::min(s.tn, s.n - n0);
      LATHE_RETURN_IF_ERROR(Gemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, tv, tn, s.h, s.Row(weight, v0),
                                 s.h, s.Row(hidden, n0), s.h, type, 0.0f, w.tile, tv));
      LATHE_RETURN_IF_CUDA_ERROR(internal::LaunchChunkGradient(
          w.tile, w.tile_bf16, tn, tv, n0, v0, targets, problem.ignore_index, lse, grad_scale,
          problem.z_loss_weight, problem.softcap, stream));
      if (hidden_sum != nullptr) {
        // dH rows [tn, H] += G [tn, tv] x W rows [tv, H]; column-major: dH^T += W^T G^T.
        const bool by_chunk = s.bf16 && one_vocab_chunk;
        float* rows = by_chunk ? hidden_sum : hidden_sum + n0 * s.h;
        LATHE_RETURN_IF_ERROR(Gemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, s.h, tn, tv, s.Row(weight, v0),
                                   s.h, gradient, tv, type, by_chunk ? 0.0f : 1.0f, rows, s.h));
        if (by_chunk) {
          LATHE_RETURN_IF_CUDA_ERROR(internal::LaunchFloatToBFloat16(
              rows, static_cast<uint16_t*>(grad_hidden) + n0 * s.h, tn * s.h, stream));
        }
      }
      if (weight_sum != nullptr) {
        // dW rows [tv, H] += G^T [tv, tn] x hidden rows [tn, H]; column-major: dW^T += h^T G.
        LATHE_RETURN_IF_ERROR(Gemm(handle, CUBLAS_OP_N, CUBLAS_OP_T, s.h, tv, tn, s.Row(hidden, n0),
                                   s.h, gradient, tv, type, 1.0f, weight_sum, s.h));
      }
    }
    if (weight_sum != nullptr && s.bf16) {
      LATHE_RETURN_IF_CUDA_ERROR(internal::LaunchFloatToBFloat16(
          weight_sum, static_cast<uint16_t*>(grad_weight) + v0 * s.h, tv * s.h, stream));
    }
  }
  if (hidden_sum != nullptr && s.bf16 && !one_vocab_chunk) {
    LATHE_RETURN_IF_CUDA_ERROR(internal::LaunchFloatToBFloat16(
        hidden_sum, static_cast<uint16_t*>(grad_hidden), s.n * s.h, stream));
  }
  return absl::OkStatus();
}

}  // namespace lathe::kernels::cuda
