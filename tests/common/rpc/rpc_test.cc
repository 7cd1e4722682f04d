// The one status conversion and the one retry policy (common/rpc).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/retry_policy.h"

namespace lathe {
namespace {

using ::testing::ElementsAre;

TEST(GrpcStatusTest, EveryCodeAndMessageSurvivesBothWays) {
  for (int code = 0; code <= 16; ++code) {
    const absl::Status status(static_cast<absl::StatusCode>(code),
                              code == 0 ? "" : "spec: train.lr: must be > 0, got -1");
    const grpc::Status wire = ToGrpcStatus(status);
    EXPECT_EQ(static_cast<int>(wire.error_code()), code);
    EXPECT_EQ(FromGrpcStatus(wire), status);
  }
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

// A message quoting what a caller sent (a 300 KB job id) must still fit a client's 8 KiB
// header limit, or the caller sees RESOURCE_EXHAUSTED instead of the error.
TEST(GrpcStatusTest, LongMessagesKeepTheirHeadAndTail) {
  const std::string message = "job " + std::string(300000, 'x') + " not found";
  const grpc::Status wire = ToGrpcStatus(absl::NotFoundError(message));
  EXPECT_EQ(wire.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_LE(wire.error_message().size(), kMaxWireMessageBytes);
  EXPECT_THAT(wire.error_message(), ::testing::StartsWith("job xxx"));
  EXPECT_THAT(wire.error_message(), ::testing::HasSubstr(" bytes cut) ... "));
  EXPECT_THAT(wire.error_message(), ::testing::EndsWith("xxx not found"));
}

TEST(RetryPolicyTest, OnlyUnavailableAndDeadlineExceededAreRetried) {
  for (int code = 0; code <= 16; ++code) {
    const auto c = static_cast<absl::StatusCode>(code);
    EXPECT_EQ(IsRetryable(c),
              c == absl::StatusCode::kUnavailable || c == absl::StatusCode::kDeadlineExceeded)
        << absl::StatusCodeToString(c);
  }
}

RetryOptions NoJitter() {
  RetryOptions options;
  options.initial_backoff = absl::Milliseconds(100);
  options.max_backoff = absl::Milliseconds(700);
  options.jitter = 0;
  return options;
}

TEST(BackoffTest, GrowsExponentiallyToTheCapAndResets) {
  Backoff backoff(NoJitter());
  std::vector<absl::Duration> delays;
  for (int i = 0; i < 5; ++i) delays.push_back(backoff.Next());
  EXPECT_THAT(delays,
              ElementsAre(absl::Milliseconds(100), absl::Milliseconds(200), absl::Milliseconds(400),
                          absl::Milliseconds(700), absl::Milliseconds(700)));
  backoff.Reset();
  EXPECT_EQ(backoff.Next(), absl::Milliseconds(100));
}

TEST(BackoffTest, JitterStaysWithinItsBandAndVaries) {
  RetryOptions options = NoJitter();
  options.jitter = 0.25;
  options.multiplier = 1.0;  // every base delay is 100 ms
  Backoff backoff(options);
  absl::Duration low = absl::InfiniteDuration(), high = absl::ZeroDuration();
  for (int i = 0; i < 200; ++i) {
    const absl::Duration d = backoff.Next();
    EXPECT_GE(d, absl::Milliseconds(75));
    EXPECT_LE(d, absl::Milliseconds(125));
    low = std::min(low, d);
    high = std::max(high, d);
  }
  EXPECT_LT(low, high);
}

// Calls that answer from a script, on a fake clock that the sleeps move.
class RetryCallTest : public ::testing::Test {
 protected:
  absl::Status Run(const RetryOptions& options, absl::Time deadline) {
    return RetryCall(
        options, deadline, clock_,
        [this](absl::Duration d) {
          sleeps_.push_back(d);
          clock_.Advance(d);
        },
        [this] {
          const absl::Status next = answers_[std::min(calls_, answers_.size() - 1)];
          ++calls_;
          return next;
        });
  }

  FakeClock clock_;
  std::vector<absl::Status> answers_;
  size_t calls_ = 0;
  std::vector<absl::Duration> sleeps_;
};

TEST_F(RetryCallTest, RetriesUntilTheCallSucceeds) {
  answers_ = {absl::UnavailableError("down"), absl::DeadlineExceededError("slow"),
              absl::OkStatus()};
  EXPECT_TRUE(Run(NoJitter(), absl::InfiniteFuture()).ok());
  EXPECT_EQ(calls_, 3u);
  EXPECT_THAT(sleeps_, ElementsAre(absl::Milliseconds(100), absl::Milliseconds(200)));
}

TEST_F(RetryCallTest, ACodeThatIsNotRetriedEndsAtOnce) {
  answers_ = {absl::ResourceExhaustedError("does not fit")};
  EXPECT_EQ(Run(NoJitter(), absl::InfiniteFuture()).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(calls_, 1u);
  EXPECT_TRUE(sleeps_.empty());
}

TEST_F(RetryCallTest, StopsAfterMaxAttempts) {
  answers_ = {absl::UnavailableError("down")};
  RetryOptions options = NoJitter();
  options.max_attempts = 3;
  EXPECT_EQ(Run(options, absl::InfiniteFuture()), absl::UnavailableError("down"));
  EXPECT_EQ(calls_, 3u);
}

TEST_F(RetryCallTest, NeverSleepsPastTheDeadline) {
  answers_ = {absl::UnavailableError("down")};
  const absl::Time deadline = clock_.Now() + absl::Milliseconds(350);
  EXPECT_EQ(Run(NoJitter(), deadline).code(), absl::StatusCode::kUnavailable);
  // 100 + 200 ms slept; the next 400 ms would end past the deadline.
  EXPECT_THAT(sleeps_, ElementsAre(absl::Milliseconds(100), absl::Milliseconds(200)));
  EXPECT_EQ(calls_, 3u);
}

}  // namespace
}  // namespace lathe
