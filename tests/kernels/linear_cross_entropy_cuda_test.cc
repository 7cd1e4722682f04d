// The CUDA linear cross-entropy kernel against the CPU kernel on the same random inputs
// (label gpu: skips without a CUDA device). No libtorch: device memory by cudaMalloc.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/linear_cross_entropy.h"
#include "kernels/cuda/linear_cross_entropy.h"
#include "kernels/float16.h"
#include "kernels/linear_cross_entropy_problem.h"

namespace lathe::kernels {
namespace {

using Dtype = LinearCrossEntropyDtype;

bool HaveDevice() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// A matrix in the problem's dtype, as bytes, and its values as floats.
struct Matrix {
  std::vector<char> bytes;
  std::vector<float> values;
};

Matrix RandomMatrix(int64_t count, float scale, Dtype dtype, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, scale);
  Matrix m;
  m.values.resize(count);
  m.bytes.resize(count * ElementBytes(dtype));
  for (int64_t k = 0; k < count; ++k) {
    const float x = normal(rng);
    if (dtype == Dtype::kBFloat16) {
      const BFloat16 b = Store<BFloat16>(x);
      std::memcpy(m.bytes.data() + 2 * k, &b, 2);
      m.values[k] = Load(b);
    } else {
      std::memcpy(m.bytes.data() + 4 * k, &x, 4);
      m.values[k] = x;
    }
  }
  return m;
}

std::vector<float> ToFloats(const std::vector<char>& bytes, Dtype dtype) {
  const int64_t count = static_cast<int64_t>(bytes.size()) / ElementBytes(dtype);
  std::vector<float> values(count);
  for (int64_t k = 0; k < count; ++k) {
    if (dtype == Dtype::kBFloat16) {
      BFloat16 b;
      std::memcpy(&b, bytes.data() + 2 * k, 2);
      values[k] = Load(b);
    } else {
      std::memcpy(&values[k], bytes.data() + 4 * k, 4);
    }
  }
  return values;
}

double RelativeError(const std::vector<float>& actual, const std::vector<float>& expected) {
  double diff = 0.0;
  double scale = 0.0;
  for (size_t k = 0; k < expected.size(); ++k) {
    if (!std::isfinite(actual[k])) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::abs(static_cast<double>(actual[k]) - expected[k]));
    scale = std::max(scale, std::abs(static_cast<double>(expected[k])));
  }
  return scale == 0.0 ? diff : diff / scale;
}

// Device memory for the life of the object; starts filled with 0xFF bytes (NaN as float32 and
// as bfloat16), so that an element the kernel does not write shows.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(int64_t bytes) : bytes_(std::max<int64_t>(bytes, 1)) {
    EXPECT_EQ(cudaMalloc(&data_, bytes_), cudaSuccess);
    EXPECT_EQ(cudaMemset(data_, 0xFF, bytes_), cudaSuccess);
  }
  template <typename T>
  DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    EXPECT_EQ(cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T = void>
  T* get() const {
    return static_cast<T*>(data_);
  }
  template <typename T>
  std::vector<T> Read(int64_t count) const {
    std::vector<T> host(count);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, count * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }

 private:
  void* data_ = nullptr;
  int64_t bytes_;
};

struct Case {
  const char* name;
  int64_t tokens, hidden_size, vocab;
  Dtype dtype;
  LinearCrossEntropyChunks chunks;
  float softcap;
  float z_loss_weight;
};

class LinearCrossEntropyCudaTest : public ::testing::TestWithParam<Case> {};

TEST_P(LinearCrossEntropyCudaTest, MatchesCpuKernel) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  const Case& c = GetParam();
  LinearCrossEntropyProblem problem;
  problem.tokens = c.tokens;
  problem.hidden_size = c.hidden_size;
  problem.vocab = c.vocab;
  problem.dtype = c.dtype;
  problem.softcap = c.softcap;
  problem.z_loss_weight = c.z_loss_weight;

  std::mt19937 rng(7);
  const Matrix hidden = RandomMatrix(c.tokens * c.hidden_size, 1.0f, c.dtype, rng);
  const Matrix weight = RandomMatrix(
      c.vocab * c.hidden_size, 3.0f / std::sqrt(static_cast<float>(c.hidden_size)), c.dtype, rng);
  std::vector<int64_t> targets(c.tokens);
  std::uniform_int_distribution<int64_t> vocab_entry(0, c.vocab - 1);
  for (int64_t i = 0; i < c.tokens; ++i) targets[i] = i % 5 == 4 ? -100 : vocab_entry(rng);

  // The CPU kernel.
  std::vector<float> cpu_lse(c.tokens);
  std::vector<char> cpu_workspace(
      std::max(cpu::LinearCrossEntropyForwardWorkspaceBytes(problem, c.chunks, false),
               cpu::LinearCrossEntropyBackwardWorkspaceBytes(problem, c.chunks, true, true)) +
      64);
  void* aligned =
      cpu_workspace.data() + (64 - reinterpret_cast<uintptr_t>(cpu_workspace.data()) % 64);
  const double cpu_loss = cpu::LinearCrossEntropyForward(
      problem, c.chunks, hidden.bytes.data(), targets.data(), weight.bytes.data(), 1.0f,
      cpu_lse.data(), nullptr, aligned, cpu::SerialFor);
  const float grad_scale = 0.5f;
  std::vector<char> cpu_grad_hidden(hidden.bytes.size());
  std::vector<char> cpu_grad_weight(weight.bytes.size());
  cpu::LinearCrossEntropyBackward(
      problem, c.chunks, hidden.bytes.data(), targets.data(), weight.bytes.data(), cpu_lse.data(),
      grad_scale, cpu_grad_hidden.data(), cpu_grad_weight.data(), aligned, cpu::SerialFor);

  // The CUDA kernel.
  const DeviceBuffer d_hidden(hidden.bytes);
  const DeviceBuffer d_weight(weight.bytes);
  const DeviceBuffer d_targets(targets);
  const DeviceBuffer d_lse(c.tokens * sizeof(float));
  const DeviceBuffer d_loss(sizeof(float));
  const DeviceBuffer d_scale(std::vector<float>{grad_scale});
  const DeviceBuffer d_grad_hidden(hidden.bytes.size());
  const DeviceBuffer d_grad_weight(weight.bytes.size());
  const DeviceBuffer d_workspace(
      std::max(cuda::LinearCrossEntropyForwardWorkspaceBytes(problem, c.chunks),
               cuda::LinearCrossEntropyBackwardWorkspaceBytes(problem, c.chunks, true, true)));
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  absl::Status status = cuda::LinearCrossEntropyForward(
      problem, c.chunks, d_hidden.get(), d_targets.get<int64_t>(), d_weight.get(),
      d_lse.get<float>(), d_loss.get<float>(), d_workspace.get(), stream);
  ASSERT_TRUE(status.ok()) << status;
  status = cuda::LinearCrossEntropyBackward(
      problem, c.chunks, d_hidden.get(), d_targets.get<int64_t>(), d_weight.get(),
      d_lse.get<float>(), d_scale.get<float>(), d_grad_hidden.get(), d_grad_weight.get(),
      d_workspace.get(), stream);
  ASSERT_TRUE(status.ok()) << status;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);

  const double tolerance = c.dtype == Dtype::kBFloat16 ? 1e-2 : 1e-4;
  const float gpu_loss = d_loss.Read<float>(1)[0];
  EXPECT_LT(std::abs(gpu_loss - cpu_loss) / std::abs(cpu_loss), 1e-5)
      << gpu_loss << " vs " << cpu_loss;
  EXPECT_LT(RelativeError(d_lse.Read<float>(c.tokens), cpu_lse), 1e-5);
  EXPECT_LT(RelativeError(ToFloats(d_grad_hidden.Read<char>(hidden.bytes.size()), c.dtype),
                          ToFloats(cpu_grad_hidden, c.dtype)),
            tolerance);
  EXPECT_LT(RelativeError(ToFloats(d_grad_weight.Read<char>(weight.bytes.size()), c.dtype),
                          ToFloats(cpu_grad_weight, c.dtype)),
            tolerance);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LinearCrossEntropyCudaTest,
    ::testing::Values(
        Case{"Float32OneChunk", 64, 65, 32003, Dtype::kFloat32, {64, 32003}, 0, 0},
        Case{"Float32Chunks", 301, 65, 32003, Dtype::kFloat32, {128, 5000}, 0, 0},
        Case{"Float32CapZLoss", 100, 96, 10007, Dtype::kFloat32, {33, 1024}, 8, 1e-3f},
        Case{"BFloat16OneVocabChunk", 77, 128, 5003, Dtype::kBFloat16, {32, 5003}, 0, 0},
        Case{"BFloat16Chunks", 77, 128, 5003, Dtype::kBFloat16, {32, 1000}, 8, 1e-3f},
        Case{"SingleToken", 1, 64, 1000, Dtype::kFloat32, {1, 300}, 0, 0}),
    [](const ::testing::TestParamInfo<Case>& param_info) {
      return std::string(param_info.param.name);
    });

}  // namespace
}  // namespace lathe::kernels
