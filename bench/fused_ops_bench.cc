// Fused ops (kernels/ops) against the unfused ATen compositions they replace
// (kernels/ops/unfused.h, as worker/engine/causal_lm.cc computes today), measured in the same
// run on the same inputs, fused and unfused alternating rep by rep:
//   - time: median over reps of the forward alone and of forward + backward;
//   - saved: bytes still held after the forward beyond the output (what the graph keeps for
//     backward; inputs are the caller's), from the engine's tracking allocator;
//   - peak: the highest bytes above the starting point during forward + backward, including
//     the gradients and every temporary.
// Prints a Markdown table. CPU only; shapes of a ~0.5B Llama layer. One row is not a fused
// kernel of Lathe's: causal attention as libtorch's scaled_dot_product_attention (its CPU
// flash kernel) in the "fused" columns against the engine's explicit softmax (q k^T + mask,
// softmax, p v, the products through kernels::BatchedMatmul, as CausalLm runs on the CPU).
//
//   fused_ops_bench [--reps N] [--tokens N] [--threads N]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "kernels/ops/lora_linear.h"
#include "kernels/ops/matmul.h"
#include "kernels/ops/rms_norm.h"
#include "kernels/ops/rope.h"
#include "kernels/ops/swiglu.h"
#include "kernels/ops/torch_compat.h"
#include "kernels/ops/unfused.h"
#include "worker/engine/memory_tracker.h"

namespace lathe {
namespace {

// One op on fixed inputs: forward builds the graph from the leaves.
struct Variant {
  std::function<at::Tensor()> forward;
};

struct Case {
  std::string op;
  std::string shape;
  Variant fused;
  Variant unfused;
  std::vector<at::Tensor> leaves;  // tensors that receive gradients
  at::Tensor dy;
};

struct Result {
  std::vector<double> forward_ms;
  std::vector<double> step_ms;
  int64_t saved_bytes = 0;
  int64_t peak_bytes = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double Millis(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
      .count();
}

void ClearGrads(const Case& c) {
  for (const at::Tensor& t : c.leaves) {
    at::Tensor leaf = t;
    leaf.mutable_grad().reset();
  }
}

void Step(const Case& c, const Variant& v) {
  at::Tensor y = v.forward();
  y.backward(c.dy);
  ClearGrads(c);
}

void MeasureMemory(MemoryTracker* tracker, const Case& c, const Variant& v, Result* r) {
  ClearGrads(c);
  {
    const int64_t before = tracker->Snapshot().total.current_bytes;
    at::Tensor y = v.forward();
    r->saved_bytes =
        tracker->Snapshot().total.current_bytes - before - y.numel() * y.element_size();
  }
  tracker->ResetPeaks();
  const int64_t before = tracker->Snapshot().total.current_bytes;
  {
    at::Tensor y = v.forward();
    y.backward(c.dy);
  }
  r->peak_bytes = tracker->Snapshot().total.peak_bytes - before;
  ClearGrads(c);
}

void Measure(MemoryTracker* tracker, const Case& c, int reps, Result* fused, Result* unfused) {
  for (int i = 0; i < 2; ++i) {  // warm-up: allocator, thread pool, BLAS buffers
    Step(c, c.fused);
    Step(c, c.unfused);
  }
  for (int i = 0; i < reps; ++i) {
    for (auto [v, r] : {std::pair{&c.fused, fused}, std::pair{&c.unfused, unfused}}) {
      auto start = std::chrono::steady_clock::now();
      { at::Tensor y = v->forward(); }
      r->forward_ms.push_back(Millis(start));
      start = std::chrono::steady_clock::now();
      Step(c, *v);
      r->step_ms.push_back(Millis(start));
    }
  }
  MeasureMemory(tracker, c, c.fused, fused);
  MeasureMemory(tracker, c, c.unfused, unfused);
}

double MiB(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

at::Tensor Leaf(at::IntArrayRef shape, at::ScalarType type = at::kFloat, double std = 1.0) {
  return (at::randn(shape) * std).to(type).requires_grad_(true);
}

at::Tensor Frozen(at::IntArrayRef shape, at::ScalarType type = at::kFloat, double std = 1.0) {
  return (at::randn(shape) * std).to(type);
}

std::vector<Case> Cases(int64_t tokens) {
  const int64_t hidden = 1024, heads = 16, head_dim = 64, inter = 2816, rank = 16;
  const double eps = 1e-6, scale = 2.0;
  const std::string t = std::to_string(tokens);
  std::vector<Case> cases;

  for (at::ScalarType wtype : {at::kFloat, at::kBFloat16}) {
    at::Tensor x = Leaf({tokens, hidden});
    at::Tensor w = (1.0 + 0.1 * at::randn({hidden})).to(wtype);  // frozen (LoRA training)
    Case c{"RMSNorm",
           t + "x" + std::to_string(hidden) + (wtype == at::kFloat ? "" : ", bf16 weight"),
           {[=] { return kernels::RmsNorm(x, w, eps); }},
           {[=] { return kernels::unfused::RmsNorm(x, w, eps); }},
           {x},
           at::randn({tokens, hidden})};
    cases.push_back(c);
  }
  {
    // The attention's q: the projection output [1, tokens, heads, head_dim] transposed.
    at::Tensor q = Frozen({1, tokens, heads, head_dim}).transpose(1, 2).requires_grad_(true);
    at::Tensor inv_freq = 1.0 / at::pow(10000.0, at::arange(0, head_dim, 2).to(at::kFloat) /
                                                     static_cast<double>(head_dim));
    at::Tensor freqs = at::outer(at::arange(tokens, at::kFloat), inv_freq);
    at::Tensor emb = at::cat({freqs, freqs}, -1);
    at::Tensor cos = emb.cos(), sin = emb.sin();
    Case c{"RoPE",
           "q " + std::to_string(heads) + "x" + t + "x" + std::to_string(head_dim),
           {[=] { return kernels::Rope(q, cos, sin); }},
           {[=] { return kernels::unfused::Rope(q, cos, sin); }},
           {q},
           at::randn({1, heads, tokens, head_dim})};
    cases.push_back(c);
  }
  {
    // Causal attention over one sequence: q, k, v [1, heads, tokens, head_dim].
    at::Tensor q = Leaf({1, heads, tokens, head_dim}), k = Leaf({1, heads, tokens, head_dim});
    at::Tensor v = Leaf({1, heads, tokens, head_dim});
    at::Tensor mask = at::full({tokens, tokens}, -std::numeric_limits<float>::infinity()).triu(1);
    const double scale_qk = 1.0 / std::sqrt(static_cast<double>(head_dim));
    Case c{"Attention: SDPA vs explicit",
           std::to_string(heads) + "x" + t + "x" + std::to_string(head_dim) + ", causal",
           {[=] { return at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true); }},
           {[=] {
             at::Tensor scores = kernels::BatchedMatmul(q, k.transpose(-2, -1)) * scale_qk;
             return kernels::BatchedMatmul(at::softmax(scores + mask, -1), v, false, true);
           }},
           {q, k, v},
           at::randn({1, heads, tokens, head_dim})};
    cases.push_back(c);
  }
  {
    at::Tensor gate = Leaf({tokens, inter}, at::kFloat, 2.0), up = Leaf({tokens, inter});
    Case c{"SwiGLU",
           t + "x" + std::to_string(inter),
           {[=] { return kernels::SwiGlu(gate, up); }},
           {[=] { return kernels::unfused::SwiGlu(gate, up); }},
           {gate, up},
           at::randn({tokens, inter})};
    cases.push_back(c);
  }
  struct Lora {
    const char* name;
    int64_t in, out;
    at::ScalarType wtype;
    double dropout;
  };
  for (const Lora& l : {Lora{"q_proj", hidden, hidden, at::kFloat, 0.0},
                        Lora{"q_proj", hidden, hidden, at::kFloat, 0.1},
                        Lora{"q_proj", hidden, hidden, at::kBFloat16, 0.1},
                        Lora{"up_proj", hidden, inter, at::kFloat, 0.05},
                        Lora{"down_proj", inter, hidden, at::kFloat, 0.05}}) {
    at::Tensor x = Leaf({tokens, l.in});
    at::Tensor w = Frozen({l.out, l.in}, l.wtype, 0.03);
    at::Tensor a = Leaf({rank, l.in}, at::kFloat, 0.03);
    at::Tensor b = Leaf({l.out, rank}, at::kFloat, 0.03);
    const double p = l.dropout;
    std::string shape = std::string(l.name) + " " + t + "x" + std::to_string(l.in) + "->" +
                        std::to_string(l.out) + " r" + std::to_string(rank) +
                        (l.wtype == at::kFloat ? "" : ", bf16 W") + ", dropout " +
                        std::to_string(p).substr(0, 4);
    Case c{
        "LoRA linear",
        shape,
        {[=] { return kernels::LoraLinear(x, w, {}, a, b, scale, p, /*training=*/true); }},
        {[=] { return kernels::unfused::LoraLinear(x, w, {}, a, b, scale, p, /*training=*/true); }},
        {x, a, b},
        at::randn({tokens, l.out})};
    cases.push_back(c);
  }
  return cases;
}

int Main(int argc, char** argv) {
  int reps = 15;
  int64_t tokens = 2048;
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--reps") == 0) reps = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--tokens") == 0) tokens = std::atoll(argv[i + 1]);
    if (std::strcmp(argv[i], "--threads") == 0) threads = std::atoi(argv[i + 1]);
  }
  at::set_num_threads(std::max(threads, 1));
  MemoryTracker* tracker = MemoryTracker::Install();
  at::manual_seed(0);
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M", std::gmtime(&now));
  std::printf(
      "fused_ops_bench: %s UTC, %s, %d intra-op threads, libtorch %s, load average "
      "before %s, %d reps\n\n",
      date, CpuModel().c_str(), at::get_num_threads(), TORCH_VERSION, LoadAverage().c_str(), reps);
  std::printf(
      "| op | shape | fwd ms fused | fwd ms unfused | fwd+bwd ms fused | fwd+bwd ms "
      "unfused | fwd+bwd ratio | saved MiB fused | saved MiB unfused | peak MiB fused | "
      "peak MiB unfused |\n");
  std::printf("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const Case& c : Cases(tokens)) {
    Result fused, unfused;
    Measure(tracker, c, reps, &fused, &unfused);
    const double f_step = Median(fused.step_ms), u_step = Median(unfused.step_ms);
    std::printf("| %s | %s | %.2f | %.2f | %.2f | %.2f | %.2fx | %.2f | %.2f | %.2f | %.2f |\n",
                c.op.c_str(), c.shape.c_str(), Median(fused.forward_ms), Median(unfused.forward_ms),
                f_step, u_step, f_step / u_step, MiB(fused.saved_bytes), MiB(unfused.saved_bytes),
                MiB(fused.peak_bytes), MiB(unfused.peak_bytes));
    std::fflush(stdout);
  }
  std::printf("\nload average after %s\n", LoadAverage().c_str());
  return 0;
}

}  // namespace
}  // namespace lathe

int main(int argc, char** argv) { return lathe::Main(argc, argv); }
