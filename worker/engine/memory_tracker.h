// Exact accounting of libtorch's CPU memory by component (docs/training.md, "Outputs").
//
// MemoryTracker is a c10::Allocator installed as libtorch's CPU allocator. It forwards every
// allocation to the allocator that was current before it (normally c10's default CPU
// allocator) and counts the bytes libtorch asked for: current and peak, in total and per
// MemoryComponent. The component of an allocation is the calling thread's tag, set by a
// MemoryScope; untagged allocations count as kOverhead. Each live block remembers the
// component it was allocated under, so freeing it under another scope (or on another thread)
// decrements the right component.
//
//   MemoryTracker* tracker = MemoryTracker::Install();  // early in main
//   {
//     MemoryScope scope(MemoryComponent::kActivations);
//     at::Tensor h = model.Forward(batch);              // counted as activations
//   }
//   MemorySnapshot s = tracker->Snapshot();
//
// What is counted: exactly the byte counts libtorch passes to the allocator (for a contiguous
// tensor, numel * element size; no padding is added at this layer), for CPU storage allocated
// through c10::GetCPUAllocator() after Install(). Not counted: blocks allocated before
// Install() (they are freed through their own deleters), memory that libtorch or a library
// (BLAS, oneDNN) obtains without the CPU allocator, and the malloc slack below it.
//
// Scopes are per thread: work that ATen runs on its intra-op thread pool allocates under that
// worker thread's tag (kOverhead unless the worker sets a scope).
//
// Thread safety: every method of MemoryTracker is thread-safe; Snapshot() is a consistent
// view (taken under the tracker's lock). MemoryScope affects only the thread that creates it.
#ifndef LATHE_WORKER_ENGINE_MEMORY_TRACKER_H_
#define LATHE_WORKER_ENGINE_MEMORY_TRACKER_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/memory_components.h"
#include "kernels/ops/torch_compat.h"

namespace lathe {

// Tags the calling thread's CPU allocations with `component` for the scope's lifetime, then
// restores the tag that was in force before (so scopes nest).
// REQUIRES: destroyed on the thread that created it, in reverse order of creation.
class MemoryScope {
 public:
  explicit MemoryScope(MemoryComponent component);
  ~MemoryScope();

  MemoryScope(const MemoryScope&) = delete;
  MemoryScope& operator=(const MemoryScope&) = delete;

  // The calling thread's current tag (kOverhead outside any scope).
  static MemoryComponent Current();

 private:
  MemoryComponent previous_;
};

struct MemoryUsage {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
};

struct MemorySnapshot {
  // Indexed by static_cast<int>(MemoryComponent).
  std::array<MemoryUsage, kNumMemoryComponents> components;
  // current_bytes is the sum of the components'; peak_bytes is the peak of that sum (at most
  // the sum of the components' peaks).
  MemoryUsage total;
  // Each component's current bytes at the moment the total reached total.peak_bytes: what
  // the peak was made of. Sums to total.peak_bytes exactly.
  std::array<int64_t, kNumMemoryComponents> at_peak{};

  const MemoryUsage& of(MemoryComponent component) const {
    return components[static_cast<int>(component)];
  }
};

class MemoryTracker final : public c10::Allocator {
 public:
  // Installs the process-wide tracker as libtorch's CPU allocator on the first call, wrapping
  // the CPU allocator current at that moment, and returns it; later calls return the same
  // tracker. The tracker is never destroyed (blocks it handed out may outlive main).
  // Call it early in main, before other threads use libtorch: c10 does not synchronize
  // replacing the allocator with concurrent allocation.
  static MemoryTracker* Install();

  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  // Current and peak bytes per component and in total since Install() or the last
  // ResetPeaks().
  MemorySnapshot Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);

  // Sets every peak (each component's and the total's) to its current value, e.g. at the
  // start of a training step.
  void ResetPeaks() ABSL_LOCKS_EXCLUDED(mu_);

  // c10::Allocator. Every DataPtr this returns has data == context and raw_deleter() as its
  // deleter, like c10's default CPU allocator, so raw_allocate()/raw_deallocate() work.
  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, size_t count) const override;

 private:
  struct Block {
    int64_t bytes;
    MemoryComponent component;
    c10::DataPtr wrapped;  // Owns the block through the wrapped allocator's deleter.
  };

  explicit MemoryTracker(c10::Allocator* wrapped);

  // The deleter of every DataPtr this hands out.
  static void Delete(void* data);

  c10::DataPtr Allocate(size_t n) ABSL_LOCKS_EXCLUDED(mu_);
  void Free(void* data) ABSL_LOCKS_EXCLUDED(mu_);

  c10::Allocator* const wrapped_;

  mutable absl::Mutex mu_;
  std::unordered_map<void*, Block> blocks_ ABSL_GUARDED_BY(mu_);
  std::array<MemoryUsage, kNumMemoryComponents> components_ ABSL_GUARDED_BY(mu_);
  MemoryUsage total_ ABSL_GUARDED_BY(mu_);
  std::array<int64_t, kNumMemoryComponents> at_peak_ ABSL_GUARDED_BY(mu_){};
};

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_MEMORY_TRACKER_H_
