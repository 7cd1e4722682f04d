#include "kernels/cpu/matmul.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <unordered_map>
#include <vector>

namespace lathe::kernels::cpu {
namespace {

using dnnl::memory;

dnnl::engine& CpuEngine() {
  static dnnl::engine* const engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

// Everything a primitive is built from.
struct Key {
  MatmulProblem p;
  float alpha, beta;

  bool operator==(const Key& o) const {
    return p.m == o.p.m && p.n == o.p.n && p.k == o.p.k && p.trans_a == o.p.trans_a &&
           p.trans_b == o.p.trans_b && p.lda == o.p.lda && p.ldb == o.p.ldb && p.ldc == o.p.ldc &&
           p.input == o.p.input && std::memcmp(&alpha, &o.alpha, sizeof(float)) == 0 &&
           std::memcmp(&beta, &o.beta, sizeof(float)) == 0;
  }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    size_t h = 0;
    auto mix = [&h](uint64_t v) { h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15 + (h << 6); };
    const MatmulProblem& p = key.p;
    for (int64_t v : {p.m, p.n, p.k, p.lda, p.ldb, p.ldc}) mix(static_cast<uint64_t>(v));
    uint32_t alpha = 0, beta = 0;
    std::memcpy(&alpha, &key.alpha, sizeof(float));
    std::memcpy(&beta, &key.beta, sizeof(float));
    mix((uint64_t{alpha} << 32) | beta);
    mix((p.trans_a ? 1 : 0) | (p.trans_b ? 2 : 0) | (static_cast<int>(p.input) << 2));
    return h;
  }
};

memory::desc Matrix(int64_t rows, int64_t cols, bool transposed, int64_t ld,
                    memory::data_type type) {
  // A transposed operand is read in place through its strides.
  return memory::desc({rows, cols}, type, transposed ? memory::dims{1, ld} : memory::dims{ld, 1});
}

dnnl::matmul::primitive_desc Describe(const Key& key) {
  const MatmulProblem& p = key.p;
  const memory::data_type in =
      p.input == MatmulInput::kBFloat16 ? memory::data_type::bf16 : memory::data_type::f32;
  dnnl::primitive_attr attr;
  // The caller's scratchpad: the library's own is shared by every thread of the process,
  // and ranks run as threads in tests (and would race).
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (key.alpha != 1.0f) attr.set_output_scales(0, {key.alpha});
  if (key.beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(key.beta);
    attr.set_post_ops(ops);
  }
  const dnnl::matmul::desc desc(Matrix(p.m, p.k, p.trans_a, p.lda, in),
                                Matrix(p.k, p.n, p.trans_b, p.ldb, in),
                                Matrix(p.m, p.n, false, p.ldc, memory::data_type::f32));
  return dnnl::matmul::primitive_desc(desc, attr, CpuEngine());
}

struct Compiled {
  explicit Compiled(const dnnl::matmul::primitive_desc& pd)
      : primitive(pd),
        a(pd.src_desc()),
        b(pd.weights_desc()),
        c(pd.dst_desc()),
        scratchpad(pd.scratchpad_desc()) {}
  dnnl::matmul primitive;
  memory::desc a, b, c, scratchpad;
};

// The primitive for `key`, built at its first use.
const Compiled& Primitive(const Key& key) {
  static std::mutex* const mu = new std::mutex;
  static auto* const cache = new std::unordered_map<Key, std::unique_ptr<Compiled>, KeyHash>;
  std::lock_guard<std::mutex> lock(*mu);
  std::unique_ptr<Compiled>& compiled = (*cache)[key];
  if (compiled == nullptr) compiled = std::make_unique<Compiled>(Describe(key));
  return *compiled;
}

std::string ImplementationOf(MatmulInput input) {
  MatmulProblem p;
  p.m = p.n = p.k = p.lda = p.ldb = p.ldc = 64;
  p.input = input;
  return Describe({p, 1.0f, 0.0f}).impl_info_str();
}

// MatmulTotal's counters, by input type (integers: atomics without a compare-and-swap loop).
struct Counters {
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> multiply_adds{0};
  std::atomic<int64_t> nanoseconds{0};
};

Counters& CountersOf(MatmulInput input) {
  static Counters* const counters = new Counters[2];
  return counters[input == MatmulInput::kBFloat16 ? 1 : 0];
}

}  // namespace

void Matmul(const MatmulProblem& p, const void* a, const void* b, float* c, float alpha,
            float beta) {
  if (p.m == 0 || p.n == 0) return;
  if (p.k == 0) {  // an empty sum: C = beta C
    for (int64_t i = 0; i < p.m; ++i) {
      float* row = c + i * p.ldc;
      for (int64_t j = 0; j < p.n; ++j) row[j] = beta == 0.0f ? 0.0f : beta * row[j];
    }
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  const Compiled& compiled = Primitive({p, alpha, beta});
  memory ma(compiled.a, CpuEngine(), const_cast<void*>(a));
  memory mb(compiled.b, CpuEngine(), const_cast<void*>(b));
  memory mc(compiled.c, CpuEngine(), c);
  thread_local std::vector<uint8_t> scratchpad;
  if (scratchpad.size() < compiled.scratchpad.get_size()) {
    scratchpad.resize(compiled.scratchpad.get_size());
  }
  memory ms(compiled.scratchpad, CpuEngine(), scratchpad.data());
  thread_local dnnl::stream stream(CpuEngine());
  compiled.primitive.execute(
      stream,
      {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}, {DNNL_ARG_SCRATCHPAD, ms}});
  stream.wait();
  Counters& counters = CountersOf(p.input);
  counters.calls.fetch_add(1, std::memory_order_relaxed);
  counters.multiply_adds.fetch_add(p.m * p.n * p.k, std::memory_order_relaxed);
  counters.nanoseconds.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count(),
      std::memory_order_relaxed);
}

MatmulTally MatmulTotal(MatmulInput input) {
  const Counters& counters = CountersOf(input);
  MatmulTally tally;
  tally.calls = counters.calls.load(std::memory_order_relaxed);
  tally.flops = 2.0 * static_cast<double>(counters.multiply_adds.load(std::memory_order_relaxed));
  tally.seconds = 1e-9 * static_cast<double>(counters.nanoseconds.load(std::memory_order_relaxed));
  return tally;
}

bool NativeBFloat16Products() {
  static const bool native = [] {
    const char* env = std::getenv("LATHE_CPU_BF16");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
    return (isa & bf16) == bf16;
  }();
  return native;
}

std::string MatmulBackend() {
  static const std::string backend =
      "onednn f32 " + ImplementationOf(MatmulInput::kFloat32) +
      (NativeBFloat16Products() ? ", bf16 " + ImplementationOf(MatmulInput::kBFloat16)
                                : std::string(", bf16 widened to f32"));
  return backend;
}

}  // namespace lathe::kernels::cpu
