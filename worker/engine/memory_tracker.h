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
// Recording (docs/observability.md, "Profiling"): between StartRecording() and
// StopRecording() the tracker also keeps every allocation and free, with its time, block,
// component and the innermost ProfileScope of the allocating thread, up to a bound, and the
// peak of that stretch with what it was made of. Not recording, it costs one branch per
// allocation and free.
//
// Thread safety: every method of MemoryTracker is thread-safe; Snapshot() is a consistent
// view (taken under the tracker's lock). MemoryScope affects only the thread that creates it.
#ifndef LATHE_WORKER_ENGINE_MEMORY_TRACKER_H_
#define LATHE_WORKER_ENGINE_MEMORY_TRACKER_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/memory_components.h"
#include "kernels/ops/torch_compat.h"
#include "worker/engine/profile_scope.h"

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

// A block of CPU memory as the recording knows it.
struct RecordedBlock {
  int64_t id = 0;  // 1, 2, ... in the order the recording first saw the block
  int64_t bytes = 0;
  MemoryComponent component = MemoryComponent::kOverhead;
  ScopeName scope;  // where it was allocated; empty: outside every scope, or before recording
};

// One allocation (bytes > 0) or free (bytes < 0).
struct MemoryEvent {
  int64_t time_ns = 0;  // since StartRecording, steady clock
  int64_t bytes = 0;
  int64_t block = 0;  // RecordedBlock::id; a free names the block it releases
  MemoryComponent component = MemoryComponent::kOverhead;  // the block's
  ScopeName scope;                                         // the block's (where allocated)
  int64_t total_bytes = 0;  // the tracker's total once the event happened
};

// What one recording saw.
struct MemoryRecord {
  int64_t max_events = 0;     // the bound it was started with
  int64_t start_unix_ns = 0;  // when it started, wall clock (events' times are since then)
  int64_t start_total_bytes = 0;
  std::vector<RecordedBlock> live_at_start;  // ids 1..n, in no particular order
  std::vector<MemoryEvent> events;           // the first max_events events
  // Events past the bound (truncated when not 0); -1: an unknown number (the CUDA history).
  int64_t dropped_events = 0;

  // The highest total during the recording (start_total_bytes when it never rose above it),
  // each component's bytes at that moment (sums to peak_bytes), when, and the allocation that
  // reached it: its index in the full sequence of events (-1: the start) and its scope.
  int64_t peak_bytes = 0;
  std::array<int64_t, kNumMemoryComponents> at_peak{};
  int64_t peak_time_ns = 0;
  int64_t peak_event = -1;
  ScopeName peak_scope;

  // Each MarkStep's step and the highest total from it until the next mark (or the end).
  struct StepPeak {
    int64_t step = 0;
    int64_t first_event = 0;  // index of the step's first event in the full sequence
    int64_t peak_bytes = 0;
  };
  std::vector<StepPeak> steps;

  bool truncated() const { return dropped_events != 0; }
  // The `n` largest blocks live at the peak, largest first (ties: the older block first),
  // by replaying the events onto live_at_start. nullopt when the peak came after the bound.
  std::optional<std::vector<RecordedBlock>> TopBlocksAtPeak(int n) const;
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
  ~MemoryTracker() override;  // never runs (Install leaks the tracker); Recording is private

  // Current and peak bytes per component and in total since Install() or the last
  // ResetPeaks().
  MemorySnapshot Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);

  // Sets every peak (each component's and the total's) to its current value, e.g. at the
  // start of a training step.
  void ResetPeaks() ABSL_LOCKS_EXCLUDED(mu_);

  // Starts recording (see the file comment), keeping at most `max_events` events; a
  // recording already running is discarded.
  void StartRecording(int64_t max_events) ABSL_LOCKS_EXCLUDED(mu_);
  // Starts a step in the current recording (nothing when none runs): MemoryRecord::steps.
  void MarkStep(int64_t step) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the recording and returns it; nullopt when none was running.
  std::optional<MemoryRecord> StopRecording() ABSL_LOCKS_EXCLUDED(mu_);

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

  struct Recording;

  c10::DataPtr Allocate(size_t n) ABSL_LOCKS_EXCLUDED(mu_);
  void Free(void* data) ABSL_LOCKS_EXCLUDED(mu_);
  // Records an allocation or free that has just been counted.
  void Record(void* data, int64_t bytes, MemoryComponent component)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  c10::Allocator* const wrapped_;

  mutable absl::Mutex mu_;
  std::unordered_map<void*, Block> blocks_ ABSL_GUARDED_BY(mu_);
  std::array<MemoryUsage, kNumMemoryComponents> components_ ABSL_GUARDED_BY(mu_);
  MemoryUsage total_ ABSL_GUARDED_BY(mu_);
  std::array<int64_t, kNumMemoryComponents> at_peak_ ABSL_GUARDED_BY(mu_){};
  std::unique_ptr<Recording> recording_ ABSL_GUARDED_BY(mu_);  // null: not recording
};

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_MEMORY_TRACKER_H_
