// Shared helpers of the kernel tests: fresh random inputs, error measures against a float64
// reference, and the tolerance per dtype.
#ifndef LATHE_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
#define LATHE_TESTS_KERNELS_KERNEL_TEST_UTIL_H_

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/float16.h"
#include "kernels/ops/torch_compat.h"

namespace lathe::testing {

// A seed that differs from run to run (fresh inputs); tests print it on failure.
inline uint64_t FreshSeed() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) | device();
}

// A CPU generator seeded with a fresh seed, reported through SCOPED_TRACE by the caller.
inline at::Generator Generator(uint64_t seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

// Normal(0, std) values rounded to `type`.
inline at::Tensor Randn(at::IntArrayRef shape, at::ScalarType type, at::Generator& gen,
                        double std = 1.0) {
  return (at::randn(shape, gen, at::kDouble) * std).to(type);
}

// max |got - want| / max |want|, in float64: the normwise relative error, which stays
// meaningful where individual elements of `want` are near zero.
inline double RelErr(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.detach().to(at::kDouble);
  const at::Tensor w = want.detach().to(at::kDouble);
  EXPECT_EQ(g.sizes(), w.sizes());
  const double scale = w.numel() == 0 ? 0.0 : w.abs().max().item<double>();
  const double diff = w.numel() == 0 ? 0.0 : (g - w).abs().max().item<double>();
  if (!std::isfinite(diff)) return std::numeric_limits<double>::infinity();
  return diff / std::max(scale, 1e-30);
}

// |got - want| / |want|, the same measure for one value.
inline double RelErr(double got, double want) {
  const double diff = std::abs(got - want);
  if (!std::isfinite(diff)) return std::numeric_limits<double>::infinity();
  return diff / std::max(std::abs(want), 1e-30);
}

// The tolerance of the task for each dtype: float32 1e-5, bfloat16 1e-2, float16 2e-3. It
// covers rounding to the dtype and short sums; a result that sums many terms takes the
// overload below.
inline double Tolerance(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return 1e-5;
    case at::kBFloat16:
      return 1e-2;
    case at::kHalf:
      return 2e-3;
    default:
      return 0;
  }
}

// The tolerance of results that are sums of `reduction` terms accumulated in float32 (every
// kernel here, whatever its dtype, accumulates in float32), compared normwise (RelErr) with a
// float64 reference: the dtype's own tolerance plus the sum's rounding. A float32 sum of n
// terms, in whatever order a kernel adds them (oneDNN's AVX-512 and AVX2 kernels block the
// sum differently), errs by at most n*u relative to the sum of the terms' magnitudes (u =
// 2^-24), and, with its roundings independent and of mean zero, by at most lambda*sqrt(n)*u
// with probability 1 - 2exp(-lambda^2/2) (Higham and Mary, SIAM J. Sci. Comput. 41(5),
// 2019). lambda = 8 leaves ~1e-14 per sum. The factor 2 is the ratio of the terms' magnitudes
// to the largest result: at most 2 for a softmax gradient (sum(p - y) = 0, sum|p - y| <= 2);
// for products of random rows about 0.16 sqrt(n), over 2 past n = 150, which the typical
// error (lambda ~ 2, not 8) covers. So a float32 sum over 32k terms is promised 1.7e-4, not 1e-5.
inline double Tolerance(at::ScalarType type, int64_t reduction) {
  constexpr double kLambda = 8.0, kFloat32UnitRoundoff = 0x1p-24;
  return Tolerance(type) +
         2.0 * kLambda * std::sqrt(static_cast<double>(reduction)) * kFloat32UnitRoundoff;
}

// A vector of n NaNs of kernel element type T: a poisoned output buffer.
template <typename T>
std::vector<T> Poisoned(int64_t n) {
  return std::vector<T>(n, kernels::Store<T>(std::numeric_limits<float>::quiet_NaN()));
}

// Index of the first non-finite element of v, or -1.
template <typename T>
int64_t FirstNonFinite(const std::vector<T>& v) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(kernels::Load(v[i]))) return static_cast<int64_t>(i);
  }
  return -1;
}

// The element types every raw CPU kernel takes, for typed tests of the kernels:
//   template <typename T> class FooKernelTest : public ::testing::Test {};
//   TYPED_TEST_SUITE(FooKernelTest, testing::KernelElementTypes, testing::KernelElementTypeNames);
using KernelElementTypes = ::testing::Types<float, kernels::BFloat16, kernels::Half>;

// Names the typed tests after their element type: FooKernelTest/Float.Bar.
struct KernelElementTypeNames {
  template <typename T>
  static std::string GetName(int) {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, kernels::BFloat16> ||
                  std::is_same_v<T, kernels::Half>);
    if constexpr (std::is_same_v<T, float>) {
      return "Float";
    } else if constexpr (std::is_same_v<T, kernels::BFloat16>) {
      return "BFloat16";
    } else {
      return "Half";
    }
  }
};

// n values from Normal(0, 1) rounded to T.
template <typename T>
std::vector<T> RandomVector(int64_t n, std::mt19937_64& rng, float std = 1.0f) {
  std::normal_distribution<float> normal(0.0f, std);
  std::vector<T> v(n);
  for (T& e : v) e = kernels::Store<T>(normal(rng));
  return v;
}

}  // namespace lathe::testing

#endif  // LATHE_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
