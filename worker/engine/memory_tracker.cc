#include "worker/engine/memory_tracker.h"

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <utility>

namespace lathe {
namespace {

thread_local MemoryComponent current_component = MemoryComponent::kOverhead;

// Set once by Install() before the tracker hands out its first block; read by the deleter.
std::atomic<MemoryTracker*> installed_tracker{nullptr};

// Aborts on a broken invariant. Plain stdio, because this runs inside the allocator.
void CheckOrDie(bool condition, const char* message) {
  if (condition) return;
  std::fprintf(stderr, "MemoryTracker: %s\n", message);
  std::abort();
}

void Add(MemoryUsage& usage, int64_t bytes) {
  usage.current_bytes += bytes;
  usage.peak_bytes = std::max(usage.peak_bytes, usage.current_bytes);
}

}  // namespace

MemoryScope::MemoryScope(MemoryComponent component) : previous_(current_component) {
  current_component = component;
}

MemoryScope::~MemoryScope() { current_component = previous_; }

MemoryComponent MemoryScope::Current() { return current_component; }

MemoryTracker* MemoryTracker::Install() {
  static MemoryTracker* const tracker = [] {
    // Leaked on purpose: tensors freed during static destruction still call Delete().
    auto* t = new MemoryTracker(c10::GetCPUAllocator());
    installed_tracker.store(t, std::memory_order_release);
    // The highest priority, so that no allocator registered later silently replaces it.
    c10::SetCPUAllocator(t, std::numeric_limits<uint8_t>::max());
    CheckOrDie(c10::GetCPUAllocator() == t, "libtorch refused the memory tracker");
    return t;
  }();
  return tracker;
}

MemoryTracker::MemoryTracker(c10::Allocator* wrapped) : wrapped_(wrapped) {
  CheckOrDie(wrapped_ != nullptr && wrapped_ != this, "nothing to wrap");
}

MemorySnapshot MemoryTracker::Snapshot() const {
  absl::MutexLock lock(&mu_);
  MemorySnapshot snapshot;
  snapshot.components = components_;
  snapshot.total = total_;
  snapshot.at_peak = at_peak_;
  return snapshot;
}

void MemoryTracker::ResetPeaks() {
  absl::MutexLock lock(&mu_);
  for (MemoryUsage& usage : components_) usage.peak_bytes = usage.current_bytes;
  total_.peak_bytes = total_.current_bytes;
  for (int i = 0; i < kNumMemoryComponents; ++i) at_peak_[i] = components_[i].current_bytes;
}

c10::DataPtr MemoryTracker::allocate(size_t n) {
  // libtorch < 2.3 declares allocate() const; the tracker itself is never const.
  return const_cast<MemoryTracker*>(this)->Allocate(n);
}

c10::DeleterFnPtr MemoryTracker::raw_deleter() const { return &MemoryTracker::Delete; }

void MemoryTracker::copy_data(void* dest, const void* src, size_t count) const {
  wrapped_->copy_data(dest, src, count);
}

c10::DataPtr MemoryTracker::Allocate(size_t n) {
  c10::DataPtr wrapped = wrapped_->allocate(n);
  void* data = wrapped.get();
  const c10::Device device = wrapped.device();
  // Zero-byte requests come back as null; there is nothing to count or to free.
  if (data == nullptr) return c10::DataPtr(nullptr, nullptr, &MemoryTracker::Delete, device);

  const MemoryComponent component = current_component;
  const int64_t bytes = static_cast<int64_t>(n);
  {
    absl::MutexLock lock(&mu_);
    // The wrapped allocator cannot return a live block, and Free() erases a block before
    // releasing it, so the key is new.
    bool inserted = blocks_.emplace(data, Block{bytes, component, std::move(wrapped)}).second;
    CheckOrDie(inserted, "the wrapped allocator returned a live block");
    Add(components_[static_cast<int>(component)], bytes);
    Add(total_, bytes);
    if (total_.current_bytes == total_.peak_bytes) {
      for (int i = 0; i < kNumMemoryComponents; ++i) at_peak_[i] = components_[i].current_bytes;
    }
  }
  return c10::DataPtr(data, data, &MemoryTracker::Delete, device);
}

void MemoryTracker::Free(void* data) {
  c10::DataPtr wrapped;
  {
    absl::MutexLock lock(&mu_);
    auto it = blocks_.find(data);
    CheckOrDie(it != blocks_.end(), "freeing a block it did not allocate");
    Block& block = it->second;
    components_[static_cast<int>(block.component)].current_bytes -= block.bytes;
    total_.current_bytes -= block.bytes;
    wrapped = std::move(block.wrapped);
    blocks_.erase(it);
  }
  // Released outside the lock, through the wrapped allocator's own deleter.
  wrapped.clear();
}

void MemoryTracker::Delete(void* data) {
  if (data == nullptr) return;
  installed_tracker.load(std::memory_order_acquire)->Free(data);
}

}  // namespace lathe
