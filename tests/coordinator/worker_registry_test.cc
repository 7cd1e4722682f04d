// The worker registry alone: sessions, liveness, mailboxes and the reports a heartbeat
// leaves, on a fake clock (the scheduler's side of them is in scheduler_test.cc).
#include "coordinator/scheduler/worker_registry.h"

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lathe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;
using AttemptRef = WorkerRegistry::AttemptRef;

class CountingListener : public MailListener {
 public:
  void OnMail() override { ++calls; }
  int calls = 0;
};

v1::Assignment Assignment(const std::string& job, int64_t generation, int64_t rank) {
  v1::Assignment a;
  a.set_job_id(job);
  a.set_generation(generation);
  a.set_rank(rank);
  return a;
}

v1::SlotStatus Running(int64_t slot, const std::string& job, int64_t generation) {
  v1::SlotStatus s;
  s.set_slot(slot);
  s.set_job_id(job);
  s.set_generation(generation);
  return s;
}

class WorkerRegistryTest : public ::testing::Test {
 protected:
  WorkerRegistryTest() : registry_(&clock_, absl::Seconds(15)) {}

  std::string Open(const std::string& worker) {
    absl::StatusOr<std::string> session = registry_.Open(worker);
    EXPECT_TRUE(session.ok()) << session.status();
    sessions_[worker] = session.ok() ? *session : "";
    return sessions_[worker];
  }

  // A heartbeat of the worker's session listing `running`; `*reported` whether it left a
  // report.
  absl::StatusOr<v1::HeartbeatResponse> Beat(const std::string& worker,
                                             const std::vector<v1::SlotStatus>& running = {},
                                             uint64_t durable = 0,
                                             std::shared_ptr<MailListener> listener = nullptr,
                                             bool* reported = nullptr) {
    v1::HeartbeatRequest request;
    request.set_worker_id(worker);
    request.set_session_id(sessions_[worker]);
    for (const v1::SlotStatus& s : running) *request.add_slots() = s;
    bool ignored = false;
    return registry_.Heartbeat(request, std::move(listener), durable,
                               reported != nullptr ? reported : &ignored);
  }

  FakeClock clock_;
  WorkerRegistry registry_;
  std::map<std::string, std::string> sessions_;
};

TEST_F(WorkerRegistryTest, RegistrationsAreBounded) {
  v1::RegisterWorkerRequest request;
  request.set_worker_id("gpu-node-1");
  request.set_slots(8);
  EXPECT_TRUE(WorkerRegistry::CheckRegistration(request).ok());
  request.set_worker_id("a b");
  EXPECT_THAT(WorkerRegistry::CheckRegistration(request).message(), HasSubstr("worker_id"));
  request.set_worker_id(std::string(129, 'w'));
  EXPECT_FALSE(WorkerRegistry::CheckRegistration(request).ok());
  request.set_worker_id("w1");
  request.set_slots(0);
  EXPECT_THAT(WorkerRegistry::CheckRegistration(request).message(), HasSubstr("slots"));
  request.set_slots(1);
  request.set_address(std::string(257, 'a'));
  EXPECT_THAT(WorkerRegistry::CheckRegistration(request).message(), HasSubstr("at most 256"));
}

TEST_F(WorkerRegistryTest, AHeartbeatNeedsTheCurrentSession) {
  sessions_["w1"] = "made-up";
  EXPECT_EQ(Beat("w1").status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string first = Open("w1");
  EXPECT_THAT(first, ::testing::StartsWith("w1/"));
  EXPECT_TRUE(Beat("w1").ok());
  const std::string second = Open("w1");  // no stream: the id is free to take
  EXPECT_NE(first, second);
  sessions_["w1"] = first;
  EXPECT_EQ(Beat("w1").status().code(), absl::StatusCode::kFailedPrecondition);
  sessions_["w1"] = second;
  EXPECT_TRUE(Beat("w1").ok());
  EXPECT_EQ(registry_.heartbeats(), 2);
  // Too many slots is refused before the session is looked at.
  std::vector<v1::SlotStatus> many(WorkerRegistry::kMaxSlots + 1);
  EXPECT_EQ(Beat("w1", many).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(WorkerRegistryTest, ALiveAgentsIdIsNotTakenOver) {
  Open("w1");
  auto stream = std::make_shared<CountingListener>();
  ASSERT_TRUE(Beat("w1", {}, 0, stream).ok());
  clock_.Advance(absl::Seconds(3));
  absl::StatusOr<std::string> refused = registry_.Open("w1");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("is registered by a live agent (its heartbeat stream is open, the last "
                        "heartbeat 3.0s ago)"));
  clock_.Advance(absl::Seconds(13));  // silent for longer than the timeout
  EXPECT_TRUE(registry_.Open("w1").ok());
  Open("w1");
  ASSERT_TRUE(Beat("w1", {}, 0, stream).ok());
  EXPECT_FALSE(registry_.Open("w1").ok());
  stream.reset();  // the stream closed
  EXPECT_TRUE(registry_.Open("w1").ok());
}

TEST_F(WorkerRegistryTest, LivenessComesFromHeartbeatArrivalsAlone) {
  Open("w1");
  Open("w2");
  registry_.Restore("old", /*live=*/true);  // known from the store: a window to register
  registry_.Restore("gone", /*live=*/false);
  clock_.Advance(absl::Seconds(10));
  ASSERT_TRUE(Beat("w1").ok());
  EXPECT_THAT(registry_.Silent(), IsEmpty());
  clock_.Advance(absl::Seconds(6));
  EXPECT_THAT(registry_.Silent(),
              ElementsAre(Pair("old", absl::Seconds(16)), Pair("w2", absl::Seconds(16))));
  // A stall of the coordinator: every live worker's window starts again.
  EXPECT_EQ(registry_.RenewWindows(), 3);
  EXPECT_THAT(registry_.Silent(), IsEmpty());
  // A lost worker is no longer checked, and its session is over.
  registry_.Lose("w2");
  clock_.Advance(absl::Seconds(16));
  EXPECT_THAT(registry_.Silent(),
              ElementsAre(Pair("old", absl::Seconds(16)), Pair("w1", absl::Seconds(16))));
  EXPECT_EQ(Beat("w2").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(WorkerRegistryTest, AssignmentsAreDeliveredOnceTheirBatchIsDurable) {
  Open("w1");
  registry_.Post("w1", /*batch=*/2, {Assignment("job", 1, 0), Assignment("job", 1, 1)});
  registry_.Post("w1", /*batch=*/3, {Assignment("other", 1, 0)});
  absl::StatusOr<v1::HeartbeatResponse> answer = Beat("w1", {}, /*durable=*/1);
  ASSERT_TRUE(answer.ok());
  EXPECT_EQ(answer->assignments_size(), 0);
  answer = Beat("w1", {}, /*durable=*/2);
  ASSERT_EQ(answer->assignments_size(), 2);
  EXPECT_EQ(answer->assignments(1).rank(), 1);
  // Pushed: only to the current session.
  EXPECT_EQ(registry_.TakeMail("w1", "another", 3).assignments_size(), 0);
  v1::HeartbeatResponse pushed = registry_.TakeMail("w1", sessions_["w1"], 3);
  ASSERT_EQ(pushed.assignments_size(), 1);
  EXPECT_EQ(pushed.assignments(0).job_id(), "other");
  EXPECT_EQ(registry_.TakeMail("w1", sessions_["w1"], 3).assignments_size(), 0);
}

TEST_F(WorkerRegistryTest, AnUndeliveredAssignmentIsWithdrawnADeliveredOneCancelled) {
  Open("w1");
  registry_.Post("w1", 1, {Assignment("job", 1, 0), Assignment("job", 1, 1)});
  EXPECT_TRUE(registry_.WithdrawOrCancel("w1", "job", 1, 0, "cancelled by the user"));
  absl::StatusOr<v1::HeartbeatResponse> answer = Beat("w1", {}, 1);
  ASSERT_EQ(answer->assignments_size(), 1);
  EXPECT_EQ(answer->cancellations_size(), 0);
  EXPECT_FALSE(registry_.WithdrawOrCancel("w1", "job", 1, 1, "cancelled by the user"));
  answer = Beat("w1", {}, 1);
  ASSERT_EQ(answer->cancellations_size(), 1);
  EXPECT_EQ(answer->cancellations(0).reason(), "cancelled by the user");
  EXPECT_EQ(Beat("w1", {}, 1)->cancellations_size(), 0) << "a cancellation is sent once";
  // A stale rank is cancelled once however often the scheduler sees it.
  registry_.CancelUnlessPending("w1", {{"old", 2}, {"old", 2}}, "no longer current");
  registry_.CancelUnlessPending("w1", {{"old", 2}}, "no longer current");
  EXPECT_EQ(Beat("w1", {}, 1)->cancellations_size(), 1);
  // A lost worker's mail is dropped: its next session starts with none.
  registry_.Post("w1", 1, {Assignment("next", 1, 0)});
  registry_.Lose("w1");
  Open("w1");
  EXPECT_EQ(registry_.TakeMail("w1", sessions_["w1"], 1).assignments_size(), 0);
}

// `lathe profile`'s orders travel like cancellations: deliverable at once (whatever is
// durable), sent once, the worker waits for a push, and a lost worker's are dropped.
TEST_F(WorkerRegistryTest, AProfileOrderIsDeliveredOnceAndDroppedWithALostWorker) {
  Open("w1");
  v1::ProfileOrder order;
  order.set_job_id("job");
  order.set_generation(1);
  order.set_capture_id("prof-1");
  registry_.PostProfile("w1", order);
  EXPECT_THAT(registry_.TakeWaiting(), ElementsAre("w1"));
  absl::StatusOr<v1::HeartbeatResponse> answer = Beat("w1", {}, /*durable=*/0);
  ASSERT_EQ(answer->profiles_size(), 1);
  EXPECT_EQ(answer->profiles(0).capture_id(), "prof-1");
  EXPECT_EQ(Beat("w1", {}, 0)->profiles_size(), 0) << "an order is sent once";
  registry_.PostProfile("w1", order);
  EXPECT_EQ(registry_.TakeMail("w1", sessions_["w1"], 0).profiles_size(), 1) << "pushed";
  registry_.PostProfile("w1", order);
  registry_.Lose("w1");
  Open("w1");
  EXPECT_EQ(registry_.TakeMail("w1", sessions_["w1"], 0).profiles_size(), 0);
}

TEST_F(WorkerRegistryTest, AHeartbeatReportsChangesTheFirstOfASessionAndNowAndThen) {
  Open("w1");
  bool reported = false;
  ASSERT_TRUE(Beat("w1", {}, 0, nullptr, &reported).ok());
  EXPECT_TRUE(reported) << "the first heartbeat of a registration";
  ASSERT_TRUE(Beat("w1", {}, 0, nullptr, &reported).ok());
  EXPECT_FALSE(reported);
  ASSERT_TRUE(Beat("w1", {Running(0, "job", 1)}, 0, nullptr, &reported).ok());
  EXPECT_TRUE(reported) << "what it runs changed";
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(Beat("w1", {Running(0, "job", 1)}, 0, nullptr, &reported).ok());
  EXPECT_FALSE(reported);
  clock_.Advance(absl::Seconds(14));  // 16 s since the last report, running something
  ASSERT_TRUE(Beat("w1", {Running(0, "job", 1)}, 0, nullptr, &reported).ok());
  EXPECT_TRUE(reported);
  std::vector<WorkerRegistry::Report> reports = registry_.TakeReports();
  ASSERT_EQ(reports.size(), 3u);
  EXPECT_TRUE(reports[0].reconcile);
  EXPECT_FALSE(reports[1].reconcile);
  EXPECT_EQ(reports[1].session_id, sessions_["w1"]);
  ASSERT_EQ(reports[2].running.size(), 1u);
  EXPECT_EQ(reports[2].running[0].job_id(), "job");
  EXPECT_THAT(registry_.TakeReports(), IsEmpty());
  // ListWorkers' view: what it runs and when it was heard.
  std::vector<v1::WorkerStatus> workers(2);
  workers[0].set_worker_id("w1");
  workers[1].set_worker_id("unknown");
  registry_.Describe(workers);
  ASSERT_EQ(workers[0].running_size(), 1);
  EXPECT_EQ(workers[0].last_heartbeat_unix_ms(), absl::ToUnixMillis(clock_.Now()));
  EXPECT_EQ(workers[1].running_size(), 0);
}

// After a registration, a rank the worker does not list is lost unless it was sent to the
// new session (it could not list it yet) or is still waiting to be.
TEST_F(WorkerRegistryTest, ReconcilingCountsWhatWasSentSinceTheRegistration) {
  registry_.Post("w1", 1, {Assignment("before", 1, 0)});  // delivered to the old session
  Open("w1");
  ASSERT_EQ(Beat("w1", {}, 1)->assignments_size(), 1);  // the first heartbeat takes it
  registry_.Post("w1", 5, {Assignment("waiting", 1, 0)});
  EXPECT_THAT(registry_.Reconcile("w1", {{"before", 1}, {"waiting", 1}, {"vanished", 3}}),
              ElementsAre(AttemptRef("vanished", 3)));
  // Reconciled once: what is delivered later is no longer remembered.
  ASSERT_EQ(Beat("w1", {}, 5)->assignments_size(), 1);
  EXPECT_THAT(registry_.Reconcile("w1", {{"waiting", 1}}), ElementsAre(AttemptRef("waiting", 1)));
}

TEST_F(WorkerRegistryTest, OnlyWorkersWithNewMailAreTold) {
  Open("w1");
  Open("w2");
  Open("w3");
  auto one = std::make_shared<CountingListener>();
  auto two = std::make_shared<CountingListener>();
  ASSERT_TRUE(Beat("w1", {}, 0, one).ok());
  ASSERT_TRUE(Beat("w2", {}, 0, two).ok());
  registry_.Post("w1", 1, {Assignment("job", 1, 0)});
  registry_.WithdrawOrCancel("w3", "job", 1, 1, "stopped");  // w3 has no stream
  std::set<std::string> waiting = registry_.TakeWaiting();
  EXPECT_THAT(waiting, ElementsAre("w1", "w3"));
  EXPECT_THAT(registry_.TakeWaiting(), IsEmpty());
  registry_.Notify(waiting);
  EXPECT_EQ(one->calls, 1);
  EXPECT_EQ(two->calls, 0);
  // A new session's stream opens with its first heartbeat: until then nobody is told.
  clock_.Advance(absl::Seconds(16));  // the old stream's agent went silent
  Open("w1");
  registry_.Notify({"w1"});
  EXPECT_EQ(one->calls, 1);
  registry_.Remove("w2");
  registry_.Notify({"w2"});
  EXPECT_EQ(two->calls, 0);
}

}  // namespace
}  // namespace lathe
