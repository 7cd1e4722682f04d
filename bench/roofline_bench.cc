// The CPU's matrix-product speed, the "roofline" that the trainer's numbers are stated against
// (issue #16): GFLOP/s of OpenBLAS's sgemm and of oneDNN's matmul in float32 and in bf16 x
// bf16 with float32 accumulation, side by side on the same inputs, for large squares and the
// products of bench/train_bench.py's "small" model. All row-major, C[M, N] float32, in both
// layouts that training uses:
//   NT  C = A W^T, W given as [N, K] (a linear layer's forward; oneDNN reads it through its
//       strides, format tag ba, not a copy);
//   NN  C = A B, B given as [K, N] (its input gradient, dy W).
// Each cell: oneDNN's primitive built once, outside the timed loop; a warm-up; then the
// median of repetitions until at least 5 and at least 0.3 s. One cell per shape and layout is
// checked against OpenBLAS before the numbers count. Prints the machine, then one markdown
// table for bench/RESULTS.md. No libtorch.
//
//   build/bin/roofline_bench [--quick]   (--quick: a smaller set of shapes, under a minute)
//
// Threads: 1 and every core, through omp_set_num_threads, which sets both libraries (Debian's
// OpenBLAS and oneDNN both use the OpenMP runtime). The bf16 column needs AVX512-BF16 or AMX
// (read from /proc/cpuinfo); LATHE_CPU_BF16=0 leaves it out, as it does in the engine.
#include <cblas.h>
#include <dlfcn.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <map>
#include <oneapi/dnnl/dnnl.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using dnnl::memory;

constexpr double kMinSeconds = 0.3;
constexpr int kMinRepetitions = 5;
// Relative Frobenius error of oneDNN's C against OpenBLAS's float32 C on the same inputs.
// float32 differs only in summation order (under 1e-6 here); bf16 rounds A and B to 8 bits of
// mantissa (~2e-3 on these random inputs). A wrong layout or stride gives ~1.
constexpr double kFloat32Tolerance = 1e-4;
constexpr double kBFloat16Tolerance = 1e-2;

struct Shape {
  const char* name;
  int64_t m, k, n;
  bool all_threads_only;  // too slow on one thread for the run's budget
  bool quick;             // in the --quick set
};

// bench/train_bench.py's "small" model: vocab 8192, hidden 512, 8 heads and 4 kv heads of 64,
// intermediate 1408, micro-batch 4 x seq_len 256 = 1024 tokens; LoRA rank 16 there, rank 8 in
// issue #16. The attention rows time one head's product alone, not the micro-batch's 32.
const Shape kShapes[] = {
    {"square", 1024, 1024, 1024, false, true},
    {"square", 2048, 2048, 2048, false, false},
    {"square", 4096, 4096, 4096, true, false},
    {"issue #16", 2048, 512, 1536, false, true},
    {"issue #16, vocabulary 32000", 2048, 512, 32000, false, false},
    {"q, o projection", 1024, 512, 512, false, true},
    {"k, v projection", 1024, 512, 256, false, false},
    {"q/k/v fused", 1024, 512, 1024, false, false},
    {"gate, up projection", 1024, 512, 1408, false, true},
    {"gate/up fused", 1024, 512, 2816, false, false},
    {"down projection", 1024, 1408, 512, false, false},
    {"LM head, one loss chunk", 1024, 512, 8192, false, true},
    {"LoRA down, rank 8", 1024, 512, 8, false, true},
    {"LoRA up, rank 8", 1024, 8, 512, false, true},
    {"LoRA down, rank 16", 1024, 512, 16, false, false},
    {"LoRA up, rank 16", 1024, 16, 512, false, false},
    {"attention q k^T, one head", 256, 64, 256, false, true},
    {"attention p v, one head", 256, 256, 64, false, true},
};

enum class Layout { kNT, kNN };

const char* LayoutName(Layout layout) { return layout == Layout::kNT ? "NT" : "NN"; }

struct CpuInfo {
  std::string model = "unknown";
  std::set<std::string> flags;
};

// The first processor's model name and flags.
CpuInfo ReadCpuInfo() {
  CpuInfo info;
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  bool have_model = false, have_flags = false;
  while ((!have_model || !have_flags) && std::getline(in, line)) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    key.erase(key.find_last_not_of(" \t") + 1);
    const std::string value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    if (key == "model name" && !have_model) {
      info.model = value;
      have_model = true;
    } else if (key == "flags" && !have_flags) {
      std::istringstream words(value);
      for (std::string flag; words >> flag;) info.flags.insert(flag);
      have_flags = true;
    }
  }
  return info;
}

// Uniform in [-1, 1), from a fixed seed: the same inputs every run.
void FillRandom(std::vector<float>& values, uint64_t seed) {
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  for (float& v : values) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    v = static_cast<float>(state >> 40) * (2.0f / 16777216.0f) - 1.0f;
  }
}

// Round to nearest even (the inputs are finite).
std::vector<uint16_t> ToBFloat16(const std::vector<float>& values) {
  std::vector<uint16_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    uint32_t bits = 0;
    std::memcpy(&bits, &values[i], sizeof(bits));
    bits += 0x7fff + ((bits >> 16) & 1);
    out[i] = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    norm += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

// Median seconds of one call to `product`: warm-up (one call, then more until 0.05 s), then
// repetitions until at least kMinRepetitions and kMinSeconds.
double MedianSeconds(const std::function<void()>& product) {
  using Clock = std::chrono::steady_clock;
  const auto seconds_since = [](Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  const auto warm_start = Clock::now();
  do {
    product();
  } while (seconds_since(warm_start) < 0.05);
  std::vector<double> times;
  double total = 0;
  while (times.size() < static_cast<size_t>(kMinRepetitions) || total < kMinSeconds) {
    const auto start = Clock::now();
    product();
    times.push_back(seconds_since(start));
    total += times.back();
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// One oneDNN matmul, its primitive built for the current thread count.
class OneDnnProduct {
 public:
  OneDnnProduct(const dnnl::engine& engine, const Shape& s, Layout layout, memory::data_type input,
                const void* a, const void* b, float* c)
      : pd_(dnnl::matmul::desc(
                memory::desc({s.m, s.k}, input, memory::format_tag::ab),
                memory::desc(
                    {s.k, s.n}, input,
                    layout == Layout::kNT ? memory::format_tag::ba : memory::format_tag::ab),
                memory::desc({s.m, s.n}, memory::data_type::f32, memory::format_tag::ab)),
            engine),
        primitive_(pd_),
        a_(pd_.src_desc(), engine, const_cast<void*>(a)),
        b_(pd_.weights_desc(), engine, const_cast<void*>(b)),
        c_(pd_.dst_desc(), engine, c) {}

  void Run(dnnl::stream& stream) const {
    primitive_.execute(stream, {{DNNL_ARG_SRC, a_}, {DNNL_ARG_WEIGHTS, b_}, {DNNL_ARG_DST, c_}});
    stream.wait();
  }

  std::string Implementation() const { return pd_.impl_info_str(); }

 private:
  dnnl::matmul::primitive_desc pd_;
  dnnl::matmul primitive_;
  memory a_, b_, c_;
};

struct Best {
  double gflops = 0;
  std::string where;

  void Offer(double value, const std::string& what) {
    if (value > gflops) {
      gflops = value;
      where = what;
    }
  }
};

std::string Dims(const Shape& s) {
  char text[64];
  std::snprintf(text, sizeof(text), "%lld x %lld x %lld", static_cast<long long>(s.m),
                static_cast<long long>(s.k), static_cast<long long>(s.n));
  return text;
}

int Run(bool quick) {
  const CpuInfo cpu = ReadCpuInfo();
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // bf16 as the kernels decide it (kernels/cpu/matmul.h): the CPU has it, oneDNN may use it
  // (ONEDNN_MAX_CPU_ISA=AVX2 caps it, as an AVX2-only CPU), and LATHE_CPU_BF16 is not 0.
  const bool cpu_has_bf16 = cpu.flags.count("avx512_bf16") > 0 || cpu.flags.count("amx_bf16") > 0;
  const auto bf16_isa = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
  const bool isa_bf16 =
      (static_cast<unsigned>(dnnl::get_effective_cpu_isa()) & bf16_isa) == bf16_isa;
  const char* env_bf16 = std::getenv("LATHE_CPU_BF16");
  const bool bf16_disabled = env_bf16 != nullptr && std::strcmp(env_bf16, "0") == 0;
  const bool run_bf16 = cpu_has_bf16 && isa_bf16 && !bf16_disabled;
  const char* bf16_missing = !cpu_has_bf16 ? "n/a (no AVX512-BF16/AMX)"
                             : !isa_bf16   ? "n/a (oneDNN capped below AVX512-BF16)"
                                           : "n/a (LATHE_CPU_BF16=0)";

  std::string flags;
  for (const char* flag :
       {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}) {
    if (cpu.flags.count(flag) > 0) flags += std::string(flags.empty() ? "" : " ") + flag;
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  const dnnl_version_t* version = dnnl_version();
  // libblas.so.3 is whichever BLAS the alternatives point at; OpenBLAS says so by name.
  using ConfigFn = char* (*)();
  const auto openblas_config =
      reinterpret_cast<ConfigFn>(dlsym(RTLD_DEFAULT, "openblas_get_config"));
  std::printf("CPU: %s; flags: %s; cores: %d; %s\n", cpu.model.c_str(),
              flags.empty() ? "none of avx2 fma avx512f" : flags.c_str(), cores, date);
  std::printf("oneDNN %d.%d.%d, OpenMP; BLAS: %s\n", version->major, version->minor, version->patch,
              openblas_config != nullptr ? openblas_config() : "not OpenBLAS");
  std::printf("GFLOP/s = 2 M K N / median seconds; %s\n\n", quick ? "--quick set" : "full set");

  std::vector<int> thread_counts = {1};
  if (cores > 1) thread_counts.push_back(cores);

  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  std::map<std::string, std::vector<std::string>> implementations[2];  // f32, bf16
  std::map<int, Best> best_f32, best_bf16;
  double worst_f32_error = 0, worst_bf16_error = 0;

  std::printf(
      "| shape | M x K x N | layout | threads | OpenBLAS f32 | oneDNN f32 | oneDNN bf16 | "
      "oneDNN f32 / OpenBLAS |\n");
  std::printf("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |\n");
  std::fflush(stdout);
  for (const Shape& s : kShapes) {
    if (quick && !s.quick) continue;
    const double flop = 2.0 * s.m * s.k * s.n;
    std::vector<float> a(s.m * s.k), b(s.k * s.n), c_blas(s.m * s.n), c_dnnl(s.m * s.n);
    FillRandom(a, static_cast<uint64_t>(s.m * 7 + s.k));
    FillRandom(b, static_cast<uint64_t>(s.k * 13 + s.n));
    std::vector<uint16_t> a_bf16, b_bf16;
    if (run_bf16) {
      a_bf16 = ToBFloat16(a);
      b_bf16 = ToBFloat16(b);
    }
    for (Layout layout : {Layout::kNT, Layout::kNN}) {
      bool checked = false;
      for (int threads : thread_counts) {
        if (s.all_threads_only && threads != cores) continue;
        omp_set_num_threads(threads);
        const std::string cell = std::string(s.name) + " " + Dims(s) + " " + LayoutName(layout);

        const double blas_seconds = MedianSeconds([&] {
          cblas_sgemm(CblasRowMajor, CblasNoTrans,
                      layout == Layout::kNT ? CblasTrans : CblasNoTrans, s.m, s.n, s.k, 1.0f,
                      a.data(), s.k, b.data(), layout == Layout::kNT ? s.k : s.n, 0.0f,
                      c_blas.data(), s.n);
        });
        const double blas = flop / blas_seconds / 1e9;

        const OneDnnProduct f32(engine, s, layout, memory::data_type::f32, a.data(), b.data(),
                                c_dnnl.data());
        const double dnnl_f32 = flop / MedianSeconds([&] { f32.Run(stream); }) / 1e9;
        implementations[0][f32.Implementation()].push_back(cell);
        if (!checked) {
          const double error = RelativeError(c_dnnl, c_blas);
          worst_f32_error = std::max(worst_f32_error, error);
          if (!(error <= kFloat32Tolerance)) {
            std::fprintf(stderr,
                         "roofline_bench: oneDNN f32 disagrees with OpenBLAS on %s: relative "
                         "error %.3g (tolerance %.0e)\n",
                         cell.c_str(), error, kFloat32Tolerance);
            return 1;
          }
        }
        best_f32[threads].Offer(blas, "OpenBLAS " + cell);
        best_f32[threads].Offer(dnnl_f32, "oneDNN " + cell);

        char bf16_text[64];
        std::snprintf(bf16_text, sizeof(bf16_text), "%s", bf16_missing);
        if (run_bf16) {
          const OneDnnProduct bf16(engine, s, layout, memory::data_type::bf16, a_bf16.data(),
                                   b_bf16.data(), c_dnnl.data());
          const double dnnl_bf16 = flop / MedianSeconds([&] { bf16.Run(stream); }) / 1e9;
          implementations[1][bf16.Implementation()].push_back(cell);
          if (!checked) {
            const double error = RelativeError(c_dnnl, c_blas);
            worst_bf16_error = std::max(worst_bf16_error, error);
            if (!(error <= kBFloat16Tolerance)) {
              std::fprintf(stderr,
                           "roofline_bench: oneDNN bf16 disagrees with OpenBLAS f32 on %s: "
                           "relative error %.3g (tolerance %.0e)\n",
                           cell.c_str(), error, kBFloat16Tolerance);
              return 1;
            }
          }
          best_bf16[threads].Offer(dnnl_bf16, "oneDNN " + cell);
          std::snprintf(bf16_text, sizeof(bf16_text), "%.1f", dnnl_bf16);
        }
        checked = true;

        std::printf("| %s | %s | %s | %d | %.1f | %.1f | %s | %.2fx |\n", s.name, Dims(s).c_str(),
                    LayoutName(layout), threads, blas, dnnl_f32, bf16_text, dnnl_f32 / blas);
        std::fflush(stdout);
      }
    }
  }

  std::printf("\n");
  const char* dtype_names[2] = {"f32", "bf16"};
  for (int d = 0; d < 2; ++d) {
    for (const auto& [impl, cells] : implementations[d]) {
      std::printf("oneDNN %s implementation %s: %zu cells, e.g. %s\n", dtype_names[d], impl.c_str(),
                  cells.size(), cells.front().c_str());
    }
  }
  std::printf("checked against OpenBLAS f32 (relative Frobenius error, worst): f32 %.2g",
              worst_f32_error);
  if (run_bf16) std::printf(", bf16 %.2g", worst_bf16_error);
  std::printf("\n");
  for (int threads : thread_counts) {
    std::printf("roofline, %d thread%s: f32 %.1f GFLOP/s (%s); bf16 ", threads,
                threads == 1 ? "" : "s", best_f32[threads].gflops, best_f32[threads].where.c_str());
    if (run_bf16) {
      std::printf("%.1f GFLOP/s (%s)\n", best_bf16[threads].gflops,
                  best_bf16[threads].where.c_str());
    } else {
      std::printf("%s\n", bf16_missing);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]);
      return 2;
    }
  }
  try {
    return Run(quick);
  } catch (const dnnl::error& e) {
    std::fprintf(stderr, "roofline_bench: oneDNN: %s (status %d)\n", e.what(),
                 static_cast<int>(e.status));
    return 1;
  }
}
