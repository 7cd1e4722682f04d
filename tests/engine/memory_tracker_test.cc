#include "worker/engine/memory_tracker.h"

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

}  // namespace
}  // namespace lathe
