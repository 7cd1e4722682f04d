#include "kernels/ops/rms_norm.h"

#include "kernels/cpu/rms_norm.h"
#include "kernels/ops/kernel_dispatch.h"

#ifdef LATHE_TORCH_CUDA
#include "kernels/cuda/rms_norm.h"
#endif

namespace lathe::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "RmsNorm: x must have a non-empty last dim");
    const int64_t hidden = x.size(-1);
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden, "RmsNorm: weight of shape ",
                weight.sizes(), " for hidden size ", hidden);
    const at::Tensor input = x.contiguous();
    const at::Tensor w = weight.to(input.options().dtype(at::kFloat)).contiguous();
    const int64_t rows = input.numel() / hidden;
    at::Tensor y = at::empty_like(input);
    at::Tensor rstd = at::empty({rows}, input.options().dtype(at::kFloat));
    DispatchKernelType(input.scalar_type(), "RmsNorm", [&](auto tag) {
      using T = decltype(tag);
#ifdef LATHE_TORCH_CUDA
      if (input.is_cuda()) {
        const c10::cuda::CUDAGuard device_guard(input.device());
        C10_CUDA_CHECK(kernels::cuda::RmsNormForward(
            Data<T>(input), w.data_ptr<float>(), rows, hidden, static_cast<float>(eps),
            MutableData<T>(y), rstd.data_ptr<float>(), CurrentStream(input.device())));
        return;
      }
#endif
      at::parallel_for(0, rows, RowGrain(hidden), [&](int64_t begin, int64_t end) {
        kernels::cpu::RmsNormForward(Data<T>(input), w.data_ptr<float>(), hidden,
                                     static_cast<float>(eps), begin, end, MutableData<T>(y),
                                     rstd.data_ptr<float>());
      });
    });
    ctx->save_for_backward({input, weight, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& rstd = saved[2];
    const at::Tensor dy = grads[0].to(x.scalar_type()).contiguous();
    const at::Tensor w = weight.to(x.options().dtype(at::kFloat)).contiguous();
    const int64_t hidden = x.size(-1);
    const int64_t rows = x.numel() / hidden;
    const bool weight_grad = ctx->needs_input_grad(1);
    at::Tensor dx = at::empty_like(x);
    at::Tensor dw_partial;  // [chunks, hidden]: one partial sum per row range
    DispatchKernelType(x.scalar_type(), "RmsNorm backward", [&](auto tag) {
      using T = decltype(tag);
#ifdef LATHE_TORCH_CUDA
      if (x.is_cuda()) {
        const c10::cuda::CUDAGuard device_guard(x.device());
        if (weight_grad) {
          dw_partial =
              at::empty({kernels::cuda::RmsNormBackwardPartialRows(rows), hidden}, w.options());
        }
        C10_CUDA_CHECK(kernels::cuda::RmsNormBackward(
            Data<T>(dy), Data<T>(x), w.data_ptr<float>(), rstd.data_ptr<float>(), rows, hidden,
            MutableData<T>(dx), weight_grad ? dw_partial.data_ptr<float>() : nullptr,
            CurrentStream(x.device())));
        return;
      }
#endif
      if (!weight_grad) {
        at::parallel_for(0, rows, RowGrain(hidden), [&](int64_t begin, int64_t end) {
          kernels::cpu::RmsNormBackward(Data<T>(dy), Data<T>(x), w.data_ptr<float>(),
                                        rstd.data_ptr<float>(), hidden, begin, end,
                                        MutableData<T>(dx), nullptr);
        });
        return;
      }
      // One row range per thread, each with its own partial dweight.
      const int64_t chunks =
          std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows / RowGrain(hidden)));
      dw_partial = at::empty({chunks, hidden}, w.options());
      at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
        for (int64_t c = first; c < last; ++c) {
          kernels::cpu::RmsNormBackward(Data<T>(dy), Data<T>(x), w.data_ptr<float>(),
                                        rstd.data_ptr<float>(), hidden, rows * c / chunks,
                                        rows * (c + 1) / chunks, MutableData<T>(dx),
                                        dw_partial.data_ptr<float>() + c * hidden);
        }
      });
    });
    at::Tensor dweight;
    if (weight_grad) dweight = dw_partial.sum(0).to(weight.scalar_type());
    return {dx, dweight, at::Tensor()};
  }
};

}  // namespace

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormFunction::apply(x, weight, eps);
}

}  // namespace lathe::kernels
