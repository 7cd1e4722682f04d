// NF4 on CUDA (label gpu). The kernel of kernels/cuda/nf4.h through cudart alone, bit for bit
// against cpu::DequantizeNf4 on the same quantized random weights and ranges, its output
// NaN-poisoned on the device with a guard past the end (so every element of the range was
// written, and nothing after it); skips without a CUDA device. Then the ops of
// kernels/ops/nf4_linear.h on CUDA tensors against the same ops on the CPU; skips unless
// libtorch has CUDA and a device.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/nf4.h"
#include "kernels/cuda/nf4.h"
#include "kernels/ops/nf4_linear.h"

namespace lathe::kernels {
namespace {

#define ASSERT_CUDA_OK(expr)                                      \
  do {                                                            \
    const cudaError_t error_ = (expr);                            \
    ASSERT_EQ(error_, cudaSuccess) << cudaGetErrorString(error_); \
  } while (0)

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};
template <typename T>
using DevicePtr = std::unique_ptr<T, CudaFree>;

// A device buffer of `n` elements, every byte `fill` (0xFF: NaN as float).
template <typename T>
DevicePtr<T> DeviceFilled(size_t n, int fill) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemset(p, fill, n * sizeof(T)), cudaSuccess);
  return DevicePtr<T>(static_cast<T*>(p));
}

template <typename T>
DevicePtr<T> ToDevice(const std::vector<T>& host) {
  DevicePtr<T> d = DeviceFilled<T>(host.size(), 0);
  EXPECT_EQ(cudaMemcpy(d.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return d;
}

// The bits of a float, for bit-for-bit comparisons (-0 differs from 0, NaN equals itself).
uint32_t Bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
}

// A tensor of n random-normal weights in NF4, on the host.
struct HostNf4 {
  int64_t n = 0;
  std::vector<uint8_t> codes, absmax_codes;
  std::vector<float> absmax2;
  float offset = 0.0f;
};

HostNf4 QuantizeRandom(int64_t n, std::mt19937_64& rng, const float* dynamic_map) {
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> weights(n);
  for (float& w : weights) w = normal(rng);
  const int64_t blocks = (n + cpu::kNf4Block - 1) / cpu::kNf4Block;
  HostNf4 q;
  q.n = n;
  q.codes.resize(blocks * cpu::kNf4Block / 2);
  q.absmax_codes.resize(blocks);
  q.absmax2.resize((blocks + cpu::kNf4AbsmaxBlock - 1) / cpu::kNf4AbsmaxBlock);
  cpu::QuantizeNf4(weights.data(), n, dynamic_map, q.codes.data(), q.absmax_codes.data(),
                   q.absmax2.data(), &q.offset);
  return q;
}

class Nf4CudaKernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      GTEST_SKIP() << "no CUDA device";
    }
  }
  std::mt19937_64 rng_{20240607};
};

TEST_F(Nf4CudaKernelTest, DequantizesBitForBitAsTheCpuKernel) {
  const at::Tensor map = DynamicQuantizationMap(true);
  const cuda::Nf4Tables tables = cuda::Nf4TablesFor(map.data_ptr<float>());
  // 1 and 63: one partial block; 300: a partial last block; 64000: 1000 blocks in four
  // second-level groups, the last partial; 66177: one element in its last block;
  // 4100 x 4100: more elements than one grid-stride pass of the launch covers (65536 blocks
  // of 256 threads), and a partial last block.
  for (int64_t n : {int64_t{1}, int64_t{63}, int64_t{300}, int64_t{64000}, int64_t{66177},
                    int64_t{4100} * 4100}) {
    SCOPED_TRACE(::testing::Message() << "n " << n);
    const HostNf4 q = QuantizeRandom(n, rng_, map.data_ptr<float>());
    DevicePtr<uint8_t> codes = ToDevice(q.codes), absmax_codes = ToDevice(q.absmax_codes);
    DevicePtr<float> absmax2 = ToDevice(q.absmax2);
    // Whole, odd starts and ends (not on a byte, not on a block of 64), one element, empty,
    // a range inside one block, and random ranges.
    std::vector<std::pair<int64_t, int64_t>> ranges = {
        {0, n}, {1, n}, {0, n - 1}, {n - 1, n}, {n / 2, n / 2}, {37, n - 3}, {63, 65}, {65, 127}};
    std::uniform_int_distribution<int64_t> point(0, n);
    for (int k = 0; k < 3; ++k) {
      const int64_t a = point(rng_), b = point(rng_);
      ranges.emplace_back(std::min(a, b), std::max(a, b));
    }
    for (const auto& [begin, end] : ranges) {
      if (begin < 0 || begin > end || end > n) continue;
      SCOPED_TRACE(::testing::Message() << "range [" << begin << ", " << end << ")");
      const int64_t count = end - begin;
      std::vector<float> expected(count);
      cpu::DequantizeNf4(q.codes.data(), q.absmax_codes.data(), q.absmax2.data(), q.offset,
                         map.data_ptr<float>(), begin, end, expected.data());
      constexpr int64_t kGuard = 67;
      DevicePtr<float> out = DeviceFilled<float>(count + kGuard, 0xFF);
      ASSERT_CUDA_OK(cuda::DequantizeNf4(codes.get(), absmax_codes.get(), absmax2.get(), q.offset,
                                         tables, begin, end, out.get(), nullptr));
      ASSERT_CUDA_OK(cudaDeviceSynchronize());
      std::vector<float> got(count + kGuard);
      ASSERT_CUDA_OK(
          cudaMemcpy(got.data(), out.get(), got.size() * sizeof(float), cudaMemcpyDeviceToHost));
      for (int64_t j = 0; j < count; ++j) {
        ASSERT_EQ(Bits(got[j]), Bits(expected[j])) << "element " << begin + j << ": " << got[j]
                                                   << " on CUDA, " << expected[j] << " on the CPU";
      }
      for (int64_t j = count; j < count + kGuard; ++j) {
        ASSERT_EQ(Bits(got[j]), 0xFFFFFFFFu) << "written past the range, at " << j - count;
      }
    }
  }
}

class Nf4CudaOpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "libtorch without CUDA, or no CUDA device";
  }
};

TEST_F(Nf4CudaOpTest, DequantizeNf4OnCudaEqualsTheCpu) {
  at::manual_seed(2);
  // 63 elements: one partial block; 200 x 320: four second-level groups; 33 x 50: blocks
  // straddle rows and the last is partial.
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{7, 9}, {200, 320}, {33, 50}}) {
    SCOPED_TRACE(::testing::Message() << rows << " x " << cols);
    const at::Tensor w = at::randn({rows, cols});
    const Nf4Weight on_cpu = QuantizeNf4(w, at::kCPU);
    const Nf4Weight on_cuda = QuantizeNf4(w, at::Device(at::kCUDA, 0));
    ASSERT_TRUE(on_cuda.codes.is_cuda());
    const int64_t n = rows * cols;
    for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, n}, {5, n - 3}, {n - 1, n}, {9, 9}}) {
      SCOPED_TRACE(::testing::Message() << "range [" << begin << ", " << end << ")");
      const at::Tensor got = DequantizeNf4(on_cuda, begin, end);
      ASSERT_TRUE(got.is_cuda());
      ASSERT_EQ(got.scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(got.cpu(), DequantizeNf4(on_cpu, begin, end)));
    }
  }
}

TEST_F(Nf4CudaOpTest, Nf4LinearOnCudaMatchesTheCpuForwardAndBackward) {
  at::manual_seed(3);
  // 3000 x 96: several tiles; 33 x 50: blocks straddle rows, a partial last block.
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{3000, 96}, {40, 64}, {33, 50}}) {
    SCOPED_TRACE(::testing::Message() << rows << " x " << cols);
    const at::Tensor w = at::randn({rows, cols}) * 0.05;
    const Nf4Weight on_cpu = QuantizeNf4(w, at::kCPU);
    const Nf4Weight on_cuda = QuantizeNf4(w, at::Device(at::kCUDA, 0));
    const at::Tensor x = at::randn({2, 5, cols});
    const at::Tensor x_cpu = x.clone().requires_grad_(true);
    const at::Tensor x_cuda = x.to(at::Device(at::kCUDA, 0)).requires_grad_(true);
    const at::Tensor y_cpu = Nf4Linear(x_cpu, on_cpu);
    const at::Tensor y_cuda = Nf4Linear(x_cuda, on_cuda);
    ASSERT_TRUE(y_cuda.is_cuda());
    ASSERT_EQ(y_cuda.sizes(), y_cpu.sizes());
    // The same weights bit for bit; the matrix products sum in different orders.
    EXPECT_TRUE(at::allclose(y_cuda.cpu(), y_cpu, 1e-4, 1e-5));
    const at::Tensor g = at::randn(y_cpu.sizes());
    y_cpu.backward(g);
    y_cuda.backward(g.to(y_cuda.device()));
    ASSERT_TRUE(x_cuda.grad().defined());
    ASSERT_TRUE(x_cuda.grad().is_cuda());
    EXPECT_TRUE(at::allclose(x_cuda.grad().cpu(), x_cpu.grad(), 1e-4, 1e-5));
  }
}

}  // namespace
}  // namespace lathe::kernels
