#include "kernels/ops/matmul.h"

#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cpu/matmul.h"

namespace lathe::kernels {
namespace {

// How the CPU kernel reads a 2-D tensor: as rows `ld` elements apart, or (transposed) as
// the rows of its transpose. False when neither way reads it.
bool Layout(const at::Tensor& t, bool* transposed, int64_t* ld) {
  const int64_t rows = t.size(0), cols = t.size(1);
  if (t.stride(1) == 1 || cols == 1) {
    *transposed = false;
    *ld = rows == 1 ? cols : t.stride(0);
    return *ld >= cols;
  }
  if (t.stride(0) == 1 || rows == 1) {
    *transposed = true;
    *ld = cols == 1 ? rows : t.stride(1);
    return *ld >= rows;
  }
  return false;
}

// Below this many multiply-adds a product stays with ATen: oneDNN's fixed cost per call
// (about 4 us: the primitive's lookup, memory objects, the scratchpad) exceeds OpenBLAS's
// whole product under about 64^3.
constexpr int64_t kMinKernelProduct = int64_t{1} << 18;

// Whether the CPU kernel multiplies tensors of `type`. LATHE_CPU_ONEDNN=0 sends every product
// to ATen instead (a diagnostic: the same step with OpenBLAS's products, for comparisons in
// one script).
bool KernelMultiplies(at::ScalarType type) {
  static const bool disabled = [] {
    const char* env = std::getenv("LATHE_CPU_ONEDNN");
    return env != nullptr && std::string(env) == "0";
  }();
  return !disabled &&
         (type == at::kFloat || (type == at::kBFloat16 && cpu::NativeBFloat16Products()));
}

}  // namespace

void MatmulOut(at::Tensor out, const at::Tensor& a, const at::Tensor& b, double alpha,
               double beta) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 2 && a.size(1) == b.size(0) &&
                  out.size(0) == a.size(0) && out.size(1) == b.size(1),
              "MatmulOut: ", out.sizes(), " = ", a.sizes(), " x ", b.sizes());
  cpu::MatmulProblem p;
  p.m = a.size(0);
  p.k = a.size(1);
  p.n = b.size(1);
  bool out_transposed = false;
  const bool kernel = p.m * p.n * p.k >= kMinKernelProduct && a.device().is_cpu() &&
                      b.device().is_cpu() && out.device().is_cpu() &&
                      a.scalar_type() == b.scalar_type() && KernelMultiplies(a.scalar_type()) &&
                      out.scalar_type() == at::kFloat && Layout(a, &p.trans_a, &p.lda) &&
                      Layout(b, &p.trans_b, &p.ldb) && Layout(out, &out_transposed, &p.ldc) &&
                      !out_transposed;
  if (!kernel) {
    // bfloat16 inputs into a float32 output (a small product of the bf16 path) multiply
    // widened.
    const at::Tensor aw = a.scalar_type() == out.scalar_type() ? a : a.to(out.scalar_type());
    const at::Tensor bw = b.scalar_type() == out.scalar_type() ? b : b.to(out.scalar_type());
    if (beta == 0.0) {
      at::mm_out(out, aw, bw);
      if (alpha != 1.0) out.mul_(alpha);
    } else {
      out.addmm_(aw, bw, beta, alpha);
    }
    return;
  }
  p.input =
      a.scalar_type() == at::kBFloat16 ? cpu::MatmulInput::kBFloat16 : cpu::MatmulInput::kFloat32;
  cpu::Matmul(p, a.data_ptr(), b.data_ptr(), out.data_ptr<float>(), static_cast<float>(alpha),
              static_cast<float>(beta));
}

namespace {

// Calls fn once per matrix of tensors [..., rows, cols] that share their leading dimensions,
// with the 2-D views (`select` along each leading dimension) of every tensor.
void ForEachMatrix(const std::vector<at::Tensor>& tensors,
                   const std::function<void(const std::vector<at::Tensor>&)>& fn) {
  if (tensors[0].dim() == 2) {
    fn(tensors);
    return;
  }
  for (int64_t i = 0; i < tensors[0].size(0); ++i) {
    std::vector<at::Tensor> selected;
    for (const at::Tensor& t : tensors) selected.push_back(t.select(0, i));
    ForEachMatrix(selected, fn);
  }
}

class BatchedMatmulFunction : public torch::autograd::Function<BatchedMatmulFunction> {
 public:
  // `bf16`: a and b are rounded to bfloat16 (and kept so for backward, which rounds the
  // incoming gradient too; a as it is with `keep_a`, rounded again there).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a_in,
                            const at::Tensor& b_in, bool bf16, bool keep_a) {
    const at::Tensor a = bf16 ? a_in.to(at::kBFloat16) : a_in;
    const at::Tensor b = bf16 ? b_in.to(at::kBFloat16) : b_in;
    std::vector<int64_t> sizes = a.sizes().vec();
    sizes.back() = b.size(-1);
    at::Tensor out = at::empty(sizes, a_in.options());
    ForEachMatrix({out, a, b},
                  [](const std::vector<at::Tensor>& m) { MatmulOut(m[0], m[1], m[2]); });
    ctx->save_for_backward({keep_a ? a_in : a, b});
    ctx->saved_data["a_grad"] = a_in.requires_grad();
    ctx->saved_data["b_grad"] = b_in.requires_grad();
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor& b = saved[1];
    const at::Tensor a = saved[0].to(b.scalar_type());  // rounded again, when kept as it was
    const at::Tensor g = grads[0].to(b.scalar_type());  // rounded, when a and b are bf16
    at::Tensor da, db;
    const at::TensorOptions options = grads[0].options();
    if (ctx->saved_data["a_grad"].toBool()) da = at::empty(a.sizes(), options);
    if (ctx->saved_data["b_grad"].toBool()) db = at::empty(b.sizes(), options);
    ForEachMatrix({g, a, b, da.defined() ? da : grads[0], db.defined() ? db : grads[0]},
                  [&](const std::vector<at::Tensor>& m) {
                    if (da.defined()) MatmulOut(m[3], m[0], m[2].t());
                    if (db.defined()) MatmulOut(m[4], m[1].t(), m[0]);
                  });
    return {da, db, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor BatchedMatmul(const at::Tensor& a, const at::Tensor& b, bool bf16, bool keep_a) {
  TORCH_CHECK(a.dim() >= 2 && a.dim() == b.dim() && a.size(-1) == b.size(-2) &&
                  a.sizes().slice(0, a.dim() - 2) == b.sizes().slice(0, b.dim() - 2),
              "BatchedMatmul: ", a.sizes(), " x ", b.sizes());
  if (!a.device().is_cpu() || a.scalar_type() != at::kFloat || b.scalar_type() != at::kFloat) {
    return at::matmul(a, b);
  }
  return BatchedMatmulFunction::apply(
      a, b, bf16 && NativeBFloat16Product(a.size(-2), b.size(-1), a.size(-1)), keep_a);
}

std::string ProductsBackend(const at::Device& device) {
  return device.is_cpu() && KernelMultiplies(at::kFloat) ? cpu::MatmulBackend() : "aten";
}

ProductsSoFar CpuProductsSoFar(bool bf16) {
  const cpu::MatmulTally tally =
      cpu::MatmulTotal(bf16 ? cpu::MatmulInput::kBFloat16 : cpu::MatmulInput::kFloat32);
  return {tally.flops, tally.seconds};
}

bool NativeBFloat16Product(int64_t m, int64_t n, int64_t k) {
  return m * n * k >= kMinKernelProduct && KernelMultiplies(at::kBFloat16);
}

at::Tensor Matmul(const at::Tensor& a, const at::Tensor& b) {
  if (!a.device().is_cpu() || a.scalar_type() != at::kFloat) return at::mm(a, b);
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  MatmulOut(out, a, b);
  return out;
}

}  // namespace lathe::kernels
