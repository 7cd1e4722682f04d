// The write queue's state machine without a stream: what the reactor is told to write and
// when it finishes (the reactors over real gRPC are in auth_test.cc and scale_test.cc).
#include "coordinator/api/write_queue.h"

#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lathe {
namespace {

using Queue = WriteQueue<std::string>;

grpc::Status Failed() { return grpc::Status(grpc::StatusCode::CANCELLED, "write failed"); }

TEST(WriteQueueTest, EveryItemIsWrittenInOrderOneAtATime) {
  Queue queue(Queue::Keep::kEvery, Failed());
  ASSERT_TRUE(queue.Offer("a"));
  EXPECT_EQ(queue.Current(), "a");
  EXPECT_FALSE(queue.Offer("b"));  // a write is in flight
  EXPECT_FALSE(queue.Offer("c"));
  Queue::Next next = queue.WriteDone(true);
  ASSERT_TRUE(next.write);
  EXPECT_FALSE(next.finish);
  EXPECT_EQ(queue.Current(), "b");
  next = queue.WriteDone(true);
  ASSERT_TRUE(next.write);
  EXPECT_EQ(queue.Current(), "c");
  next = queue.WriteDone(true);
  EXPECT_FALSE(next.write);
  EXPECT_FALSE(next.finish);
  ASSERT_TRUE(queue.Offer("d")) << "idle again: written at once";
  EXPECT_EQ(queue.Current(), "d");
}

TEST(WriteQueueTest, ASlowReaderGetsTheNewestItemNotABacklog) {
  Queue queue(Queue::Keep::kNewest, Failed());
  ASSERT_TRUE(queue.Offer("queued"));
  EXPECT_FALSE(queue.Offer("running, step 1"));
  EXPECT_FALSE(queue.Offer("running, step 2"));
  Queue::Next next = queue.WriteDone(true);
  ASSERT_TRUE(next.write);
  EXPECT_EQ(queue.Current(), "running, step 2");
  EXPECT_FALSE(queue.WriteDone(true).write);
}

TEST(WriteQueueTest, TheLastItemFinishesTheStreamOnceWritten) {
  Queue queue(Queue::Keep::kNewest, Failed());
  ASSERT_TRUE(queue.Offer("running"));
  EXPECT_FALSE(queue.Offer("succeeded", /*last=*/true));
  Queue::Next next = queue.WriteDone(true);
  ASSERT_TRUE(next.write);
  EXPECT_FALSE(next.finish) << "not before the last item is written";
  next = queue.WriteDone(true);
  EXPECT_FALSE(next.write);
  ASSERT_TRUE(next.finish);
  EXPECT_TRUE(next.finish->ok());
  EXPECT_FALSE(queue.Offer("after the end"));
  EXPECT_FALSE(queue.End(grpc::Status::OK)) << "finished once";
}

TEST(WriteQueueTest, AnEndWaitsForTheWriteInFlightAndDropsTheRest) {
  Queue queue(Queue::Keep::kEvery, Failed());
  ASSERT_TRUE(queue.Offer("a"));
  EXPECT_FALSE(queue.Offer("b"));
  EXPECT_FALSE(queue.End(grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "denied")));
  EXPECT_FALSE(queue.End(grpc::Status::OK)) << "the first end wins";
  EXPECT_FALSE(queue.Offer("c"));
  const Queue::Next next = queue.WriteDone(true);
  EXPECT_FALSE(next.write) << "b is dropped";
  ASSERT_TRUE(next.finish);
  EXPECT_EQ(next.finish->error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_FALSE(queue.WriteDone(true).finish) << "finished once";
}

TEST(WriteQueueTest, AnEndWithNoWriteInFlightFinishesAtOnce) {
  Queue queue(Queue::Keep::kEvery, Failed());
  std::optional<grpc::Status> finish = queue.End(grpc::Status(grpc::StatusCode::NOT_FOUND, "no"));
  ASSERT_TRUE(finish);
  EXPECT_EQ(finish->error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_FALSE(queue.Offer("a"));
  EXPECT_FALSE(queue.End(grpc::Status::OK));
}

TEST(WriteQueueTest, AFailedWriteFinishesWithTheQueuesStatus) {
  Queue queue(Queue::Keep::kEvery, Failed());
  ASSERT_TRUE(queue.Offer("a"));
  EXPECT_FALSE(queue.Offer("b"));
  const Queue::Next next = queue.WriteDone(false);
  EXPECT_FALSE(next.write);
  ASSERT_TRUE(next.finish);
  EXPECT_EQ(next.finish->error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(next.finish->error_message(), "write failed");
  EXPECT_FALSE(queue.End(grpc::Status::OK));
}

}  // namespace
}  // namespace lathe
