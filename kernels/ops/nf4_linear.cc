#include "kernels/ops/nf4_linear.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/cpu/nf4.h"
#include "kernels/ops/kernel_dispatch.h"
#include "kernels/ops/matmul.h"

#ifdef LATHE_TORCH_CUDA
#include "kernels/cuda/nf4.h"
#endif

namespace lathe::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows per tile: about 256K elements, and whole blocks of 64 whatever the row length.
int64_t TileRows(int64_t cols) {
  int64_t rows = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, cols));
  const int64_t align = cpu::kNf4Block / std::gcd(cols, cpu::kNf4Block);
  return (rows + align - 1) / align * align;
}

// Calls fn(first_row, tile [rows, cols] float32) over the weight's tiles in order.
template <typename F>
void ForEachTile(const Nf4Weight& w, F&& fn) {
  const int64_t step = TileRows(w.cols);
  for (int64_t r = 0; r < w.rows; r += step) {
    const int64_t rows = std::min(step, w.rows - r);
    fn(r, DequantizeNf4(w, r * w.cols, (r + rows) * w.cols).view({rows, w.cols}));
  }
}

Nf4Weight FromTensors(const at::Tensor& codes, const at::Tensor& absmax_codes,
                      const at::Tensor& absmax2, double offset, int64_t rows, int64_t cols) {
  return {codes, absmax_codes, absmax2, offset, rows, cols};
}

class Nf4LinearFunction : public torch::autograd::Function<Nf4LinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& absmax_codes, const at::Tensor& absmax2,
                            double offset, int64_t rows, int64_t cols) {
    const Nf4Weight w = FromTensors(codes, absmax_codes, absmax2, offset, rows, cols);
    TORCH_CHECK(x.size(-1) == cols, "Nf4Linear: x of shape ", x.sizes(), " for a weight [", rows,
                ", ", cols, "]");
    TORCH_CHECK(x.scalar_type() == at::kFloat, "Nf4Linear: x must be float32, not ",
                x.scalar_type());
    const at::Tensor x2 = x.reshape({-1, cols});
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = rows;
    at::Tensor y = at::empty({x2.size(0), rows}, x.options());
    ForEachTile(w, [&](int64_t first, const at::Tensor& tile) {
      MatmulOut(y.narrow(1, first, tile.size(0)), x2, tile.t());
    });
    ctx->save_for_backward({codes, absmax_codes, absmax2});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["rows"] = rows;
    ctx->saved_data["cols"] = cols;
    return y.view(sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const int64_t rows = ctx->saved_data["rows"].toInt();
    const int64_t cols = ctx->saved_data["cols"].toInt();
    const Nf4Weight w =
        FromTensors(saved[0], saved[1], saved[2], ctx->saved_data["offset"].toDouble(), rows, cols);
    const at::Tensor g = grads[0].reshape({-1, rows});
    at::Tensor dx = at::zeros({g.size(0), cols}, g.options());
    ForEachTile(w, [&](int64_t first, const at::Tensor& tile) {
      MatmulOut(dx, g.narrow(1, first, tile.size(0)), tile, 1.0, 1.0);
    });
    std::vector<int64_t> sizes = grads[0].sizes().vec();
    sizes.back() = cols;
    return {dx.view(sizes), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(),   at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor DynamicQuantizationMap(bool is_signed) {
  std::vector<double> values;
  for (int i = 0; i < 7; ++i) {
    const int64_t fractions = is_signed ? (int64_t{1} << i) + 1 : (int64_t{1} << (i + 1)) + 1;
    std::vector<double> bounds;
    for (int64_t j = 0; j < fractions; ++j) {
      bounds.push_back(0.1 + 0.9 * static_cast<double>(j) / static_cast<double>(fractions - 1));
    }
    const double scale = std::pow(10.0, i - 6);
    for (int64_t j = 0; j + 1 < fractions; ++j) {
      const double mean = (bounds[j] + bounds[j + 1]) / 2;
      values.push_back(scale * mean);
      if (is_signed) values.push_back(-scale * mean);
    }
  }
  values.push_back(0.0);
  values.push_back(1.0);
  std::sort(values.begin(), values.end());
  TORCH_CHECK(values.size() == 256, "the dynamic map has ", values.size(), " values");
  at::Tensor map = at::empty({256}, at::kFloat);
  float* out = map.data_ptr<float>();
  for (size_t k = 0; k < 256; ++k) out[k] = static_cast<float>(values[k]);
  return map;
}

int64_t Nf4Weight::nbytes() const {
  return static_cast<int64_t>(codes.nbytes() + absmax_codes.nbytes() + absmax2.nbytes());
}

Nf4Weight QuantizeNf4(const at::Tensor& weight, at::Device device) {
  TORCH_CHECK(weight.dim() == 2, "QuantizeNf4: weight must be [rows, cols], not ", weight.sizes());
  const at::Tensor w = weight.to(at::kCPU, at::kFloat).contiguous();
  const int64_t n = w.numel();
  const int64_t blocks = (n + cpu::kNf4Block - 1) / cpu::kNf4Block;
  const int64_t groups = (blocks + cpu::kNf4AbsmaxBlock - 1) / cpu::kNf4AbsmaxBlock;
  const at::Tensor map = DynamicQuantizationMap(true);
  Nf4Weight q;
  q.rows = w.size(0);
  q.cols = w.size(1);
  q.codes = at::empty({blocks * cpu::kNf4Block / 2}, at::kByte);
  q.absmax_codes = at::empty({blocks}, at::kByte);
  q.absmax2 = at::empty({groups}, at::kFloat);
  float offset = 0.0f;
  cpu::QuantizeNf4(w.data_ptr<float>(), n, map.data_ptr<float>(), q.codes.data_ptr<uint8_t>(),
                   q.absmax_codes.data_ptr<uint8_t>(), q.absmax2.data_ptr<float>(), &offset);
  q.offset = offset;
  if (!device.is_cpu()) {
    q.codes = q.codes.to(device);
    q.absmax_codes = q.absmax_codes.to(device);
    q.absmax2 = q.absmax2.to(device);
  }
  return q;
}

at::Tensor DequantizeNf4(const Nf4Weight& weight, int64_t begin, int64_t end) {
  TORCH_CHECK(0 <= begin && begin <= end && end <= weight.rows * weight.cols,
              "DequantizeNf4: range [", begin, ", ", end, ") of ", weight.rows * weight.cols);
  const at::Device device = weight.codes.device();
  TORCH_CHECK(weight.absmax_codes.device() == device && weight.absmax2.device() == device,
              "DequantizeNf4: codes on ", device, ", absmax_codes on ",
              weight.absmax_codes.device(), ", absmax2 on ", weight.absmax2.device());
  static const at::Tensor map = DynamicQuantizationMap(true);
#ifdef LATHE_TORCH_CUDA
  if (device.is_cuda()) {
    static const cuda::Nf4Tables tables = cuda::Nf4TablesFor(map.data_ptr<float>());
    at::Tensor out = at::empty({end - begin}, at::TensorOptions(device).dtype(at::kFloat));
    const c10::cuda::CUDAGuard device_guard(device);
    C10_CUDA_CHECK(cuda::DequantizeNf4(
        weight.codes.data_ptr<uint8_t>(), weight.absmax_codes.data_ptr<uint8_t>(),
        weight.absmax2.data_ptr<float>(), static_cast<float>(weight.offset), tables, begin, end,
        out.data_ptr<float>(), CurrentStream(device)));
    return out;
  }
#endif
  TORCH_CHECK(device.is_cpu(), "DequantizeNf4: a weight on ", device,
              " (CPU, or CUDA when libtorch has CUDA)");
  at::Tensor out = at::empty({end - begin}, at::kFloat);
  cpu::DequantizeNf4(weight.codes.data_ptr<uint8_t>(), weight.absmax_codes.data_ptr<uint8_t>(),
                     weight.absmax2.data_ptr<float>(), static_cast<float>(weight.offset),
                     map.data_ptr<float>(), begin, end, out.data_ptr<float>());
  return out;
}

at::Tensor Nf4Linear(const at::Tensor& x, const Nf4Weight& weight) {
  return Nf4LinearFunction::apply(x, weight.codes, weight.absmax_codes, weight.absmax2,
                                  weight.offset, weight.rows, weight.cols);
}

}  // namespace lathe::kernels
