// What profiling costs when it is off (docs/observability.md, "Profiling"): a ProfileScope
// with no profiler listening, and a CPU allocation through the MemoryTracker while it does
// not record, against the same allocation while it records. Best of 7 runs of 1M each, so
// that other processes on the machine inflate the figures less.
//
//   build/bin/profile_scope_bench
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <optional>

#include "kernels/ops/torch_compat.h"
#include "worker/engine/memory_tracker.h"
#include "worker/engine/profile_scope.h"

namespace lathe {
namespace {

constexpr int kIterations = 1000000;

// Nanoseconds per call of `body`, the best of 7 runs.
double NanosPerCall(const std::function<void(int)>& body) {
  double best = 1e30;
  for (int run = 0; run < 7; ++run) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kIterations; ++i) body(i);
    const double ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    best = std::min(best, ns / kIterations);
  }
  return best;
}

volatile int64_t sink = 0;

int Main() {
  MemoryTracker* tracker = MemoryTracker::Install();
  at::set_num_threads(1);
  const double empty = NanosPerCall([](int i) { sink = sink + i; });
  const double scope = NanosPerCall([](int i) {
    ProfileScope s("forward/block", i & 7);
    sink = sink + i;
  });
  const double nested = NanosPerCall([](int i) {
    ProfileScope outer("step", 1);
    ProfileScope inner("forward/block", i & 7);
    sink = sink + i;
  });
  const double alloc = NanosPerCall([](int) { sink = sink + at::empty({64}, at::kFloat).numel(); });
  // The trainer's bound: the first 200,000 events kept, the rest counted.
  tracker->StartRecording(200000);
  const double recorded =
      NanosPerCall([](int) { sink = sink + at::empty({64}, at::kFloat).numel(); });
  std::optional<MemoryRecord> record = tracker->StopRecording();
  std::printf("profile_scope_bench (best of 7 x %d, ns per call)\n", kIterations);
  std::printf("  empty loop body                        %7.1f\n", empty);
  std::printf("  ProfileScope, nothing listening        %7.1f  (+%.1f)\n", scope, scope - empty);
  std::printf("  two nested ProfileScopes               %7.1f  (+%.1f)\n", nested, nested - empty);
  std::printf("  at::empty(64) + free, not recording    %7.1f\n", alloc);
  std::printf("  at::empty(64) + free, recording        %7.1f  (+%.1f; %zu events kept)\n",
              recorded, recorded - alloc, record ? record->events.size() : size_t{0});
  return 0;
}

}  // namespace
}  // namespace lathe

int main() { return lathe::Main(); }
