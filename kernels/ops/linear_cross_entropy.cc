#include "kernels/ops/linear_cross_entropy.h"

#include <cstdint>
#include <functional>

#include "kernels/cpu/linear_cross_entropy.h"
#include "worker/engine/torch_compat.h"

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
enum Saved { kHidden, kWeight, kTargets, kLse, kCount };

LinearCrossEntropyProblem MakeProblem(const at::Tensor& hidden, const at::Tensor& weight,
                                      const LinearCrossEntropyOptions& options) {
  LinearCrossEntropyProblem problem;
  problem.tokens = hidden.size(0);
  problem.hidden_size = hidden.size(1);
  problem.vocab = weight.size(0);
  problem.dtype = hidden.scalar_type() == at::kBFloat16 ? LinearCrossEntropyDtype::kBFloat16
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
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type() &&
                  (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16),
              "LinearCrossEntropy: hidden and weight must both be float32 or both bfloat16, got ",
              hidden.scalar_type(), " and ", weight.scalar_type());
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

ForwardResult Forward(const LinearCrossEntropyProblem& problem,
                      const LinearCrossEntropyOptions& options, const at::Tensor& hidden,
                      const at::Tensor& weight, const at::Tensor& targets) {
  at::Tensor lse = at::empty({problem.tokens}, hidden.options().dtype(at::kFloat));
#if LATHE_TORCH_CUDA
  if (hidden.is_cuda()) {
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
  const LinearCrossEntropyChunks chunks =
      ChooseChunks(problem, options, [&](const LinearCrossEntropyChunks& c) {
        return cpu::LinearCrossEntropyForwardWorkspaceBytes(problem, c);
      });
  at::Tensor workspace =
      Workspace(cpu::LinearCrossEntropyForwardWorkspaceBytes(problem, chunks), hidden);
  const double loss = cpu::LinearCrossEntropyForward(
      problem, chunks, hidden.data_ptr(), targets.data_ptr<int64_t>(), weight.data_ptr(),
      lse.data_ptr<float>(), workspace.data_ptr(), AtenParallelFor);
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
}

// Divides by the number of non-ignored tokens for kMean (by 1 when there are none).
at::Tensor Reduce(const at::Tensor& sum, const at::Tensor& count,
                  LinearCrossEntropyReduction reduction) {
  if (reduction == LinearCrossEntropyReduction::kSum) return sum;
  return sum / count.clamp_min(1).to(at::kFloat);
}

class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& targets,
                            const LinearCrossEntropyOptions& options) {
    const at::Tensor h = hidden.contiguous();
    const at::Tensor w = weight.contiguous();
    const at::Tensor t = targets.to(at::kLong).contiguous();
    const LinearCrossEntropyProblem problem = MakeProblem(h, w, options);
    ForwardResult result = Forward(problem, options, h, w, t);
    at::Tensor count = t.ne(options.ignore_index).sum();
    ctx->save_for_backward({h, w, t, result.lse, count});
    SaveOptions(options, *ctx);
    return Reduce(result.loss_sum, count, options.reduction);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& hidden = saved[kHidden];
    const at::Tensor& weight = saved[kWeight];
    const LinearCrossEntropyOptions options = OptionsFrom(*ctx);
    at::Tensor grad_hidden;
    at::Tensor grad_weight;
    if (ctx->needs_input_grad(0)) grad_hidden = at::empty_like(hidden);
    if (ctx->needs_input_grad(1)) grad_weight = at::empty_like(weight);
    if (grad_hidden.defined() || grad_weight.defined()) {
      const at::Tensor grad_scale =
          Reduce(grad_outputs[0].to(at::kFloat), saved[kCount], options.reduction).reshape({1});
      Backward(MakeProblem(hidden, weight, options), options, hidden, weight, saved[kTargets],
               saved[kLse], grad_scale, grad_hidden, grad_weight);
    }
    return {grad_hidden, grad_weight, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor LinearCrossEntropy(const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& targets, const LinearCrossEntropyOptions& options) {
  CheckInputs(hidden, weight, targets, options);
  return LinearCrossEntropyFunction::apply(hidden, weight, targets, options);
}

}  // namespace lathe::kernels
