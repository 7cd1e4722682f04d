#include "worker/engine/memory_tracker.h"

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <chrono>
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

struct MemoryTracker::Recording {
  MemoryRecord record;
  std::chrono::steady_clock::time_point start;
  int64_t next_id = 1;
  int64_t seen_events = 0;  // kept and dropped
  std::unordered_map<void*, RecordedBlock> live;
};

std::optional<std::vector<RecordedBlock>> MemoryRecord::TopBlocksAtPeak(int n) const {
  if (peak_event >= static_cast<int64_t>(events.size())) return std::nullopt;
  std::unordered_map<int64_t, RecordedBlock> live;
  for (const RecordedBlock& block : live_at_start) live.emplace(block.id, block);
  for (int64_t i = 0; i <= peak_event; ++i) {
    const MemoryEvent& e = events[i];
    if (e.bytes > 0) {
      live[e.block] = RecordedBlock{e.block, e.bytes, e.component, e.scope};
    } else {
      live.erase(e.block);
    }
  }
  std::vector<RecordedBlock> blocks;
  blocks.reserve(live.size());
  for (const auto& [id, block] : live) blocks.push_back(block);
  auto larger = [](const RecordedBlock& a, const RecordedBlock& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : a.id < b.id;
  };
  const size_t keep = std::min(blocks.size(), static_cast<size_t>(std::max(n, 0)));
  std::partial_sort(blocks.begin(), blocks.begin() + keep, blocks.end(), larger);
  blocks.resize(keep);
  return blocks;
}

MemoryScope::MemoryScope(MemoryComponent component) : previous_(current_component) {
  current_component = component;
  ProfileScope::NotifyListener();
}

MemoryScope::~MemoryScope() {
  current_component = previous_;
  ProfileScope::NotifyListener();
}

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

MemoryTracker::~MemoryTracker() = default;

void MemoryTracker::StartRecording(int64_t max_events) {
  auto recording = std::make_unique<Recording>();
  absl::MutexLock lock(&mu_);
  recording->start = std::chrono::steady_clock::now();
  MemoryRecord& record = recording->record;
  record.start_unix_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  record.max_events = std::max<int64_t>(0, max_events);
  record.events.reserve(static_cast<size_t>(std::min<int64_t>(record.max_events, 1 << 16)));
  record.start_total_bytes = total_.current_bytes;
  record.peak_bytes = total_.current_bytes;
  for (int i = 0; i < kNumMemoryComponents; ++i) record.at_peak[i] = components_[i].current_bytes;
  record.live_at_start.reserve(blocks_.size());
  recording->live.reserve(blocks_.size());
  for (const auto& [data, block] : blocks_) {
    RecordedBlock recorded{recording->next_id++, block.bytes, block.component, ScopeName{}};
    record.live_at_start.push_back(recorded);
    recording->live.emplace(data, recorded);
  }
  recording_ = std::move(recording);
}

void MemoryTracker::MarkStep(int64_t step) {
  absl::MutexLock lock(&mu_);
  if (recording_ == nullptr) return;
  recording_->record.steps.push_back({step, recording_->seen_events, total_.current_bytes});
}

std::optional<MemoryRecord> MemoryTracker::StopRecording() {
  std::unique_ptr<Recording> recording;
  {
    absl::MutexLock lock(&mu_);
    recording = std::move(recording_);
  }
  if (recording == nullptr) return std::nullopt;
  return std::move(recording->record);
}

void MemoryTracker::Record(void* data, int64_t bytes, MemoryComponent component) {
  Recording& r = *recording_;
  MemoryRecord& record = r.record;
  MemoryEvent event;
  event.time_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - r.start)
                      .count();
  event.bytes = bytes;
  event.component = component;
  event.total_bytes = total_.current_bytes;
  if (bytes > 0) {
    event.scope = ProfileScope::Current();
    event.block = r.next_id++;
    r.live[data] = RecordedBlock{event.block, bytes, component, event.scope};
  } else if (auto it = r.live.find(data); it != r.live.end()) {
    event.block = it->second.id;
    event.scope = it->second.scope;
    r.live.erase(it);
  }
  const int64_t index = r.seen_events++;
  if (bytes > 0 && total_.current_bytes > record.peak_bytes) {
    record.peak_bytes = total_.current_bytes;
    record.at_peak = {};
    for (int i = 0; i < kNumMemoryComponents; ++i) record.at_peak[i] = components_[i].current_bytes;
    record.peak_time_ns = event.time_ns;
    record.peak_event = index;
    record.peak_scope = event.scope;
  }
  if (!record.steps.empty()) {
    record.steps.back().peak_bytes = std::max(record.steps.back().peak_bytes, total_.current_bytes);
  }
  if (index < record.max_events) {
    record.events.push_back(event);
  } else {
    ++record.dropped_events;
  }
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
    if (recording_ != nullptr) Record(data, bytes, component);
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
    if (recording_ != nullptr) Record(data, -block.bytes, block.component);
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
