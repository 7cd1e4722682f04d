// The fake group beyond the shared contract: it reports ranks that disagree, times out
// waiting for a missing rank, and fails on demand.
#include "worker/comm/fake_communicator.h"

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/comm/comm_test_util.h"
#include "tests/testing/status_matchers.h"

namespace lathe {
namespace {

using ::lathe::testing::RunRanks;
using ::lathe::testing::StatusIs;

TEST(FakeCommunicatorTest, RanksThatDisagreeGetInvalidArgument) {
  std::vector<std::unique_ptr<Communicator>> group = MakeFakeGroup(2);
  std::vector<absl::Status> results(2);
  RunRanks(2, [&](int rank) {
    double data[4] = {};
    results[rank] = rank == 0 ? group[0]->AllReduceSum(data, 4, CommDType::kFloat64)
                              : group[1]->Broadcast(data, sizeof(data), 0);
  });
  for (const absl::Status& s : results) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, "all-reduce of 4 float64"));
    EXPECT_THAT(s,
                StatusIs(absl::StatusCode::kInvalidArgument, "broadcast of 32 bytes from rank 0"));
  }
}

TEST(FakeCommunicatorTest, MissingRankTimesOutAndBreaksTheGroup) {
  FakeGroupOptions options;
  options.timeout = absl::Milliseconds(50);
  std::vector<std::unique_ptr<Communicator>> group = MakeFakeGroup(3, options);
  absl::Status s = group[1]->Barrier();
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDeadlineExceeded, "rank(s) 0, 2"));
  EXPECT_EQ(group[0]->Barrier().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(FakeCommunicatorTest, BreakFailsWaitingAndLaterCalls) {
  std::shared_ptr<FakeGroup> fake = FakeGroup::Create(2);
  std::vector<std::unique_ptr<Communicator>> group = fake->Members();
  absl::Status waiting;
  RunRanks(2, [&](int rank) {
    if (rank == 0) {
      waiting = group[0]->Barrier();  // rank 1 never comes; Break releases it
    } else {
      fake->Break(absl::AbortedError("peer 1 vanished"));
    }
  });
  EXPECT_EQ(waiting.code(), absl::StatusCode::kAborted);
  absl::Status later = group[1]->Barrier();
  EXPECT_THAT(later, StatusIs(absl::StatusCode::kAborted, "peer 1 vanished"));
}

}  // namespace
}  // namespace lathe
