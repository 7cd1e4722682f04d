// Matrix products on the CPU through oneDNN (docs/kernels.md, "Matrix products"): its brgemm
// kernels multiply bfloat16 natively on AVX512-BF16/AMX (about 2x float32, which Debian's
// OpenBLAS cannot), thread small-N products (LoRA's) that OpenBLAS leaves on one core, and
// match OpenBLAS's float32 elsewhere (1.0-1.15x on the development machine;
// bench/roofline_bench).
//
//   C = alpha * op(A) op(B) + beta * C
//
// row-major, op(X) = X or X^T, A and B of one input type (float32, or bfloat16 where the CPU
// multiplies it natively), accumulated and written in float32. Each distinct problem (sizes,
// transposes, leading dimensions, input type, whether alpha and beta are 1 and 0) builds its
// oneDNN primitive once and keeps it for the process (a few microseconds saved per call, and
// the JIT code generation of a new shape, ~1 ms, paid once).
//
// Threads: oneDNN's OpenMP runtime, the one libtorch's at::set_num_threads sets; inside an
// OpenMP parallel region a product runs on the calling thread.
// Thread-safety: every function may be called from several threads at once.
#ifndef LATHE_KERNELS_CPU_MATMUL_H_
#define LATHE_KERNELS_CPU_MATMUL_H_

#include <cstdint>
#include <string>

namespace lathe::kernels::cpu {

enum class MatmulInput { kFloat32, kBFloat16 };

struct MatmulProblem {
  int64_t m = 0, n = 0, k = 0;        // C is [m, n]; the products sum over k
  bool trans_a = false;               // A is given as [k, m] (lda >= m), else [m, k] (lda >= k)
  bool trans_b = false;               // B is given as [n, k] (ldb >= k), else [k, n] (ldb >= n)
  int64_t lda = 0, ldb = 0, ldc = 0;  // row strides, in elements
  MatmulInput input = MatmulInput::kFloat32;
};

// C = alpha op(A) op(B) + beta C. `a` and `b` point to floats or, for kBFloat16, to
// bfloat16 values (uint16_t bit patterns); `c` to floats. beta 0 ignores C's old contents
// (NaNs included). REQUIRES: valid sizes and strides; for kBFloat16,
// NativeBFloat16Products().
void Matmul(const MatmulProblem& problem, const void* a, const void* b, float* c,
            float alpha = 1.0f, float beta = 0.0f);

// Whether the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX) and the environment does
// not disable it (LATHE_CPU_BF16=0, to run the fallback on a machine that has it). Decided
// once per process.
bool NativeBFloat16Products();

// What Matmul has multiplied since the process started, for one input type: calls, FLOPs
// (2 m n k each) and wall seconds inside Matmul. Counted on every call (two clock reads, well
// under 1% of the smallest product the ops send here), so that reports can state the
// products' rate against the roofline (bench/train_bench.py, per training phase).
struct MatmulTally {
  int64_t calls = 0;
  double flops = 0.0;
  double seconds = 0.0;
};
MatmulTally MatmulTotal(MatmulInput input);

// What runs the products, for reports: e.g. "onednn f32 brg:avx512_core, bf16
// brg:avx512_core_bf16" or "onednn f32 brg:avx2, bf16 widened to f32".
std::string MatmulBackend();

}  // namespace lathe::kernels::cpu

#endif  // LATHE_KERNELS_CPU_MATMUL_H_
