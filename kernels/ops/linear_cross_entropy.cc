#include "kernels/ops/linear_cross_entropy.h"

#include <algorithm>
#include <cstdint>
#include <functional>

#include "kernels/cpu/linear_cross_entropy.h"
#include "kernels/ops/torch_compat.h"

#if LATHE_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/linear_cross_entropy.h"
#endif

namespace lathe::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Indices of what forward saves.
enum Saved { kHidden, kWeight, kTargets, kLse, kCount, kGradHidden, kGradWeight };

LinearCrossEntropyProblem MakeProblem(const at::Tensor& hidden, const at::Tensor& weight,
                                      const LinearCrossEntropyOptions& options) {
  LinearCrossEntropyProblem problem;
  problem.tokens = hidden.size(0);
  problem.hidden_size = hidden.size(1);
  problem.vocab = weight.size(0);
  problem.dtype = hidden.scalar_type() == at::kBFloat16 ? LinearCrossEntropyDtype::kBFloat16
                  : weight.scalar_type() == at::kBFloat16
                      ? LinearCrossEntropyDtype::kFloat32HiddenBFloat16Weight
                      : LinearCrossEntropyDtype::kFloat32;
  problem.ignore_index = options.ignore_index;
  problem.softcap = static_cast<float>(options.softcap);
  problem.z_loss_weight = static_cast<float>(options.z_loss_weight);
  return problem;
}

LinearCrossEntropyChunks ChooseChunks(
    const LinearCrossEntropyProblem& problem, const LinearCrossEntropyOptions& options,
    const std::function<int64_t(const LinearCrossEntropyChunks&)>& workspace_bytes) {
  LinearCrossEntropyChunks chunks =
      ChooseLinearCrossEntropyChunks(problem, options.memory_budget_bytes, workspace_bytes);
  if (options.token_chunk > 0) chunks.tokens = options.token_chunk;
  if (options.vocab_chunk > 0) chunks.vocab = options.vocab_chunk;
  return chunks;
}

// Scratch memory comes from libtorch's allocator, so the engine's memory tracker (and on CUDA
// the caching allocator) sees it.
at::Tensor Workspace(int64_t bytes, const at::Tensor& like) {
  at::Tensor workspace = at::empty({bytes}, like.options().dtype(at::kByte));
  TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(workspace.data_ptr()) % 64 == 0,
                        "LinearCrossEntropy: workspace not 64-byte aligned");
  return workspace;
}

void AtenParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  // A row is at least hundreds of elements: one is worth a task.
  at::parallel_for(0, n, 1, body);
}

void CheckInputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                 const LinearCrossEntropyOptions& options) {
  TORCH_CHECK(hidden.dim() == 2, "LinearCrossEntropy: hidden must be [tokens, hidden], got ",
              hidden.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden.size(1),
              "LinearCrossEntropy: weight must be [vocab, ", hidden.size(1), "], got ",
              weight.sizes());
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0),
              "LinearCrossEntropy: targets must be [", hidden.size(0), "], got ", targets.sizes());
  const bool bf16_weight_only =
      hidden.scalar_type() == at::kFloat && weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK((hidden.scalar_type() == weight.scalar_type() &&
               (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16)) ||
                  bf16_weight_only,
              "LinearCrossEntropy: hidden and weight must both be float32 or both bfloat16 (or "
              "float32 hidden with a bfloat16 weight), got ",
              hidden.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(!bf16_weight_only || !weight.requires_grad(),
              "LinearCrossEntropy: a bfloat16 weight with float32 hidden must not require grad "
              "(no weight gradient for that mix)");
  TORCH_CHECK(!bf16_weight_only || hidden.is_cpu(),
              "LinearCrossEntropy: float32 hidden with a bfloat16 weight runs on the CPU only, "
              "got device ",
              hidden.device());
  TORCH_CHECK(!at::isFloatingType(targets.scalar_type()) && targets.scalar_type() != at::kBool,
              "LinearCrossEntropy: targets must be integers, got ", targets.scalar_type());
  TORCH_CHECK(hidden.device() == weight.device() && hidden.device() == targets.device(),
              "LinearCrossEntropy: hidden, weight and targets must be on one device, got ",
              hidden.device(), ", ", weight.device(), " and ", targets.device());
  TORCH_CHECK(options.softcap >= 0.0, "LinearCrossEntropy: softcap must be >= 0, got ",
              options.softcap);
  TORCH_CHECK(options.memory_budget_bytes > 0,
              "LinearCrossEntropy: memory_budget_bytes must be > 0, got ",
              options.memory_budget_bytes);
  if (targets.numel() > 0) {
    const bool valid =
        (targets.eq(options.ignore_index) | (targets.ge(0) & targets.lt(weight.size(0))))
            .all()
            .item<bool>();
    TORCH_CHECK(valid, "LinearCrossEntropy: every target must be ", options.ignore_index,
                " (ignored) or in [0, ", weight.size(0), ")");
  }
}

struct ForwardResult {
  at::Tensor loss_sum;  // 0-dim float32
  at::Tensor lse;       // [N] float32
};

// With grad_hidden defined (CPU only), also writes grad_scale times the hidden gradient of the
// summed loss into it.
ForwardResult Forward(const LinearCrossEntropyProblem& problem,
                      const LinearCrossEntropyOptions& options, const at::Tensor& hidden,
                      const at::Tensor& weight, const at::Tensor& targets, float grad_scale,
                      const at::Tensor& grad_hidden) {
  at::Tensor lse = at::empty({problem.tokens}, hidden.options().dtype(at::kFloat));
#if LATHE_TORCH_CUDA
  if (hidden.is_cuda()) {
    TORCH_INTERNAL_ASSERT(!grad_hidden.defined());
    const c10::cuda::CUDAGuard guard(hidden.device());
    const LinearCrossEntropyChunks chunks =
        ChooseChunks(problem, options, [&](const LinearCrossEntropyChunks& c) {
          return cuda::LinearCrossEntropyForwardWorkspaceBytes(problem, c);
        });
    at::Tensor workspace =
        Workspace(cuda::LinearCrossEntropyForwardWorkspaceBytes(problem, chunks), hidden);
    at::Tensor loss = at::empty({}, hidden.options().dtype(at::kFloat));
    const absl::Status status = cuda::LinearCrossEntropyForward(
        problem, chunks, hidden.data_ptr(), targets.data_ptr<int64_t>(), weight.data_ptr(),
        lse.data_ptr<float>(), loss.data_ptr<float>(), workspace.data_ptr(),
        c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(status.ok(), "LinearCrossEntropy: ", status.ToString());
    return {loss, lse};
  }
#endif
  TORCH_CHECK(hidden.is_cpu(), "LinearCrossEntropy: no kernel for device ", hidden.device());
  const bool want_hidden = grad_hidden.defined();
  auto bytes = [&](const LinearCrossEntropyChunks& c) {
    return cpu::LinearCrossEntropyForwardWorkspaceBytes(problem, c, want_hidden);
  };
  const LinearCrossEntropyChunks chunks = ChooseChunks(problem, options, bytes);
  at::Tensor workspace = Workspace(bytes(chunks), hidden);
  const double loss = cpu::LinearCrossEntropyForward(
      problem, chunks, hidden.data_ptr(), targets.data_ptr<int64_t>(), weight.data_ptr(),
      grad_scale, lse.data_ptr<float>(), want_hidden ? grad_hidden.data_ptr() : nullptr,
      workspace.data_ptr(), AtenParallelFor);
  return {at::scalar_tensor(loss, hidden.options().dtype(at::kFloat)), lse};
}

// grad_scale: a 1-element float32 tensor on the inputs' device.
void Backward(const LinearCrossEntropyProblem& problem, const LinearCrossEntropyOptions& options,
              const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
              const at::Tensor& lse, const at::Tensor& grad_scale, const at::Tensor& grad_hidden,
              const at::Tensor& grad_weight) {
  const bool want_hidden = grad_hidden.defined();
  const bool want_weight = grad_weight.defined();
  void* grad_hidden_data = want_hidden ? grad_hidden.data_ptr() : nullptr;
  void* grad_weight_data = want_weight ? grad_weight.data_ptr() : nullptr;
#if LATHE_TORCH_CUDA
  if (hidden.is_cuda()) {
    const c10::cuda::CUDAGuard guard(hidden.device());
    auto bytes = [&](const LinearCrossEntropyChunks& c) {
      return cuda::LinearCrossEntropyBackwardWorkspaceBytes(problem, c, want_hidden, want_weight);
    };
    const LinearCrossEntropyChunks chunks = ChooseChunks(problem, options, bytes);
    at::Tensor workspace = Workspace(bytes(chunks), hidden);
    const absl::Status status = cuda::LinearCrossEntropyBackward(
        problem, chunks, hidden.data_ptr(), targets.data_ptr<int64_t>(), weight.data_ptr(),
        lse.data_ptr<float>(), grad_scale.data_ptr<float>(), grad_hidden_data, grad_weight_data,
        workspace.data_ptr(), c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(status.ok(), "LinearCrossEntropy backward: ", status.ToString());
    return;
  }
#endif
  auto bytes = [&](const LinearCrossEntropyChunks& c) {
    return cpu::LinearCrossEntropyBackwardWorkspaceBytes(problem, c, want_hidden, want_weight);
  };
  const LinearCrossEntropyChunks chunks = ChooseChunks(problem, options, bytes);
  at::Tensor workspace = Workspace(bytes(chunks), hidden);
  cpu::LinearCrossEntropyBackward(problem, chunks, hidden.data_ptr(), targets.data_ptr<int64_t>(),
                                  weight.data_ptr(), lse.data_ptr<float>(),
                                  grad_scale.item<float>(), grad_hidden_data, grad_weight_data,
                                  workspace.data_ptr(), AtenParallelFor);
}

LinearCrossEntropyOptions OptionsFrom(const AutogradContext& ctx) {
  LinearCrossEntropyOptions options;
  options.ignore_index = ctx.saved_data.at("ignore_index").toInt();
  options.reduction =
      static_cast<LinearCrossEntropyReduction>(ctx.saved_data.at("reduction").toInt());
  options.softcap = ctx.saved_data.at("softcap").toDouble();
  options.z_loss_weight = ctx.saved_data.at("z_loss_weight").toDouble();
  options.memory_budget_bytes = ctx.saved_data.at("memory_budget_bytes").toInt();
  options.token_chunk = ctx.saved_data.at("token_chunk").toInt();
  options.vocab_chunk = ctx.saved_data.at("vocab_chunk").toInt();
  options.gradient_in_forward = ctx.saved_data.at("gradient_in_forward").toBool();
  return options;
}

void SaveOptions(const LinearCrossEntropyOptions& options, AutogradContext& ctx) {
  ctx.saved_data["ignore_index"] = options.ignore_index;
  ctx.saved_data["reduction"] = static_cast<int64_t>(options.reduction);
  ctx.saved_data["softcap"] = options.softcap;
  ctx.saved_data["z_loss_weight"] = options.z_loss_weight;
  ctx.saved_data["memory_budget_bytes"] = options.memory_budget_bytes;
  ctx.saved_data["token_chunk"] = options.token_chunk;
  ctx.saved_data["vocab_chunk"] = options.vocab_chunk;
  ctx.saved_data["gradient_in_forward"] = options.gradient_in_forward;
}

// Divides by the number of non-ignored tokens for kMean (by 1 when there are none).
at::Tensor Reduce(const at::Tensor& sum, const at::Tensor& count,
                  LinearCrossEntropyReduction reduction) {
  if (reduction == LinearCrossEntropyReduction::kSum) return sum;
  return sum / count.clamp_min(1).to(at::kFloat);
}

// The single pass's token chunk (kernels/cpu/linear_cross_entropy.h), or the caller's.
int64_t SinglePassTokenChunk(const LinearCrossEntropyProblem& problem,
                             const LinearCrossEntropyOptions& options) {
  if (options.vocab_chunk > 0 && options.vocab_chunk < problem.vocab) return 0;
  if (options.token_chunk > 0) return std::min(problem.tokens, options.token_chunk);
  return cpu::LinearCrossEntropySinglePassTokenChunk(problem, options.memory_budget_bytes);
}

class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  // backward_follows: grad mode was on and hidden or weight requires grad.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& targets,
                            const LinearCrossEntropyOptions& options, bool backward_follows) {
    const at::Tensor h = hidden.contiguous();
    const at::Tensor w = weight.contiguous();
    const at::Tensor t = targets.to(at::kLong).contiguous();
    const LinearCrossEntropyProblem problem = MakeProblem(h, w, options);
    const at::Tensor count = t.ne(options.ignore_index).sum();
    SaveOptions(options, *ctx);

    // Gradients computed here are those of the reduced loss for an incoming gradient of 1;
    // backward scales them. CPU kernel only, for now.
    at::Tensor grad_hidden;
    at::Tensor grad_weight;
    float grad_scale = 1.0f;
    if (backward_follows && options.gradient_in_forward && h.is_cpu() && problem.tokens > 0) {
      if (hidden.requires_grad()) grad_hidden = at::empty_like(h);
      if (options.reduction == LinearCrossEntropyReduction::kMean) {
        grad_scale = 1.0f / static_cast<float>(std::max<int64_t>(count.item<int64_t>(), 1));
      }
      const int64_t single_pass_tokens = SinglePassTokenChunk(problem, options);
      if (weight.requires_grad() && problem.dtype == LinearCrossEntropyDtype::kFloat32 &&
          single_pass_tokens > 0) {
        grad_weight = at::empty_like(w);
        at::Tensor lse = at::empty({problem.tokens}, h.options().dtype(at::kFloat));
        at::Tensor workspace = Workspace(
            cpu::LinearCrossEntropySinglePassWorkspaceBytes(problem, single_pass_tokens), h);
        const double loss = cpu::LinearCrossEntropySinglePass(
            problem, single_pass_tokens, h.data_ptr(), t.data_ptr<int64_t>(), w.data_ptr(),
            grad_scale, lse.data_ptr<float>(),
            grad_hidden.defined() ? grad_hidden.data_ptr() : nullptr, grad_weight.data_ptr(),
            workspace.data_ptr(), AtenParallelFor);
        // Backward needs nothing else: save no inputs.
        ctx->save_for_backward({at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
                                at::Tensor(), grad_hidden, grad_weight});
        return Reduce(at::scalar_tensor(loss, h.options().dtype(at::kFloat)), count,
                      options.reduction);
      }
    }
    const ForwardResult result = Forward(problem, options, h, w, t, grad_scale, grad_hidden);
    ctx->save_for_backward({h, w, t, result.lse, count, grad_hidden, at::Tensor()});
    return Reduce(result.loss_sum, count, options.reduction);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& grad = grad_outputs[0];
    // What forward computed already, for an incoming gradient of 1 (the usual loss.backward()).
    const bool unit = grad.is_cpu() && grad.item<double>() == 1.0;
    auto scaled = [&](const at::Tensor& computed) {
      return unit ? computed : computed * grad.to(at::kFloat);
    };
    at::Tensor grad_hidden;
    at::Tensor grad_weight;
    at::Tensor hidden_to_compute;
    at::Tensor weight_to_compute;
    if (ctx->needs_input_grad(0)) {
      if (saved[kGradHidden].defined()) {
        grad_hidden = scaled(saved[kGradHidden]);
      } else {
        grad_hidden = hidden_to_compute = at::empty_like(saved[kHidden]);
      }
    }
    if (ctx->needs_input_grad(1)) {
      if (saved[kGradWeight].defined()) {
        grad_weight = scaled(saved[kGradWeight]);
      } else {
        grad_weight = weight_to_compute = at::empty_like(saved[kWeight]);
      }
    }
    if (hidden_to_compute.defined() || weight_to_compute.defined()) {
      const LinearCrossEntropyOptions options = OptionsFrom(*ctx);
      const at::Tensor& hidden = saved[kHidden];
      const at::Tensor& weight = saved[kWeight];
      const at::Tensor grad_scale =
          Reduce(grad.to(at::kFloat), saved[kCount], options.reduction).reshape({1});
      Backward(MakeProblem(hidden, weight, options), options, hidden, weight, saved[kTargets],
               saved[kLse], grad_scale, hidden_to_compute, weight_to_compute);
    }
    return {grad_hidden, grad_weight, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor LinearCrossEntropy(const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& targets, const LinearCrossEntropyOptions& options) {
  CheckInputs(hidden, weight, targets, options);
  const bool backward_follows =
      at::GradMode::is_enabled() && (hidden.requires_grad() || weight.requires_grad());
  return LinearCrossEntropyFunction::apply(hidden, weight, targets, options, backward_follows);
}

}  // namespace lathe::kernels
