#include "kernels/ops/rope.h"

#include "kernels/cpu/rope.h"
#include "kernels/ops/kernel_dispatch.h"

#ifdef LATHE_TORCH_CUDA
#include "kernels/cuda/rope.h"
#endif

namespace lathe::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// `t` itself when the kernels can read it in place (dense, last dimension contiguous), else a
// contiguous copy.
at::Tensor KernelReadable(const at::Tensor& t) {
  return t.is_non_overlapping_and_dense() && t.stride(3) == 1 ? t : t.contiguous();
}

kernels::RopeLayout LayoutOf(const at::Tensor& t) {
  kernels::RopeLayout layout;
  layout.batch = t.size(0);
  layout.heads = t.size(1);
  layout.seq = t.size(2);
  layout.head_dim = t.size(3);
  layout.batch_stride = t.stride(0);
  layout.head_stride = t.stride(1);
  layout.seq_stride = t.stride(2);
  return layout;
}

// out = RoPE(in), or its transpose, with out of in's strides.
at::Tensor RunRope(const at::Tensor& in, const at::Tensor& cos, const at::Tensor& sin,
                   bool transpose) {
  const kernels::RopeLayout layout = LayoutOf(in);
  at::Tensor out = at::empty_strided(in.sizes(), in.strides(), in.options());
  DispatchKernelType(in.scalar_type(), "Rope", [&](auto tag) {
    using T = decltype(tag);
#ifdef LATHE_TORCH_CUDA
    if (in.is_cuda()) {
      const c10::cuda::CUDAGuard device_guard(in.device());
      auto launch = transpose ? kernels::cuda::RopeBackward<T> : kernels::cuda::RopeForward<T>;
      C10_CUDA_CHECK(launch(Data<T>(in), Data<T>(cos), Data<T>(sin), layout, MutableData<T>(out),
                            CurrentStream(in.device())));
      return;
    }
#endif
    auto kernel = transpose ? kernels::cpu::RopeBackward<T> : kernels::cpu::RopeForward<T>;
    at::parallel_for(0, layout.rows(), RowGrain(layout.head_dim), [&](int64_t begin, int64_t end) {
      kernel(Data<T>(in), Data<T>(cos), Data<T>(sin), layout, begin, end, MutableData<T>(out));
    });
  });
  return out;
}

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    TORCH_CHECK(x.dim() == 4, "Rope: x must be [batch, heads, seq, head_dim], not ", x.sizes());
    const int64_t seq = x.size(2), head_dim = x.size(3);
    TORCH_CHECK(head_dim % 2 == 0 && head_dim > 0, "Rope: head_dim ", head_dim, " is not even");
    for (const at::Tensor* table : {&cos, &sin}) {
      TORCH_CHECK(table->dim() == 2 && table->size(0) == seq && table->size(1) == head_dim,
                  "Rope: table of shape ", table->sizes(), " for seq ", seq, " and head_dim ",
                  head_dim);
    }
    const at::Tensor c = cos.to(x.scalar_type()).contiguous();
    const at::Tensor s = sin.to(x.scalar_type()).contiguous();
    ctx->save_for_backward({c, s});
    return RunRope(KernelReadable(x), c, s, /*transpose=*/false);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& c = saved[0];
    const at::Tensor dy = KernelReadable(grads[0].to(c.scalar_type()));
    return {RunRope(dy, c, saved[1], /*transpose=*/true), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor Rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return RopeFunction::apply(x, cos, sin);
}

std::pair<at::Tensor, at::Tensor> ApplyRope(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& cos, const at::Tensor& sin) {
  return {Rope(q, cos, sin), Rope(k, cos, sin)};
}

}  // namespace lathe::kernels
