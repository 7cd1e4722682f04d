// The CUDA kernels against the CPU kernels on the same inputs, through cudart alone (no
// libtorch): every output buffer starts as NaN on the device, so a comparison also proves
// that every element was written. Skips without a CUDA device.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/dropout.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/swiglu.h"
#include "kernels/cuda/dropout.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/swiglu.h"
#include "kernels/float16.h"

namespace lathe {
namespace {

using kernels::BFloat16;
using kernels::Half;
using kernels::Load;
using kernels::Store;

#define ASSERT_CUDA_OK(expr)                                      \
  do {                                                            \
    const cudaError_t error_ = (expr);                            \
    ASSERT_EQ(error_, cudaSuccess) << cudaGetErrorString(error_); \
  } while (0)

// A device copy of a host vector, freed on destruction.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(const std::vector<T>& host) : size_(host.size()) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&data_), Bytes()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data_, host.data(), Bytes(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  // n elements, every byte 0xFF: NaN in float32, bfloat16 and float16 alike.
  static DeviceBuffer Poisoned(size_t n) {
    DeviceBuffer buffer{std::vector<T>(n)};
    EXPECT_EQ(cudaMemset(buffer.data_, 0xFF, buffer.Bytes()), cudaSuccess);
    return buffer;
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept : data_(other.data_), size_(other.size_) {
    other.data_ = nullptr;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(data_); }

  T* get() const { return data_; }
  std::vector<T> ToHost() const {
    std::vector<T> host(size_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, Bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  size_t Bytes() const { return size_ * sizeof(T); }
  T* data_ = nullptr;
  size_t size_;
};

template <typename T>
std::vector<T> Random(size_t n, std::mt19937_64& rng, float std = 1.0f) {
  std::normal_distribution<float> normal(0.0f, std);
  std::vector<T> v(n);
  for (T& e : v) e = Store<T>(normal(rng));
  return v;
}

// Tolerance of one CUDA result against the CPU kernel's: a few ulp of T (the two differ in
// FMA contraction and in exp).
template <typename T>
double Tolerance() {
  if (std::is_same_v<T, float>) return 1e-5;
  if (std::is_same_v<T, Half>) return 2e-3;
  return 1e-2;
}

// Every element of `gpu` is finite where the CPU's is, and max |gpu - cpu| / max |cpu| < tol.
template <typename T>
void ExpectClose(const std::vector<T>& gpu, const std::vector<T>& cpu, const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  double scale = 0, diff = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double c = Load(cpu[i]), g = Load(gpu[i]);
    ASSERT_TRUE(std::isfinite(g)) << what << ": element " << i << " not written (or not finite)";
    scale = std::max(scale, std::abs(c));
    diff = std::max(diff, std::abs(g - c));
  }
  EXPECT_LT(diff / std::max(scale, 1e-30), Tolerance<T>()) << what;
}

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      GTEST_SKIP() << "no CUDA device";
    }
  }
  std::mt19937_64 rng_{std::random_device{}()};
};

template <typename T>
void CheckRmsNorm(std::mt19937_64& rng, int64_t rows, int64_t hidden) {
  SCOPED_TRACE(::testing::Message() << "rows " << rows << " hidden " << hidden);
  const float eps = 1e-6f;
  const std::vector<T> x = Random<T>(rows * hidden, rng, 2.0f);
  const std::vector<T> dy = Random<T>(rows * hidden, rng);
  std::vector<float> w = Random<float>(hidden, rng, 0.2f);
  for (float& e : w) e += 1.0f;

  std::vector<T> y(rows * hidden), dx(rows * hidden);
  std::vector<float> rstd(rows), dw(hidden);
  kernels::cpu::RmsNormForward(x.data(), w.data(), hidden, eps, 0, rows, y.data(), rstd.data());
  kernels::cpu::RmsNormBackward(dy.data(), x.data(), w.data(), rstd.data(), hidden, 0, rows,
                                dx.data(), dw.data());

  DeviceBuffer<T> d_x(x), d_dy(dy);
  DeviceBuffer<float> d_w(w);
  auto d_y = DeviceBuffer<T>::Poisoned(rows * hidden);
  auto d_dx = DeviceBuffer<T>::Poisoned(rows * hidden);
  auto d_rstd = DeviceBuffer<float>::Poisoned(rows);
  const int64_t partial_rows = kernels::cuda::RmsNormBackwardPartialRows(rows);
  auto d_dw = DeviceBuffer<float>::Poisoned(partial_rows * hidden);
  ASSERT_CUDA_OK(kernels::cuda::RmsNormForward(d_x.get(), d_w.get(), rows, hidden, eps, d_y.get(),
                                               d_rstd.get(), nullptr));
  ASSERT_CUDA_OK(kernels::cuda::RmsNormBackward(d_dy.get(), d_x.get(), d_w.get(), d_rstd.get(),
                                                rows, hidden, d_dx.get(), d_dw.get(), nullptr));
  ExpectClose(d_y.ToHost(), y, "y");
  ExpectClose(d_rstd.ToHost(), rstd, "rstd");
  ExpectClose(d_dx.ToHost(), dx, "dx");
  const std::vector<float> partial = d_dw.ToHost();
  std::vector<float> dw_gpu(hidden, 0.0f);
  for (int64_t r = 0; r < partial_rows; ++r) {
    for (int64_t j = 0; j < hidden; ++j) dw_gpu[j] += partial[r * hidden + j];
  }
  ExpectClose(dw_gpu, dw, "dweight");
}

TEST_F(CudaKernelsTest, RmsNormMatchesTheCpuKernel) {
  for (auto [rows, hidden] : {std::pair<int64_t, int64_t>{1, 65}, {7, 65}, {600, 1024}}) {
    CheckRmsNorm<float>(rng_, rows, hidden);
    CheckRmsNorm<BFloat16>(rng_, rows, hidden);
    CheckRmsNorm<Half>(rng_, rows, hidden);
  }
}

template <typename T>
void CheckRope(std::mt19937_64& rng, int64_t batch, int64_t heads, int64_t seq, int64_t dim) {
  SCOPED_TRACE(::testing::Message() << "b" << batch << " h" << heads << " s" << seq << " d" << dim);
  // [batch, seq, heads, head_dim] memory read as [batch, heads, seq, head_dim].
  kernels::RopeLayout layout{batch, heads, seq, dim, seq * heads * dim, dim, heads * dim};
  const int64_t n = batch * heads * seq * dim;
  const std::vector<T> x = Random<T>(n, rng);
  const std::vector<T> cos = Random<T>(seq * dim, rng);
  const std::vector<T> sin = Random<T>(seq * dim, rng);
  std::vector<T> y(n), dx(n);
  kernels::cpu::RopeForward(x.data(), cos.data(), sin.data(), layout, 0, layout.rows(), y.data());
  kernels::cpu::RopeBackward(x.data(), cos.data(), sin.data(), layout, 0, layout.rows(), dx.data());
  DeviceBuffer<T> d_x(x), d_cos(cos), d_sin(sin);
  auto d_y = DeviceBuffer<T>::Poisoned(n);
  auto d_dx = DeviceBuffer<T>::Poisoned(n);
  ASSERT_CUDA_OK(
      kernels::cuda::RopeForward(d_x.get(), d_cos.get(), d_sin.get(), layout, d_y.get(), nullptr));
  ASSERT_CUDA_OK(kernels::cuda::RopeBackward(d_x.get(), d_cos.get(), d_sin.get(), layout,
                                             d_dx.get(), nullptr));
  ExpectClose(d_y.ToHost(), y, "y");
  ExpectClose(d_dx.ToHost(), dx, "dx");
}

TEST_F(CudaKernelsTest, RopeMatchesTheCpuKernel) {
  for (auto shape : {std::vector<int64_t>{1, 1, 1, 2}, {2, 3, 5, 6}, {2, 16, 128, 64}}) {
    CheckRope<float>(rng_, shape[0], shape[1], shape[2], shape[3]);
    CheckRope<BFloat16>(rng_, shape[0], shape[1], shape[2], shape[3]);
    CheckRope<Half>(rng_, shape[0], shape[1], shape[2], shape[3]);
  }
}

template <typename T>
void CheckSwiGlu(std::mt19937_64& rng, int64_t n) {
  SCOPED_TRACE(::testing::Message() << "n " << n);
  const std::vector<T> gate = Random<T>(n, rng, 3.0f);
  const std::vector<T> up = Random<T>(n, rng);
  const std::vector<T> dy = Random<T>(n, rng);
  std::vector<T> y(n), dgate(n), dup(n);
  kernels::cpu::SwiGluForward(gate.data(), up.data(), n, 0, 1, y.data());
  kernels::cpu::SwiGluBackward(dy.data(), gate.data(), up.data(), n, 0, 1, dgate.data(),
                               dup.data());
  DeviceBuffer<T> d_gate(gate), d_up(up), d_dy(dy);
  auto d_y = DeviceBuffer<T>::Poisoned(n);
  auto d_dgate = DeviceBuffer<T>::Poisoned(n);
  auto d_dup = DeviceBuffer<T>::Poisoned(n);
  ASSERT_CUDA_OK(kernels::cuda::SwiGluForward(d_gate.get(), d_up.get(), n, d_y.get(), nullptr));
  ASSERT_CUDA_OK(kernels::cuda::SwiGluBackward(d_dy.get(), d_gate.get(), d_up.get(), n,
                                               d_dgate.get(), d_dup.get(), nullptr));
  ExpectClose(d_y.ToHost(), y, "y");
  ExpectClose(d_dgate.ToHost(), dgate, "dgate");
  ExpectClose(d_dup.ToHost(), dup, "dup");
}

TEST_F(CudaKernelsTest, SwiGluMatchesTheCpuKernel) {
  for (int64_t n : {1, 65, 2048 * 2816}) {
    CheckSwiGlu<float>(rng_, n);
    CheckSwiGlu<BFloat16>(rng_, n);
    CheckSwiGlu<Half>(rng_, n);
  }
}

template <typename T>
void CheckGeGlu(std::mt19937_64& rng, int64_t n) {
  SCOPED_TRACE(::testing::Message() << "n " << n);
  const std::vector<T> gate = Random<T>(n, rng, 3.0f);
  const std::vector<T> up = Random<T>(n, rng);
  const std::vector<T> dy = Random<T>(n, rng);
  std::vector<T> y(n), dgate(n), dup(n);
  kernels::cpu::GeGluForward(gate.data(), up.data(), n, 0, 1, y.data());
  kernels::cpu::GeGluBackward(dy.data(), gate.data(), up.data(), n, 0, 1, dgate.data(), dup.data());
  DeviceBuffer<T> d_gate(gate), d_up(up), d_dy(dy);
  auto d_y = DeviceBuffer<T>::Poisoned(n);
  auto d_dgate = DeviceBuffer<T>::Poisoned(n);
  auto d_dup = DeviceBuffer<T>::Poisoned(n);
  ASSERT_CUDA_OK(kernels::cuda::GeGluForward(d_gate.get(), d_up.get(), n, d_y.get(), nullptr));
  ASSERT_CUDA_OK(kernels::cuda::GeGluBackward(d_dy.get(), d_gate.get(), d_up.get(), n,
                                              d_dgate.get(), d_dup.get(), nullptr));
  ExpectClose(d_y.ToHost(), y, "y");
  ExpectClose(d_dgate.ToHost(), dgate, "dgate");
  ExpectClose(d_dup.ToHost(), dup, "dup");
}

TEST_F(CudaKernelsTest, GeGluMatchesTheCpuKernel) {
  for (int64_t n : {1, 65, 2048 * 2816}) {
    CheckGeGlu<float>(rng_, n);
    CheckGeGlu<BFloat16>(rng_, n);
    CheckGeGlu<Half>(rng_, n);
  }
}

template <typename T>
void CheckDropout(std::mt19937_64& rng, int64_t rows, int64_t cols, double p) {
  const std::vector<T> x = Random<T>(rows * cols, rng);
  std::vector<T> y(rows * cols);
  const uint64_t seed = rng();
  kernels::cpu::Dropout(x.data(), seed, p, cols, 0, rows, y.data());
  DeviceBuffer<T> d_x(x);
  auto d_y = DeviceBuffer<T>::Poisoned(rows * cols);
  ASSERT_CUDA_OK(kernels::cuda::Dropout(d_x.get(), seed, p, rows, cols, d_y.get(), nullptr));
  const std::vector<T> gpu = d_y.ToHost();
  for (size_t i = 0; i < y.size(); ++i) {
    // The same mask bit for bit; the kept values are x * scale on both sides.
    ASSERT_EQ(Load(gpu[i]) == 0.0f, Load(y[i]) == 0.0f) << "element " << i;
  }
  ExpectClose(gpu, y, "y");
}

TEST_F(CudaKernelsTest, DropoutDrawsTheCpuKernelsMask) {
  CheckDropout<float>(rng_, 1, 65, 0.1);
  CheckDropout<float>(rng_, 300, 1024, 0.5);
  CheckDropout<BFloat16>(rng_, 7, 65, 0.3);
  CheckDropout<Half>(rng_, 7, 65, 0.3);
}

}  // namespace
}  // namespace lathe
