// Group commit alone: batches staged, merged into one transaction, kept across a failed
// write, and a waiter whose batch another caller is writing (the scheduler's use of it is in
// scheduler_test.cc: "APassIsOneTransaction", "OnlyDurablePlacementsAreDelivered...").
#include "coordinator/scheduler/group_commit.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/forwarding_store.h"

namespace lathe {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// Records every transaction; can fail them, or hold the next one at a gate.
class RecordingStore : public testing::ForwardingStore {
 public:
  RecordingStore() : ForwardingStore(nullptr) {}
  absl::Status Write(const StoreBatch& batch) override {
    if (absl::Notification* held = gate; held != nullptr) {
      entered.Notify();
      held->WaitForNotification();
    }
    if (fail) return absl::UnavailableError("the disk is away");
    writes.push_back(batch);
    return absl::OkStatus();
  }
  std::vector<StoreBatch> writes;
  bool fail = false;
  absl::Notification* gate = nullptr;
  absl::Notification entered;
};

StoreBatch Jobs(std::vector<std::pair<std::string, v1::JobState>> jobs) {
  StoreBatch batch;
  for (const auto& [id, state] : jobs) {
    v1::JobStatus& job = batch.jobs.emplace_back();
    job.set_job_id(id);
    job.set_state(state);
  }
  return batch;
}

std::vector<std::string> JobIds(const StoreBatch& batch) {
  std::vector<std::string> ids;
  for (const v1::JobStatus& job : batch.jobs) ids.push_back(job.job_id());
  return ids;
}

TEST(GroupCommitTest, AnEmptyBatchIsNotStagedAndNeedsNoWrite) {
  RecordingStore store;
  GroupCommit commit(&store);
  EXPECT_EQ(commit.NextSequence(), 1u);
  EXPECT_EQ(commit.Stage(StoreBatch()), 0u);
  EXPECT_TRUE(commit.WaitDurable(0).ok());
  EXPECT_THAT(store.writes, IsEmpty());
  EXPECT_EQ(commit.Stage(Jobs({{"a", v1::JOB_STATE_QUEUED}})), 1u);
  EXPECT_EQ(commit.Stage(StoreBatch()), 1u) << "durable with what was staged before it";
  EXPECT_EQ(commit.NextSequence(), 2u);
  EXPECT_EQ(commit.WaitDurable(7).code(), absl::StatusCode::kInternal);  // never staged
}

TEST(GroupCommitTest, StagedBatchesAreOneTransactionWithTheNewestRecords) {
  RecordingStore store;
  GroupCommit commit(&store);
  StoreBatch first = Jobs({{"a", v1::JOB_STATE_QUEUED}, {"b", v1::JOB_STATE_QUEUED}});
  first.workers.emplace_back().set_worker_id("w1");
  commit.Stage(first);
  StoreBatch second = Jobs({{"a", v1::JOB_STATE_RUNNING}});
  second.deleted_workers.push_back("w1");
  commit.Stage(second);
  StoreBatch third;
  third.workers.emplace_back().set_worker_id("w2");
  const uint64_t last = commit.Stage(third);
  EXPECT_EQ(commit.Durable(), 0u);
  ASSERT_TRUE(commit.WaitDurable(last).ok());
  ASSERT_EQ(store.writes.size(), 1u);
  const StoreBatch& written = store.writes[0];
  EXPECT_THAT(JobIds(written), ElementsAre("a", "b"));
  EXPECT_EQ(written.jobs[0].state(), v1::JOB_STATE_RUNNING) << "the newest record wins";
  ASSERT_EQ(written.workers.size(), 1u);
  EXPECT_EQ(written.workers[0].worker_id(), "w2");
  EXPECT_THAT(written.deleted_workers, ElementsAre("w1"));
  EXPECT_EQ(commit.Durable(), last);
  // Durable already: no second write.
  ASSERT_TRUE(commit.WaitDurable(1).ok());
  EXPECT_EQ(store.writes.size(), 1u);
}

TEST(GroupCommitTest, AFailedWriteKeepsItsBatchesForTheNextOne) {
  RecordingStore store;
  GroupCommit commit(&store);
  const uint64_t first =
      commit.Stage(Jobs({{"a", v1::JOB_STATE_QUEUED}, {"c", v1::JOB_STATE_QUEUED}}));
  store.fail = true;
  EXPECT_EQ(commit.WaitDurable(first).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(commit.Durable(), 0u);
  store.fail = false;
  const uint64_t second =
      commit.Stage(Jobs({{"a", v1::JOB_STATE_CANCELLED}, {"b", v1::JOB_STATE_QUEUED}}));
  ASSERT_TRUE(commit.WaitDurable(second).ok());
  ASSERT_EQ(store.writes.size(), 1u);
  EXPECT_THAT(JobIds(store.writes[0]), ElementsAre("a", "b", "c"));
  EXPECT_EQ(store.writes[0].jobs[0].state(), v1::JOB_STATE_CANCELLED)
      << "the retried batch is older than the new one";
  EXPECT_EQ(commit.Durable(), second);
}

// While one caller writes, batches staged after it are written together by the next waiter.
TEST(GroupCommitTest, WhileOneWritesTheOthersGatherIntoTheNextTransaction) {
  RecordingStore store;
  absl::Notification gate;
  store.gate = &gate;
  GroupCommit commit(&store);
  const uint64_t first = commit.Stage(Jobs({{"a", v1::JOB_STATE_QUEUED}}));
  absl::Status first_status;
  std::thread writer([&] { first_status = commit.WaitDurable(first); });
  store.entered.WaitForNotification();  // the writer is in the store's Write
  store.gate = nullptr;                 // the next write goes straight through
  commit.Stage(Jobs({{"b", v1::JOB_STATE_QUEUED}}));
  const uint64_t third = commit.Stage(Jobs({{"c", v1::JOB_STATE_QUEUED}}));
  absl::Status third_status;
  std::thread waiter([&] { third_status = commit.WaitDurable(third); });
  gate.Notify();
  writer.join();
  waiter.join();
  EXPECT_TRUE(first_status.ok()) << first_status;
  EXPECT_TRUE(third_status.ok()) << third_status;
  ASSERT_EQ(store.writes.size(), 2u);
  EXPECT_THAT(JobIds(store.writes[0]), ElementsAre("a"));
  EXPECT_THAT(JobIds(store.writes[1]), ElementsAre("b", "c"));
  EXPECT_EQ(commit.Durable(), third);
}

}  // namespace
}  // namespace lathe
