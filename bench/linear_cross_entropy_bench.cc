// Fused linear cross-entropy (kernels/ops) against the unfused libtorch composition
// (at::matmul + at::cross_entropy_loss + backward), measured in the same run on the same
// inputs: wall time of loss forward + backward (median and minimum over --reps, the two
// implementations alternating), and the peak of libtorch CPU memory allocated during it, as
// the engine's MemoryTracker counts it (exact bytes; BLAS-internal buffers are not seen by
// either side).
//
//   build/bin/linear_cross_entropy_bench --threads 2   # 2048 tokens, hidden 1024, vocab 32000
//
// Three cases: `full` (hidden and the LM head weight both train: dH and dW), `lora` (the LM
// head is frozen: dH only) and `bf16-head` (a bf16 job's frozen bfloat16 head with float32
// hidden, dH only: the fused op on the bfloat16 head as it is, against the engine's former
// way, the head widened to float32 for every call and then the fused op; run it again with
// LATHE_CPU_BF16=0 for the fallback that widens the head a chunk at a time). Prints a
// Markdown table for bench/RESULTS.md.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/command_line.h"
#include "kernels/cpu/matmul.h"
#include "kernels/ops/linear_cross_entropy.h"
#include "kernels/ops/torch_compat.h"
#include "worker/engine/memory_tracker.h"

namespace lathe {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

struct Measurement {
  std::vector<double> seconds;
  int64_t peak_bytes = 0;  // above what was allocated before the run
  int64_t gradient_bytes = 0;
  double loss = 0.0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

enum class Implementation {
  kFused,
  kUnfused,
  kFusedWidened,  // weight.to(hidden's dtype), then the fused op
};

// One loss forward + backward; the gradients are dropped afterwards.
void RunOnce(Implementation implementation, at::Tensor& hidden, at::Tensor& weight,
             const at::Tensor& targets, const kernels::LinearCrossEntropyOptions& options,
             MemoryTracker& tracker, Measurement& m) {
  tracker.ResetPeaks();
  const int64_t before = tracker.Snapshot().total.current_bytes;
  const auto start = std::chrono::steady_clock::now();
  {
    at::Tensor loss;
    if (implementation == Implementation::kFused) {
      loss = kernels::LinearCrossEntropy(hidden, weight, targets, options);
    } else if (implementation == Implementation::kFusedWidened) {
      loss = kernels::LinearCrossEntropy(hidden, weight.to(hidden.scalar_type()), targets, options);
    } else {
      // As the engine's unfused loss: the logits live only as long as autograd needs them.
      loss = at::cross_entropy_loss(at::matmul(hidden, weight.t()), targets, {}, at::Reduction::Sum,
                                    options.ignore_index);
    }
    loss.backward();
    m.loss = loss.item<double>();
  }
  const auto end = std::chrono::steady_clock::now();
  m.seconds.push_back(std::chrono::duration<double>(end - start).count());
  m.peak_bytes = std::max(m.peak_bytes, tracker.Snapshot().total.peak_bytes - before);
  m.gradient_bytes = 0;
  for (at::Tensor* t : {&hidden, &weight}) {
    if (t->grad().defined()) m.gradient_bytes += t->grad().nbytes();
    t->mutable_grad().reset();
  }
}

double CoresBusy() {
  double load = 0.0;
  if (getloadavg(&load, 1) != 1) return -1.0;
  return load;
}

int Main(int argc, char** argv) {
  MemoryTracker* tracker = MemoryTracker::Install();
  const std::vector<FlagSpec> specs = {
      {"tokens", true, "tokens N (default 2048)"},
      {"hidden", true, "hidden size H (default 1024)"},
      {"vocab", true, "vocabulary V (default 32000)"},
      {"reps", true, "repetitions per implementation and case (default 5)"},
      {"threads", true, "libtorch threads (default: libtorch's choice)"},
      {"budget-mib", true, "fused op's memory budget in MiB (default: the op's default)"},
      {"cases", true, "full,lora,bf16-head (default all)"},
  };
  const absl::StatusOr<ParsedFlags> flags =
      ParseFlags(std::vector<std::string>(argv + 1, argv + argc), specs);
  if (!flags.ok()) {
    std::fprintf(stderr, "%s\nflags:\n%s", std::string(flags.status().message()).c_str(),
                 FlagsHelp(specs).c_str());
    return 2;
  }
  const int64_t tokens = flags->GetInt("tokens", 2048).value_or(2048);
  const int64_t hidden_size = flags->GetInt("hidden", 1024).value_or(1024);
  const int64_t vocab = flags->GetInt("vocab", 32000).value_or(32000);
  const int64_t reps = flags->GetInt("reps", 5).value_or(5);
  const int64_t threads = flags->GetInt("threads", 0).value_or(0);
  const std::string cases = flags->Get("cases", "full,lora,bf16-head");
  kernels::LinearCrossEntropyOptions options;
  if (flags->Has("budget-mib")) {
    options.memory_budget_bytes = flags->GetInt("budget-mib", 16).value_or(16) << 20;
  }
  if (threads > 0) at::set_num_threads(static_cast<int>(threads));

  at::manual_seed(0);
  at::Tensor hidden = at::randn({tokens, hidden_size});
  at::Tensor weight = at::randn({vocab, hidden_size}) * (3.0 / std::sqrt(hidden_size));
  at::Tensor bf16_weight = weight.to(at::kBFloat16);
  const at::Tensor targets = at::randint(vocab, {tokens}, at::kLong);

  std::printf(
      "tokens %ld, hidden %ld, vocab %ld, float32, %d threads, %ld reps, budget %.0f MiB, "
      "native bf16 products: %s, load average before: %.2f\n\n",
      static_cast<long>(tokens), static_cast<long>(hidden_size), static_cast<long>(vocab),
      at::get_num_threads(), static_cast<long>(reps), options.memory_budget_bytes / kMiB,
      kernels::cpu::NativeBFloat16Products() ? "yes" : "no", CoresBusy());
  std::printf(
      "| case | implementation | median s | min s | peak MiB | peak less gradients MiB | loss |\n"
      "| --- | --- | ---: | ---: | ---: | ---: | ---: |\n");
  std::string summary;
  for (const std::string name : {"full", "lora", "bf16-head"}) {
    if (cases.find(name) == std::string::npos) continue;
    const bool bf16_head = name == "bf16-head";
    at::Tensor& head = bf16_head ? bf16_weight : weight;
    hidden.requires_grad_(true);
    weight.requires_grad_(name == "full");
    // The baseline (measured into `unfused`): the unfused composition, or for the bfloat16
    // head the former way.
    const Implementation baseline =
        bf16_head ? Implementation::kFusedWidened : Implementation::kUnfused;
    const char* baseline_label = bf16_head ? "widened+fused" : "unfused";
    Measurement fused;
    Measurement unfused;
    RunOnce(Implementation::kFused, hidden, head, targets, options, *tracker, fused);  // warm-up
    RunOnce(baseline, hidden, head, targets, options, *tracker, unfused);
    fused = Measurement();
    unfused = Measurement();
    for (int64_t r = 0; r < reps; ++r) {
      // Alternate which goes first, so that drift on a shared machine hits both.
      const bool fused_first = r % 2 == 0;
      RunOnce(fused_first ? Implementation::kFused : baseline, hidden, head, targets, options,
              *tracker, fused_first ? fused : unfused);
      RunOnce(fused_first ? baseline : Implementation::kFused, hidden, head, targets, options,
              *tracker, fused_first ? unfused : fused);
    }
    for (const auto& [label, m] : {std::pair<const char*, const Measurement*>{"fused", &fused},
                                   {baseline_label, &unfused}}) {
      std::printf("| %s | %s | %.3f | %.3f | %.1f | %.1f | %.6g |\n", name.c_str(), label,
                  Median(m->seconds), *std::min_element(m->seconds.begin(), m->seconds.end()),
                  m->peak_bytes / kMiB, (m->peak_bytes - m->gradient_bytes) / kMiB, m->loss);
    }
    summary += absl::StrFormat(
        "%s: time fused/%s %.3fx (median), peak memory %s/fused %.1fx (%.1fx less "
        "gradients), loss relative difference %.2e\n",
        name, baseline_label, baseline_label, Median(fused.seconds) / Median(unfused.seconds),
        static_cast<double>(unfused.peak_bytes) / fused.peak_bytes,
        static_cast<double>(unfused.peak_bytes - unfused.gradient_bytes) /
            (fused.peak_bytes - fused.gradient_bytes),
        std::abs(fused.loss - unfused.loss) / std::abs(unfused.loss));
  }
  std::printf("\n%s", summary.c_str());
  return 0;
}

}  // namespace
}  // namespace lathe

int main(int argc, char** argv) { return lathe::Main(argc, argv); }
