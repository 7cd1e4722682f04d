#include "worker/engine/memory_tracker.h"

#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lathe {
namespace {

// Allocated during static initialization, before any test installs the tracker.
at::Tensor* const tensor_from_before_install = new at::Tensor(at::ones({300, 100}));

using C = MemoryComponent;

int64_t Current(const MemorySnapshot& s, C component) { return s.of(component).current_bytes; }
int64_t Peak(const MemorySnapshot& s, C component) { return s.of(component).peak_bytes; }

// Bytes held per component between two snapshots.
int64_t Delta(const MemorySnapshot& before, const MemorySnapshot& after, C component) {
  return Current(after, component) - Current(before, component);
}

class MemoryTrackerTest : public ::testing::Test {
 protected:
  MemoryTracker* tracker_ = MemoryTracker::Install();
};

TEST(MemoryScopeTest, NestedScopesRestoreTheOuterTag) {
  EXPECT_EQ(MemoryScope::Current(), C::kOverhead);
  {
    MemoryScope outer(C::kWeights);
    EXPECT_EQ(MemoryScope::Current(), C::kWeights);
    {
      MemoryScope inner(C::kLogits);
      EXPECT_EQ(MemoryScope::Current(), C::kLogits);
    }
    EXPECT_EQ(MemoryScope::Current(), C::kWeights);
  }
  EXPECT_EQ(MemoryScope::Current(), C::kOverhead);
}

TEST_F(MemoryTrackerTest, InstallIsIdempotentAndReplacesTheCpuAllocator) {
  EXPECT_EQ(MemoryTracker::Install(), tracker_);
  EXPECT_EQ(c10::GetAllocator(c10::DeviceType::CPU), tracker_);
}

TEST_F(MemoryTrackerTest, CountsExactBytesUnderTheCurrentScope) {
  MemorySnapshot before = tracker_->Snapshot();
  at::Tensor a;
  at::Tensor b;
  at::Tensor c;
  {
    MemoryScope scope(C::kActivations);
    a = at::empty({1000, 250}, at::kFloat);
  }
  {
    MemoryScope scope(C::kWeights);
    b = at::empty({3, 7}, at::kDouble);
  }
  c = at::empty({5}, at::kByte);  // Untagged.
  MemorySnapshot after = tracker_->Snapshot();

  EXPECT_EQ(Delta(before, after, C::kActivations), 1'000'000);
  EXPECT_EQ(Delta(before, after, C::kWeights), 3 * 7 * 8);
  EXPECT_EQ(Delta(before, after, C::kOverhead), 5);
  EXPECT_EQ(after.total.current_bytes - before.total.current_bytes, 1'000'000 + 168 + 5);
  for (C other : {C::kTrainable, C::kGradients, C::kOptimizer, C::kLogits, C::kCommBuffers}) {
    EXPECT_EQ(Delta(before, after, other), 0) << MemoryComponentName(other);
  }
  // The tracker's blocks look like the default CPU allocator's.
  const c10::DataPtr& data = a.storage().data_ptr();
  EXPECT_EQ(data.get(), data.get_context());
  EXPECT_EQ(data.get_deleter(), tracker_->raw_deleter());

  a.reset();
  b.reset();
  c.reset();
  MemorySnapshot freed = tracker_->Snapshot();
  for (int i = 0; i < kNumMemoryComponents; ++i) {
    EXPECT_EQ(freed.components[i].current_bytes, before.components[i].current_bytes) << i;
  }
  EXPECT_EQ(freed.total.current_bytes, before.total.current_bytes);
}

TEST_F(MemoryTrackerTest, ViewsAndZeroSizedTensorsAddNothing) {
  MemoryScope scope(C::kLogits);
  at::Tensor base = at::empty({64, 64}, at::kFloat);
  MemorySnapshot before = tracker_->Snapshot();
  at::Tensor view = base.slice(0, 0, 10).t();
  at::Tensor empty = at::empty({0, 128}, at::kFloat);
  MemorySnapshot after = tracker_->Snapshot();
  EXPECT_EQ(Delta(before, after, C::kLogits), 0);
  EXPECT_EQ(after.total.current_bytes, before.total.current_bytes);
}

TEST_F(MemoryTrackerTest, FreeingUnderAnotherScopeDecrementsTheOriginalComponent) {
  MemorySnapshot before = tracker_->Snapshot();
  at::Tensor t;
  {
    MemoryScope scope(C::kOptimizer);
    t = at::empty({4096}, at::kFloat);
  }
  {
    MemoryScope scope(C::kGradients);
    t.reset();
  }
  MemorySnapshot after = tracker_->Snapshot();
  EXPECT_EQ(Delta(before, after, C::kOptimizer), 0);
  EXPECT_EQ(Delta(before, after, C::kGradients), 0);
  EXPECT_EQ(Peak(after, C::kOptimizer),
            std::max(Peak(before, C::kOptimizer), Current(before, C::kOptimizer) + 4096 * 4));
}

TEST_F(MemoryTrackerTest, FreeingOnAnotherThreadDecrementsTheOriginalComponent) {
  MemorySnapshot before = tracker_->Snapshot();
  at::Tensor t;
  {
    MemoryScope scope(C::kCommBuffers);
    t = at::empty({1 << 16}, at::kByte);
  }
  EXPECT_EQ(Delta(before, tracker_->Snapshot(), C::kCommBuffers), 1 << 16);
  std::thread([t = std::move(t)]() mutable { t.reset(); }).join();
  MemorySnapshot after = tracker_->Snapshot();
  EXPECT_EQ(Delta(before, after, C::kCommBuffers), 0);
  EXPECT_EQ(Delta(before, after, C::kOverhead), 0);
}

TEST_F(MemoryTrackerTest, PeaksTrackMaximaAndResetPeaksLowersThemToCurrent) {
  MemoryScope scope(C::kActivations);
  tracker_->ResetPeaks();
  const MemorySnapshot start = tracker_->Snapshot();
  const int64_t base = Current(start, C::kActivations);
  EXPECT_EQ(Peak(start, C::kActivations), base);
  EXPECT_EQ(start.total.peak_bytes, start.total.current_bytes);

  at::Tensor big = at::empty({250'000}, at::kFloat);  // 1,000,000 bytes
  at::Tensor small = at::empty({1'000}, at::kFloat);  // 4,000 bytes
  big.reset();
  MemorySnapshot s = tracker_->Snapshot();
  EXPECT_EQ(Current(s, C::kActivations), base + 4'000);
  EXPECT_EQ(Peak(s, C::kActivations), base + 1'004'000);

  tracker_->ResetPeaks();
  s = tracker_->Snapshot();
  EXPECT_EQ(Peak(s, C::kActivations), base + 4'000);
  EXPECT_EQ(s.total.peak_bytes, s.total.current_bytes);
  for (int i = 0; i < kNumMemoryComponents; ++i) {
    EXPECT_EQ(s.components[i].peak_bytes, s.components[i].current_bytes) << i;
  }

  at::Tensor medium = at::empty({10'000}, at::kFloat);  // 40,000 bytes
  medium.reset();
  s = tracker_->Snapshot();
  EXPECT_EQ(Peak(s, C::kActivations), base + 44'000);
}

TEST_F(MemoryTrackerTest, TotalPeakIsThePeakOfTheSumNotTheSumOfPeaks) {
  tracker_->ResetPeaks();
  const MemorySnapshot start = tracker_->Snapshot();
  {
    MemoryScope scope(C::kWeights);
    at::Tensor a = at::empty({3'000'000}, at::kByte);
  }
  {
    MemoryScope scope(C::kLogits);
    at::Tensor b = at::empty({2'000'000}, at::kByte);
  }
  MemorySnapshot s = tracker_->Snapshot();
  EXPECT_EQ(Peak(s, C::kWeights) - Current(start, C::kWeights), 3'000'000);
  EXPECT_EQ(Peak(s, C::kLogits) - Current(start, C::kLogits), 2'000'000);
  EXPECT_EQ(s.total.peak_bytes - start.total.current_bytes, 3'000'000);
  EXPECT_EQ(s.total.current_bytes, start.total.current_bytes);
  // What the peak was made of: the weights block, not the later logits block.
  EXPECT_EQ(s.at_peak[static_cast<int>(C::kWeights)] - Current(start, C::kWeights), 3'000'000);
  EXPECT_EQ(s.at_peak[static_cast<int>(C::kLogits)], Current(start, C::kLogits));
  int64_t sum = 0;
  for (int64_t bytes : s.at_peak) sum += bytes;
  EXPECT_EQ(sum, s.total.peak_bytes);
}

TEST_F(MemoryTrackerTest, TensorFromBeforeInstallIsFreedThroughItsOwnDeleter) {
  if (!tensor_from_before_install->defined()) {
    GTEST_SKIP() << "released by an earlier repetition (--gtest_repeat)";
  }
  EXPECT_NE(tensor_from_before_install->storage().data_ptr().get_deleter(),
            tracker_->raw_deleter());
  MemorySnapshot before = tracker_->Snapshot();
  {
    MemoryScope scope(C::kWeights);
    *tensor_from_before_install = at::Tensor();
  }
  MemorySnapshot after = tracker_->Snapshot();
  EXPECT_EQ(after.total.current_bytes, before.total.current_bytes);
  EXPECT_EQ(Delta(before, after, C::kWeights), 0);
}

TEST_F(MemoryTrackerTest, RawAllocateAndDeallocateAreCounted) {
  MemorySnapshot before = tracker_->Snapshot();
  void* raw = nullptr;
  {
    MemoryScope scope(C::kCommBuffers);
    raw = tracker_->raw_allocate(777);
  }
  ASSERT_NE(raw, nullptr);
  EXPECT_EQ(Delta(before, tracker_->Snapshot(), C::kCommBuffers), 777);
  tracker_->raw_deallocate(raw);
  EXPECT_EQ(Delta(before, tracker_->Snapshot(), C::kCommBuffers), 0);
}

TEST_F(MemoryTrackerTest, ConcurrentAllocationKeepsCountsExact) {
  constexpr int kThreads = 8;
  constexpr int kHeldPerThread = 50;
  const C kTags[] = {C::kWeights, C::kTrainable, C::kGradients, C::kOptimizer};
  MemorySnapshot before = tracker_->Snapshot();

  std::vector<std::vector<at::Tensor>> held(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      MemoryScope scope(kTags[i % 4]);
      for (int j = 0; j < kHeldPerThread; ++j) {
        // Churn: blocks freed at once, possibly reusing addresses another thread just freed.
        for (int k = 0; k < 20; ++k) {
          at::Tensor temporary = at::empty({(j * 31 + k) % 97 + 1}, at::kFloat);
        }
        held[i].push_back(at::empty({(i + 1) * 100 + j}, at::kByte));
      }
    });
  }
  for (std::thread& t : threads) t.join();

  int64_t expected[4] = {0, 0, 0, 0};
  for (int i = 0; i < kThreads; ++i) {
    for (const at::Tensor& t : held[i]) expected[i % 4] += t.nbytes();
  }
  MemorySnapshot after = tracker_->Snapshot();
  for (int tag = 0; tag < 4; ++tag) {
    EXPECT_EQ(Delta(before, after, kTags[tag]), expected[tag]) << MemoryComponentName(kTags[tag]);
  }
  EXPECT_EQ(after.total.current_bytes - before.total.current_bytes,
            expected[0] + expected[1] + expected[2] + expected[3]);

  held.clear();
  MemorySnapshot freed = tracker_->Snapshot();
  for (int i = 0; i < kNumMemoryComponents; ++i) {
    EXPECT_EQ(freed.components[i].current_bytes, before.components[i].current_bytes) << i;
  }
}

TEST_F(MemoryTrackerTest, AutogradStepReturnsToTheStartingBytes) {
  const MemorySnapshot start = tracker_->Snapshot();
  {
    at::Tensor w;
    at::Tensor x;
    {
      MemoryScope scope(C::kTrainable);
      w = at::randn({64, 32}).requires_grad_(true);
    }
    {
      MemoryScope scope(C::kActivations);
      x = at::randn({16, 64});
    }
    EXPECT_EQ(Delta(start, tracker_->Snapshot(), C::kTrainable), 64 * 32 * 4);
    at::Tensor loss;
    {
      MemoryScope scope(C::kActivations);
      loss = x.matmul(w).tanh().sum();
    }
    {
      MemoryScope scope(C::kGradients);
      loss.backward();
    }
    ASSERT_TRUE(w.grad().defined());
    MemorySnapshot s = tracker_->Snapshot();
    EXPECT_EQ(Delta(start, s, C::kGradients), 64 * 32 * 4);
    EXPECT_GT(Peak(s, C::kActivations), Current(start, C::kActivations));
  }
  MemorySnapshot end = tracker_->Snapshot();
  EXPECT_EQ(end.total.current_bytes, start.total.current_bytes);
  for (int i = 0; i < kNumMemoryComponents; ++i) {
    EXPECT_EQ(end.components[i].current_bytes, start.components[i].current_bytes) << i;
  }
}

// Nested ProfileScopes: the innermost names the thread's allocations; none outside.
TEST(ProfileScopeTest, CurrentIsTheInnermostScope) {
  EXPECT_TRUE(ProfileScope::Current().empty());
  {
    ProfileScope outer("forward");
    EXPECT_EQ(ProfileScope::Current().ToString(), "forward");
    {
      ProfileScope inner("forward/block", 3);
      EXPECT_EQ(ProfileScope::Current().ToString(), "forward/block.3");
      // Another thread's scopes are its own.
      std::thread([] { EXPECT_TRUE(ProfileScope::Current().empty()); }).join();
    }
    EXPECT_EQ(ProfileScope::Current().ToString(), "forward");
  }
  EXPECT_TRUE(ProfileScope::Current().empty());
}

// A recording keeps each allocation and free with its block, component and scope, the peak
// with what it was made of, each step's peak, and the largest blocks live at the peak.
TEST_F(MemoryTrackerTest, RecordingKeepsEventsScopesAndThePeak) {
  at::Tensor before = at::empty({1000}, at::kFloat);  // 4000 B, live from the start
  tracker_->StartRecording(1000);
  tracker_->MarkStep(7);
  const int64_t start = tracker_->Snapshot().total.current_bytes;
  {
    MemoryScope memory(C::kActivations);
    ProfileScope scope("forward/block", 1);
    at::Tensor a = at::empty({3000}, at::kFloat);  // 12000 B
    {
      MemoryScope logits(C::kLogits);
      ProfileScope loss("loss");
      at::Tensor b = at::empty({500}, at::kFloat);  // 2000 B: the peak
    }
    at::Tensor c = at::empty({100}, at::kFloat);  // under the peak
  }
  tracker_->MarkStep(8);
  at::Tensor d = at::empty({10}, at::kFloat);
  std::optional<MemoryRecord> record = tracker_->StopRecording();
  ASSERT_TRUE(record.has_value());
  EXPECT_FALSE(tracker_->StopRecording().has_value());
  EXPECT_EQ(record->start_total_bytes, start);
  EXPECT_FALSE(record->truncated());
  // a, b, free b, c, free c, free a (the order of the last two frees), d.
  ASSERT_EQ(record->events.size(), 7u);
  const MemoryEvent& a = record->events[0];
  EXPECT_EQ(a.bytes, 12000);
  EXPECT_EQ(a.component, C::kActivations);
  EXPECT_EQ(a.scope.ToString(), "forward/block.1");
  EXPECT_EQ(a.total_bytes, start + 12000);
  const MemoryEvent& b = record->events[1];
  EXPECT_EQ(b.scope.ToString(), "loss");
  EXPECT_EQ(b.component, C::kLogits);
  const MemoryEvent& free_b = record->events[2];
  EXPECT_EQ(free_b.bytes, -2000);
  EXPECT_EQ(free_b.block, b.block);
  EXPECT_EQ(free_b.scope.ToString(), "loss");  // where the block was allocated
  EXPECT_GE(b.time_ns, a.time_ns);

  EXPECT_EQ(record->peak_bytes, start + 14000);
  EXPECT_EQ(record->peak_event, 1);
  EXPECT_EQ(record->peak_scope.ToString(), "loss");
  int64_t sum = 0;
  for (int64_t bytes : record->at_peak) sum += bytes;
  EXPECT_EQ(sum, record->peak_bytes);
  EXPECT_EQ(record->at_peak[static_cast<int>(C::kLogits)] -
                tracker_->Snapshot().of(C::kLogits).current_bytes,
            2000);

  ASSERT_EQ(record->steps.size(), 2u);
  EXPECT_EQ(record->steps[0].step, 7);
  EXPECT_EQ(record->steps[0].peak_bytes, start + 14000);
  EXPECT_EQ(record->steps[1].step, 8);
  EXPECT_EQ(record->steps[1].first_event, 6);
  EXPECT_EQ(record->steps[1].peak_bytes, start + 40);

  std::optional<std::vector<RecordedBlock>> top = record->TopBlocksAtPeak(2);
  ASSERT_TRUE(top.has_value());
  ASSERT_EQ(top->size(), 2u);
  EXPECT_EQ((*top)[0].bytes, 12000);
  EXPECT_EQ((*top)[0].scope.ToString(), "forward/block.1");
  // `before` is the largest block from before the recording, unless others are larger.
  EXPECT_GE((*top)[1].bytes, 4000);
}

// Past the bound, events are dropped but the peak is still exact; the blocks at a peak that
// came after the bound cannot be replayed.
TEST_F(MemoryTrackerTest, RecordingIsBounded) {
  tracker_->StartRecording(2);
  const int64_t start = tracker_->Snapshot().total.current_bytes;
  {
    at::Tensor a = at::empty({10}, at::kFloat);
    at::Tensor b = at::empty({20}, at::kFloat);
    at::Tensor c = at::empty({30}, at::kFloat);
  }
  std::optional<MemoryRecord> record = tracker_->StopRecording();
  ASSERT_TRUE(record.has_value());
  EXPECT_EQ(record->events.size(), 2u);
  EXPECT_TRUE(record->truncated());
  EXPECT_EQ(record->dropped_events, 4);
  EXPECT_EQ(record->peak_bytes, start + 240);
  EXPECT_EQ(record->peak_event, 2);
  EXPECT_FALSE(record->TopBlocksAtPeak(10).has_value());
}

}  // namespace
}  // namespace lathe
