#include "kernels/ops/swiglu.h"

#include "kernels/cpu/swiglu.h"
#include "kernels/ops/kernel_dispatch.h"

#ifdef LATHE_TORCH_CUDA
#include "kernels/cuda/swiglu.h"
#endif

namespace lathe::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows and columns of the flattened [rows, cols] view of t (a 0-d tensor is one element).
std::pair<int64_t, int64_t> RowsCols(const at::Tensor& t) {
  const int64_t cols = t.dim() == 0 ? 1 : t.size(-1);
  return {cols == 0 ? 0 : t.numel() / cols, cols};
}

// The gated activations of kernels/cpu/swiglu.h, by which one.
enum class Gate { kSilu, kGeluTanh };

template <Gate kGate>
class GluFunction : public torch::autograd::Function<GluFunction<kGate>> {
 public:
  static constexpr const char* kName = kGate == Gate::kSilu ? "SwiGlu" : "GeGlu";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    TORCH_CHECK(gate.sizes() == up.sizes(), kName, ": gate ", gate.sizes(), " and up ", up.sizes(),
                " differ in shape");
    TORCH_CHECK(gate.scalar_type() == up.scalar_type(), kName, ": gate is ", gate.scalar_type(),
                " but up is ", up.scalar_type());
    const at::Tensor g = gate.contiguous();
    const at::Tensor u = up.contiguous();
    const auto [rows, cols] = RowsCols(g);
    at::Tensor y = at::empty_like(g);
    DispatchKernelType(g.scalar_type(), kName, [&](auto tag) {
      using T = decltype(tag);
#ifdef LATHE_TORCH_CUDA
      if (g.is_cuda()) {
        const c10::cuda::CUDAGuard device_guard(g.device());
        if constexpr (kGate == Gate::kSilu) {
          C10_CUDA_CHECK(kernels::cuda::SwiGluForward(
              Data<T>(g), Data<T>(u), g.numel(), MutableData<T>(y), CurrentStream(g.device())));
        } else {
          C10_CUDA_CHECK(kernels::cuda::GeGluForward(Data<T>(g), Data<T>(u), g.numel(),
                                                     MutableData<T>(y), CurrentStream(g.device())));
        }
        return;
      }
#endif
      at::parallel_for(0, rows, RowGrain(cols), [&](int64_t begin, int64_t end) {
        if constexpr (kGate == Gate::kSilu) {
          kernels::cpu::SwiGluForward(Data<T>(g), Data<T>(u), cols, begin, end, MutableData<T>(y));
        } else {
          kernels::cpu::GeGluForward(Data<T>(g), Data<T>(u), cols, begin, end, MutableData<T>(y));
        }
      });
    });
    ctx->save_for_backward({g, u});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& g = saved[0];
    const at::Tensor& u = saved[1];
    const at::Tensor dy = grads[0].to(g.scalar_type()).contiguous();
    const auto [rows, cols] = RowsCols(g);
    at::Tensor dgate = at::empty_like(g);
    at::Tensor dup = at::empty_like(u);
    DispatchKernelType(g.scalar_type(), kName, [&](auto tag) {
      using T = decltype(tag);
#ifdef LATHE_TORCH_CUDA
      if (g.is_cuda()) {
        const c10::cuda::CUDAGuard device_guard(g.device());
        if constexpr (kGate == Gate::kSilu) {
          C10_CUDA_CHECK(kernels::cuda::SwiGluBackward(
              Data<T>(dy), Data<T>(g), Data<T>(u), g.numel(), MutableData<T>(dgate),
              MutableData<T>(dup), CurrentStream(g.device())));
        } else {
          C10_CUDA_CHECK(kernels::cuda::GeGluBackward(
              Data<T>(dy), Data<T>(g), Data<T>(u), g.numel(), MutableData<T>(dgate),
              MutableData<T>(dup), CurrentStream(g.device())));
        }
        return;
      }
#endif
      at::parallel_for(0, rows, RowGrain(cols), [&](int64_t begin, int64_t end) {
        if constexpr (kGate == Gate::kSilu) {
          kernels::cpu::SwiGluBackward(Data<T>(dy), Data<T>(g), Data<T>(u), cols, begin, end,
                                       MutableData<T>(dgate), MutableData<T>(dup));
        } else {
          kernels::cpu::GeGluBackward(Data<T>(dy), Data<T>(g), Data<T>(u), cols, begin, end,
                                      MutableData<T>(dgate), MutableData<T>(dup));
        }
      });
    });
    return {dgate, dup};
  }
};

}  // namespace

at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up) {
  return GluFunction<Gate::kSilu>::apply(gate, up);
}

at::Tensor GeGlu(const at::Tensor& gate, const at::Tensor& up) {
  return GluFunction<Gate::kGeluTanh>::apply(gate, up);
}

}  // namespace lathe::kernels
