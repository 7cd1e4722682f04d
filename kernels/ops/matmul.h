// Matrix products of 2-D tensors for the ops and the engine: float32 (and, where the CPU
// multiplies it natively, bfloat16) CPU tensors go through kernels/cpu/matmul.h (oneDNN),
// small products (under 64^3 multiply-adds) and everything else through ATen
// (docs/kernels.md, "Matrix products").
//
// Thread-safety: as any ATen op.
#ifndef LATHE_KERNELS_OPS_MATMUL_H_
#define LATHE_KERNELS_OPS_MATMUL_H_

#include <cstdint>
#include <string>

#include "kernels/ops/torch_compat.h"

namespace lathe::kernels {

// out = alpha * a b + beta * out. a: [m, k], b: [k, n], out: [m, n], all of one dtype, or a
// and b bfloat16 into a float32 out (float32 accumulation); beta 0 ignores out's old
// contents.
void MatmulOut(at::Tensor out, const at::Tensor& a, const at::Tensor& b, double alpha = 1.0,
               double beta = 0.0);

// Whether a product of m x k by k x n in bfloat16 runs natively (bf16 x bf16, float32
// accumulation): the CPU multiplies bfloat16 (kernels/cpu/matmul.h) and the product is large
// enough for the kernel.
bool NativeBFloat16Product(int64_t m, int64_t n, int64_t k);

// What runs the products on `device`, for reports: kernels/cpu/matmul.h's MatmulBackend() on
// the CPU, "aten" elsewhere or with LATHE_CPU_ONEDNN=0.
std::string ProductsBackend(const at::Device& device);

// The FLOPs and seconds of the CPU kernel's products so far in this process (its tally,
// kernels/cpu/matmul.h), of float32 or of bfloat16 inputs: what the trainer's per-phase
// product report reads.
struct ProductsSoFar {
  double flops = 0.0;
  double seconds = 0.0;
};
ProductsSoFar CpuProductsSoFar(bool bf16);

// a b as a new tensor of a's dtype (a: [m, k], b: [k, n]).
at::Tensor Matmul(const at::Tensor& a, const at::Tensor& b);

// The batched product of attention, a b for a: [..., m, k] and b: [..., k, n] with the same
// leading dimensions (no broadcasting), as an autograd node: one MatmulOut per matrix, in
// forward and in backward (da = g b^T, db = a^T g). Views are read in place (a transposed
// key, a head's slice of the projections). Saves a and b. With `bf16` (a bf16 job's float32
// activations) and NativeBFloat16Product(m, n, k), a, b and in backward g are rounded to
// bfloat16 for the products (float32 accumulation and results), and the bfloat16 copies are
// what is saved; with `keep_a` (a is kept alive anyway, as the softmax keeps its output), a
// itself is saved and rounded again in backward, rather than a second, bfloat16 copy.
at::Tensor BatchedMatmul(const at::Tensor& a, const at::Tensor& b, bool bf16 = false,
                         bool keep_a = false);

}  // namespace lathe::kernels

#endif  // LATHE_KERNELS_OPS_MATMUL_H_
