#include "coordinator/scheduler/scheduler.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/capabilities.h"
#include "common/proto/job_spec_proto.h"
#include "coordinator/rendezvous/rendezvous_store.h"
#include "coordinator/scheduler/job_manager.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/device_pools.h"
#include "planner/plan_spec.h"
#include "tests/testing/default_plan.h"
#include "tests/testing/forwarding_store.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tiny_model.h"
#include "worker/tools/synthetic.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

class SchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = NewMemoryStore();
    scheduler_ = *Scheduler::Create(store_.get(), &clock_, {absl::Seconds(2), absl::Seconds(15)});
  }

  // Registers a worker; returns its session.
  std::string Register(const std::string& id, int64_t slots = 1, uint64_t host_memory = 0,
                       std::vector<uint64_t> gpu_memory = {}) {
    v1::RegisterWorkerRequest request;
    request.set_worker_id(id);
    request.set_device(gpu_memory.empty() ? v1::DEVICE_CPU : v1::DEVICE_CUDA);
    request.set_slots(slots);
    request.set_host_memory_bytes(host_memory);
    for (size_t i = 0; i < gpu_memory.size(); ++i) {
      v1::DeviceInfo* d = request.add_devices();
      d->set_index(static_cast<int64_t>(i));
      d->set_memory_bytes(gpu_memory[i]);
    }
    absl::StatusOr<v1::RegisterWorkerResponse> response = scheduler_->RegisterWorker(request);
    EXPECT_TRUE(response.ok()) << response.status();
    sessions_[id] = response->session_id();
    scheduler_->Settle();
    return response->session_id();
  }

  // One heartbeat with the given running slots.
  v1::HeartbeatResponse Beat(const std::string& worker,
                             const std::vector<v1::SlotStatus>& running = {}) {
    v1::HeartbeatRequest request;
    request.set_worker_id(worker);
    request.set_session_id(sessions_[worker]);
    for (const v1::SlotStatus& s : running) *request.add_slots() = s;
    absl::StatusOr<v1::HeartbeatResponse> response = scheduler_->Heartbeat(request);
    EXPECT_TRUE(response.ok()) << response.status();
    scheduler_->Settle();  // what the heartbeat reported
    return response.ok() ? *response : v1::HeartbeatResponse();
  }

  std::string Add(const std::string& id, int64_t ranks = 1, int64_t priority = 0,
                  uint64_t per_rank_peak = 0, v1::Device device = v1::DEVICE_CPU) {
    v1::JobStatus job;
    job.set_job_id(id);
    job.mutable_spec()->set_name(id);
    job.mutable_spec()->set_priority(priority);
    job.mutable_spec()->set_output("/runs/" + id);
    job.mutable_plan()->set_ranks(ranks);
    job.mutable_plan()->set_device(device);
    job.mutable_plan()->mutable_predicted_memory()->set_total(per_rank_peak);
    bool existing = false;
    absl::StatusOr<v1::JobStatus> added = scheduler_->AddJob(job, "", &existing);
    EXPECT_TRUE(added.ok()) << added.status();
    scheduler_->Settle();
    return id;
  }

  // A job whose plan predicts `peak` per rank, corrected by `correction`.
  static v1::JobStatus PlannedJob(const std::string& id, int64_t ranks, uint64_t peak,
                                  double correction, const std::string& key) {
    v1::JobStatus job;
    job.set_job_id(id);
    job.mutable_plan()->set_ranks(ranks);
    job.mutable_plan()->mutable_predicted_memory()->set_total(peak);
    job.mutable_plan()->set_memory_correction(correction);
    job.mutable_plan()->set_calibration_key(key);
    return job;
  }

  v1::JobStatus Job(const std::string& id) { return *scheduler_->GetJob(id); }

  absl::Status Report(const std::string& worker, const std::string& job, int64_t generation,
                      int64_t rank, v1::RankEvent event, const std::string& error = "") {
    v1::ReportProgressRequest request;
    request.set_worker_id(worker);
    request.set_job_id(job);
    request.set_generation(generation);
    request.set_rank(rank);
    request.set_event(event);
    request.set_error(error);
    absl::Status status = scheduler_->ReportProgress(request);
    scheduler_->Settle();
    return status;
  }

  FakeClock clock_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Scheduler> scheduler_;
  std::map<std::string, std::string> sessions_;
};

TEST_F(SchedulerTest, GangPlacementNeverPlacesPartOfAJob) {
  Register("w1");
  Register("w2");
  Add("big", 3);
  v1::JobStatus job = Job("big");
  EXPECT_EQ(job.state(), v1::JOB_STATE_QUEUED);
  EXPECT_THAT(job.reason(), HasSubstr("needs 3 cpu slots; 2 registered"));
  EXPECT_TRUE(job.attempts().empty());
  EXPECT_EQ(Beat("w1").assignments_size(), 0);
  EXPECT_EQ(Beat("w2").assignments_size(), 0);

  Register("w3");
  job = Job("big");
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  ASSERT_EQ(job.attempts_size(), 1);
  EXPECT_EQ(job.attempts(0).placements_size(), 3);
  std::set<int64_t> ranks;
  for (const char* w : {"w1", "w2", "w3"}) {
    v1::HeartbeatResponse response = Beat(w);
    ASSERT_EQ(response.assignments_size(), 1) << w;
    EXPECT_EQ(response.assignments(0).world_size(), 3);
    EXPECT_EQ(response.assignments(0).generation(), 1);
    ranks.insert(response.assignments(0).rank());
  }
  EXPECT_EQ(ranks, (std::set<int64_t>{0, 1, 2}));
}

TEST_F(SchedulerTest, WaitingReasonCountsFreeSlots) {
  Register("w1", 2);
  Add("a", 1);
  Add("b", 2);
  EXPECT_THAT(Job("b").reason(), HasSubstr("waiting for 2 free cpu slots; 1 of 2 free"));
}

TEST_F(SchedulerTest, AJobIsPlacedOnlyWhereItsPredictedPeakFits) {
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  // CPU slots share their host's memory: two ranks of 10 GiB do not fit in 16 GiB.
  Register("small", 2, 16 * kGiB);
  Add("cpu", 2, 0, 10 * kGiB);
  EXPECT_EQ(Job("cpu").state(), v1::JOB_STATE_QUEUED);
  EXPECT_THAT(Job("cpu").reason(),
              HasSubstr("needs 10.0 GiB per rank on 2 cpu slots; 1 of the 2 free slots have "
                        "that much (largest free 16.0 GiB)"));
  EXPECT_EQ(Beat("small").assignments_size(), 0);
  Register("big", 3, 64 * kGiB);
  const v1::JobStatus placed = Job("cpu");
  ASSERT_EQ(placed.state(), v1::JOB_STATE_RUNNING);
  for (const v1::RankPlacement& p : placed.attempts(0).placements()) {
    EXPECT_EQ(p.worker_id(), "big");
  }
  // What runs there counts: 44 GiB are left on "big", so a 50 GiB rank waits...
  Add("huge", 1, 0, 50 * kGiB);
  EXPECT_EQ(Job("huge").state(), v1::JOB_STATE_QUEUED);
  EXPECT_THAT(Job("huge").reason(), HasSubstr("largest free 44.0 GiB"));
  // ...and a job with no prediction is placed as before.
  Add("unknown", 1);
  EXPECT_EQ(Job("unknown").state(), v1::JOB_STATE_RUNNING);

  // A GPU slot is one device: its own memory decides.
  Register("gpus", 2, 0, {40 * kGiB, 80 * kGiB});
  Add("gpu", 1, 0, 60 * kGiB, v1::DEVICE_CUDA);
  ASSERT_EQ(Job("gpu").state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job("gpu").attempts(0).placements(0).slot(), 1);
  Add("gpu-too-big", 1, 0, 60 * kGiB, v1::DEVICE_CUDA);
  EXPECT_THAT(Job("gpu-too-big").reason(),
              HasSubstr("needs 60.0 GiB per rank on 1 cuda slots; 0 of the 1 free slots"));
}

TEST_F(SchedulerTest, QueueOrderIsPriorityThenSubmission) {
  Register("w1");
  Add("running");
  Add("low", 1, 0);
  Add("high", 1, 5);
  Add("high-later", 1, 5);
  std::vector<std::string> order;
  std::string current = "running";
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(Job(current).state(), v1::JOB_STATE_RUNNING) << current;
    ASSERT_TRUE(Report("w1", current, 1, 0, v1::RANK_EVENT_SUCCEEDED).ok());
    EXPECT_EQ(Job(current).state(), v1::JOB_STATE_SUCCEEDED);
    for (const v1::JobStatus& j :
         scheduler_->ListJobs({{v1::JOB_STATE_RUNNING}, "", 0, INT64_MAX, 1000, 0, {}}).jobs) {
      current = j.job_id();
      order.push_back(current);
    }
  }
  EXPECT_EQ(order, (std::vector<std::string>{"high", "high-later", "low"}));
}

TEST_F(SchedulerTest, SmallerJobsBackfillWhileALargeOneWaits) {
  Register("w1");
  Register("w2");
  Add("one");
  Add("two", 2);
  Add("another-one");
  EXPECT_EQ(Job("two").state(), v1::JOB_STATE_QUEUED);
  EXPECT_EQ(Job("another-one").state(), v1::JOB_STATE_RUNNING);
}

// Issue #27: a second agent under the id of a live session (open heartbeat stream, heartbeats
// within the timeout) is refused; once that stream closes, or its heartbeats stop for a
// timeout, the id is free again (a restarted agent).
TEST_F(SchedulerTest, ALiveSessionsWorkerIdIsNotTakenOver) {
  struct Stream : MailListener {
    void OnMail() override {}
  };
  Register("w1");
  Add("job");
  auto stream = std::make_shared<Stream>();
  v1::HeartbeatRequest beat;
  beat.set_worker_id("w1");
  beat.set_session_id(sessions_["w1"]);
  ASSERT_TRUE(scheduler_->Heartbeat(beat, stream).ok());
  v1::RegisterWorkerRequest again;
  again.set_worker_id("w1");
  again.set_slots(4);
  absl::StatusOr<v1::RegisterWorkerResponse> refused = scheduler_->RegisterWorker(again);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("worker w1 is registered by a live agent (its heartbeat stream is open"));
  scheduler_->Settle();
  EXPECT_EQ(Job("job").state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job("job").attempts_size(), 1);
  // Silent for longer than the timeout, the open stream no longer holds the id.
  clock_.Advance(absl::Seconds(16));
  EXPECT_TRUE(scheduler_->RegisterWorker(again).ok());
  // A closed stream frees it at once.
  sessions_["w1"] = scheduler_->RegisterWorker(again)->session_id();
  beat.set_session_id(sessions_["w1"]);
  ASSERT_TRUE(scheduler_->Heartbeat(beat, stream).ok());
  EXPECT_FALSE(scheduler_->RegisterWorker(again).ok());
  stream.reset();
  EXPECT_TRUE(scheduler_->RegisterWorker(again).ok());
}

// Issue #27: a job is its submitter's. Another client finds nothing under its id (get, list,
// watch, cancel, logs, plan history) and its own request ids are its own; an admin sees
// every job; each state change says who made it.
TEST_F(SchedulerTest, AJobIsItsOwnersAndItsHistorySaysWhoChangedIt) {
  const Requester alice{"alice", false, "alice (client)"};
  const Requester bob{"bob", false, "bob (client)"};
  const Requester admin{"ops", true, "ops (admin)"};
  Register("w1");
  v1::JobStatus job;
  job.set_job_id("job");
  job.mutable_spec()->set_output("/runs/job");
  job.mutable_plan()->set_ranks(1);
  bool existing = false;
  ASSERT_TRUE(scheduler_->AddJob(job, "request-1", &existing, alice).ok());
  scheduler_->Settle();
  ASSERT_EQ(Job("job").state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job("job").owner(), "alice");

  EXPECT_EQ(scheduler_->GetJob("job", bob).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(scheduler_->GetJob("job", bob).status().message(), "job job not found");
  EXPECT_TRUE(scheduler_->GetJob("job", alice).ok());
  EXPECT_TRUE(scheduler_->GetJob("job", admin).ok());
  auto listed = [&](const Requester& who) {
    JobQuery query;
    query.requester = who;
    return scheduler_->ListJobs(query).jobs.size();
  };
  EXPECT_EQ(listed(bob), 0u);
  EXPECT_EQ(listed(alice), 1u);
  EXPECT_EQ(listed(admin), 1u);
  EXPECT_EQ(scheduler_
                ->Watch(
                    "job", [](auto) {}, bob)
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(scheduler_->LogAttempt("job", 0, 0, bob).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(scheduler_->CancelJob("job", "mine now", bob).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Job("job").state(), v1::JOB_STATE_RUNNING);
  // Bob's request id "request-1" is not alice's: it neither returns her job nor clashes.
  job.set_job_id("bobs");
  job.mutable_spec()->set_output("/runs/bobs");
  absl::StatusOr<v1::JobStatus> bobs = scheduler_->AddJob(job, "request-1", &existing, bob);
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_FALSE(existing);
  EXPECT_EQ(bobs->job_id(), "bobs");
  // An output held by a job bob does not see is not named to him.
  job.set_job_id("bobs-2");
  job.mutable_spec()->set_output("/runs/job");
  absl::Status taken = scheduler_->AddJob(job, "", &existing, bob).status();
  EXPECT_THAT(taken.message(), HasSubstr("belongs to another client's job (running)"));

  ASSERT_TRUE(scheduler_->CancelJob("job", "", admin).ok());
  const v1::JobStatus cancelled = Job("job");
  EXPECT_EQ(cancelled.reason(), "cancelled by ops (admin)");
  ASSERT_EQ(cancelled.history_size(), 3);
  EXPECT_EQ(cancelled.history(0).state(), v1::JOB_STATE_QUEUED);
  EXPECT_EQ(cancelled.history(0).by(), "alice (client)");
  EXPECT_EQ(cancelled.history(1).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(cancelled.history(1).by(), "the coordinator");
  EXPECT_EQ(cancelled.history(2).state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(cancelled.history(2).by(), "ops (admin)");
  EXPECT_EQ(cancelled.history(2).reason(), "cancelled by ops (admin)");
  // And it is durable: a restarted coordinator shows the same.
  scheduler_ = *Scheduler::Create(store_.get(), &clock_, {});
  EXPECT_EQ(Job("job").history_size(), 3);
  EXPECT_EQ(Job("job").owner(), "alice");
}

// Issue #27: a worker's report names who ended the attempt, only the worker a rank is placed
// on writes its log, and a log closes a minute after its attempt ended.
TEST_F(SchedulerTest, LogsComeFromTheRanksWorkerAndCloseAfterTheAttempt) {
  Register("w1");
  Register("w2");
  Add("job");
  ASSERT_EQ(Job("job").state(), v1::JOB_STATE_RUNNING);
  const std::string placed = Job("job").attempts(0).placements(0).worker_id();
  const std::string other = placed == "w1" ? "w2" : "w1";
  EXPECT_EQ(*scheduler_->AttemptWorkers("job", 1), std::vector<std::string>{placed});
  EXPECT_EQ(scheduler_->AttemptWorkers("job", 2).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(scheduler_->CheckLogWriter("job", 1, 0, placed).ok());
  EXPECT_EQ(scheduler_->CheckLogWriter("job", 1, 0, other).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(Report(placed, "job", 1, 0, v1::RANK_EVENT_SUCCEEDED).ok());
  EXPECT_EQ(Job("job").history().rbegin()->by(), "worker " + placed);
  clock_.Advance(absl::Seconds(59));
  EXPECT_TRUE(scheduler_->CheckLogWriter("job", 1, 0, placed).ok()) << "the last lines";
  clock_.Advance(absl::Seconds(2));
  absl::Status closed = scheduler_->CheckLogWriter("job", 1, 0, placed);
  EXPECT_EQ(closed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(closed.message(), HasSubstr("ended 61s ago; its logs are closed"));
}

// Issue #27: after the coordinator's own stall every worker gets a fresh heartbeat window;
// one that stays silent for a whole window after it is lost as before.
TEST_F(SchedulerTest, AStallOfTheCoordinatorChargesNoWorker) {
  Register("w1");
  Register("w2");
  Add("job", 2);
  Beat("w1");
  Beat("w2");
  clock_.Advance(absl::Seconds(30));  // stopped: no heartbeat could be received
  scheduler_->RenewHeartbeatWindows(absl::Seconds(30));
  scheduler_->CheckHeartbeats();
  scheduler_->Settle();
  for (const v1::WorkerStatus& w : scheduler_->ListWorkers()) {
    EXPECT_NE(w.state(), v1::WORKER_STATE_LOST) << w.worker_id();
  }
  EXPECT_EQ(Job("job").state(), v1::JOB_STATE_RUNNING);
  Beat("w1");
  clock_.Advance(absl::Seconds(16));  // w2 silent for a whole window after the stall
  Beat("w1");
  scheduler_->CheckHeartbeats();
  scheduler_->Settle();
  EXPECT_THAT(Job("job").reason(), HasSubstr("worker w2 lost: no heartbeat for 16s"));
}

TEST_F(SchedulerTest, HeartbeatTimeoutMarksTheWorkerLostAndFailsItsAttempt) {
  Register("w1");
  Register("w2");
  Add("job", 2);
  Beat("w1");
  Beat("w2");
  clock_.Advance(absl::Seconds(10));
  Beat("w1");
  clock_.Advance(absl::Seconds(10));  // w2 silent for 20 s, w1 for 10 s
  scheduler_->CheckHeartbeats();
  scheduler_->Settle();
  std::map<std::string, v1::WorkerState> states;
  for (const v1::WorkerStatus& w : scheduler_->ListWorkers()) states[w.worker_id()] = w.state();
  EXPECT_EQ(states["w1"], v1::WORKER_STATE_READY);
  EXPECT_EQ(states["w2"], v1::WORKER_STATE_LOST);
  v1::JobStatus job = Job("job");
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.reason(), HasSubstr("worker w2 lost: no heartbeat for 20s"));
  EXPECT_EQ(job.attempts(0).state(), v1::ATTEMPT_STATE_FAILED);
  // The surviving rank is told to stop; the lost worker must register again.
  v1::HeartbeatResponse response = Beat("w1");
  ASSERT_EQ(response.cancellations_size(), 1);
  EXPECT_EQ(response.cancellations(0).job_id(), "job");
  v1::HeartbeatRequest stale;
  stale.set_worker_id("w2");
  stale.set_session_id(sessions_["w2"]);
  EXPECT_EQ(scheduler_->Heartbeat(stale).status().code(), absl::StatusCode::kFailedPrecondition);
}

// The store underneath, counting the transactions and job records that reach it.
class CountingStore : public testing::ForwardingStore {
 public:
  using ForwardingStore::ForwardingStore;
  absl::Status Write(const StoreBatch& batch) override {
    if (fail_writes) return absl::UnavailableError("the disk is away");
    ++writes;
    updates += static_cast<int>(batch.jobs.size());
    last_batch = batch;
    return ForwardingStore::Write(batch);
  }
  int writes = 0;
  StoreBatch last_batch;
  bool fail_writes = false;
  int updates = 0;
};

// Why a queued job waits changes with every worker that comes and goes: shown at once, but
// never a store write (with thousands queued, a pass would be thousands of fsyncs).
TEST_F(SchedulerTest, QueueReasonsAreShownButNotWritten) {
  CountingStore counting(store_.get());
  scheduler_ = *Scheduler::Create(&counting, &clock_, {absl::Seconds(2), absl::Seconds(15)});
  for (int i = 0; i < 50; ++i) Add("job-" + std::to_string(i), /*ranks=*/2);
  EXPECT_THAT(Job("job-7").reason(), HasSubstr("needs 2 cpu slots; 0 registered"));
  const int before = counting.updates;
  Register("w1");
  EXPECT_THAT(Job("job-7").reason(), HasSubstr("needs 2 cpu slots; 1 registered"));
  Register("w2", 1);
  Register("w3", 1);  // now placeable: job-0 runs (a real change, written)
  EXPECT_EQ(Job("job-0").state(), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(Job("job-7").reason(), HasSubstr("waiting for 2 free cpu slots"));
  EXPECT_EQ(counting.updates - before, 1);
}

// A pass that places many jobs writes them in one transaction, and their assignments are
// delivered only once it is durable.
TEST_F(SchedulerTest, APassIsOneTransaction) {
  CountingStore counting(store_.get());
  scheduler_ = *Scheduler::Create(&counting, &clock_, {absl::Seconds(2), absl::Seconds(15)});
  for (int i = 0; i < 20; ++i) Add("job-" + std::to_string(i));
  const int writes = counting.writes;
  Register("big", /*slots=*/16);
  EXPECT_EQ(counting.writes - writes, 1);
  EXPECT_EQ(counting.last_batch.jobs.size(), 16u);
  ASSERT_EQ(counting.last_batch.workers.size(), 1u) << "the registration, with its placements";
  EXPECT_EQ(Beat("big").assignments_size(), 16);
  EXPECT_EQ(Job("job-16").state(), v1::JOB_STATE_QUEUED);
}

// An assignment is delivered only once its placement is durable; one pushed between a
// re-registered worker's first heartbeat and the reconciliation of that heartbeat does not
// make its rank "lost" (the worker could not list it).
TEST_F(SchedulerTest, OnlyDurablePlacementsAreDeliveredAndAPushIsNotALoss) {
  CountingStore counting(store_.get());
  scheduler_ = *Scheduler::Create(&counting, &clock_, {absl::Seconds(2), absl::Seconds(15)});
  Add("job");
  Add("other");
  counting.fail_writes = true;
  v1::RegisterWorkerRequest request;
  request.set_worker_id("w1");
  request.set_slots(1);
  sessions_["w1"] = scheduler_->RegisterWorker(request)->session_id();
  scheduler_->Settle();  // placed, but the write failed
  ASSERT_EQ(Job("job").state(), v1::JOB_STATE_RUNNING);
  v1::HeartbeatRequest beat;
  beat.set_worker_id("w1");
  beat.set_session_id(sessions_["w1"]);
  beat.set_sequence(7);
  absl::StatusOr<v1::HeartbeatResponse> answer = scheduler_->Heartbeat(beat);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->assignments_size(), 0) << "delivered before it was durable";
  EXPECT_EQ(answer->in_reply_to(), 7);
  // Another call's write makes the placement durable too; the stream's push takes it.
  counting.fail_writes = false;
  ASSERT_TRUE(scheduler_->CancelJob("other", "").ok());
  EXPECT_EQ(scheduler_->TakeMail("w1", sessions_["w1"]).assignments_size(), 1);
  scheduler_->Settle();  // reconciles the heartbeat sent before the push
  EXPECT_EQ(Job("job").state(), v1::JOB_STATE_RUNNING) << Job("job").reason();
  EXPECT_EQ(Job("job").attempts_size(), 1);
}

// --- restarts ----------------------------------------------------------------------------

class RestartTest : public SchedulerTest {
 protected:
  // A one-rank job allowed `max_restarts`, placed on w1.
  void SetUp() override {
    SchedulerTest::SetUp();
    Register("w1");
  }
  void AddJob(int64_t max_restarts) {
    v1::JobStatus job;
    job.set_job_id("job");
    job.mutable_spec()->set_max_restarts(max_restarts);
    job.mutable_plan()->set_ranks(1);
    bool existing = false;
    ASSERT_TRUE(scheduler_->AddJob(job, "", &existing).ok());
    scheduler_->Settle();
  }
  absl::Status Fail(int64_t generation, v1::FailureKind kind) {
    v1::ReportProgressRequest request;
    request.set_worker_id("w1");
    request.set_job_id("job");
    request.set_generation(generation);
    request.set_event(v1::RANK_EVENT_FAILED);
    request.set_error("the trainer was killed by signal 9");
    request.set_failure(kind);
    absl::Status status = scheduler_->ReportProgress(request);
    scheduler_->Settle();
    return status;
  }
};

TEST_F(RestartTest, InfrastructureFailuresRestartWithABackoffUntilMaxRestarts) {
  AddJob(2);
  ASSERT_EQ(Job("job").attempts_size(), 1);
  ASSERT_TRUE(Fail(1, v1::FAILURE_KIND_INFRASTRUCTURE).ok());
  v1::JobStatus job = Job("job");
  EXPECT_EQ(job.state(), v1::JOB_STATE_QUEUED);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.attempts(0).failure(), v1::FAILURE_KIND_INFRASTRUCTURE);
  EXPECT_EQ(job.reason(),
            "restart 1 of 2 in 1s after attempt 1 failed: rank 0 on worker w1 failed: the "
            "trainer was killed by signal 9");
  // Not placed before the backoff ends, although the slot is free.
  scheduler_->CheckHeartbeats();
  scheduler_->Settle();
  EXPECT_EQ(Job("job").attempts_size(), 1);
  clock_.Advance(absl::Seconds(1));
  Beat("w1");
  scheduler_->CheckHeartbeats();
  scheduler_->Settle();
  job = Job("job");
  ASSERT_EQ(job.attempts_size(), 2);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.restart_after_unix_ms(), 0);

  // The second restart waits twice as long, also across a coordinator restart.
  ASSERT_TRUE(Fail(2, v1::FAILURE_KIND_INFRASTRUCTURE).ok());
  EXPECT_THAT(Job("job").reason(), HasSubstr("restart 2 of 2 in 2s"));
  scheduler_.reset();
  scheduler_ = *Scheduler::Create(store_.get(), &clock_, {});
  Register("w1");
  clock_.Advance(absl::Seconds(1));
  scheduler_->CheckHeartbeats();
  scheduler_->Settle();
  EXPECT_EQ(Job("job").attempts_size(), 2);
  clock_.Advance(absl::Seconds(1));
  scheduler_->CheckHeartbeats();
  scheduler_->Settle();
  ASSERT_EQ(Job("job").attempts_size(), 3);
  EXPECT_EQ(Job("job").restarts(), 2);

  // No restarts left.
  ASSERT_TRUE(Fail(3, v1::FAILURE_KIND_INFRASTRUCTURE).ok());
  job = Job("job");
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.restarts(), 2);
  EXPECT_THAT(job.reason(), HasSubstr("killed by signal 9 (no restarts left: max_restarts 2)"));
  clock_.Advance(absl::Minutes(5));
  scheduler_->CheckHeartbeats();
  scheduler_->Settle();
  EXPECT_EQ(Job("job").attempts_size(), 3);
}

TEST_F(RestartTest, AnAttemptThatTrainedRestartsAtOnceAndOnlyACrashLoopBacksOff) {
  AddJob(5);
  auto train = [&](int64_t generation, int64_t resumed, int64_t step) {
    v1::ReportProgressRequest progress;
    progress.set_worker_id("w1");
    progress.set_job_id("job");
    progress.set_generation(generation);
    progress.set_event(v1::RANK_EVENT_PROGRESS);
    progress.set_resumed_from_step(resumed);
    progress.mutable_progress()->set_step(step);
    ASSERT_TRUE(scheduler_->ReportProgress(progress).ok());
    scheduler_->Settle();
  };
  train(1, 0, 30);
  ASSERT_TRUE(Fail(1, v1::FAILURE_KIND_INFRASTRUCTURE).ok());
  ASSERT_EQ(Job("job").attempts_size(), 2);  // placed at once, the clock unmoved
  EXPECT_EQ(Job("job").restarts(), 1);
  // Attempts 2 and 3 die before their first step: 1 s, then 2 s.
  ASSERT_TRUE(Fail(2, v1::FAILURE_KIND_INFRASTRUCTURE).ok());
  EXPECT_THAT(Job("job").reason(), HasSubstr("restart 2 of 5 in 1s"));
  clock_.Advance(absl::Seconds(1));
  Beat("w1");
  scheduler_->CheckHeartbeats();
  scheduler_->Settle();
  ASSERT_TRUE(Fail(3, v1::FAILURE_KIND_INFRASTRUCTURE).ok());
  EXPECT_THAT(Job("job").reason(), HasSubstr("restart 3 of 5 in 2s"));
  clock_.Advance(absl::Seconds(2));
  Beat("w1");
  scheduler_->CheckHeartbeats();
  scheduler_->Settle();
  // Attempt 4 trains past its checkpoint: at once again.
  train(4, 20, 21);
  ASSERT_TRUE(Fail(4, v1::FAILURE_KIND_INFRASTRUCTURE).ok());
  ASSERT_EQ(Job("job").attempts_size(), 5);
  EXPECT_EQ(Job("job").restarts(), 4);
}

TEST_F(RestartTest, AUserErrorIsNotRetried) {
  AddJob(3);
  ASSERT_TRUE(Fail(1, v1::FAILURE_KIND_USER).ok());
  v1::JobStatus job = Job("job");
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.attempts(0).failure(), v1::FAILURE_KIND_USER);
  EXPECT_EQ(job.reason(), "rank 0 on worker w1 failed: the trainer was killed by signal 9");
}

TEST_F(RestartTest, ALostWorkerRestartsTheJobAndTheNextAttemptSaysWhereItResumed) {
  AddJob(1);
  Register("w2");
  clock_.Advance(absl::Seconds(20));  // w1 silent; w2 registers again in time
  Register("w2");
  scheduler_->CheckHeartbeats();
  scheduler_->Settle();
  v1::JobStatus job = Job("job");
  EXPECT_EQ(job.state(), v1::JOB_STATE_QUEUED);
  EXPECT_EQ(job.attempts(0).failure(), v1::FAILURE_KIND_INFRASTRUCTURE);
  clock_.Advance(absl::Seconds(1));
  scheduler_->CheckHeartbeats();
  scheduler_->Settle();
  job = Job("job");
  ASSERT_EQ(job.attempts_size(), 2);
  EXPECT_EQ(job.attempts(1).placements(0).worker_id(), "w2");
  v1::ReportProgressRequest start;
  start.set_worker_id("w2");
  start.set_job_id("job");
  start.set_generation(2);
  start.set_event(v1::RANK_EVENT_PROGRESS);
  start.mutable_progress()->set_step(40);
  start.set_resumed_from_step(40);
  ASSERT_TRUE(scheduler_->ReportProgress(start).ok());
  scheduler_->Settle();
  EXPECT_EQ(Job("job").attempts(1).resumed_from_step(), 40);
}

TEST_F(RestartTest, AfterACoordinatorRestartRanksTheWorkersStillRunCarryOn) {
  AddJob(1);
  v1::SlotStatus running;
  running.set_slot(0);
  running.set_job_id("job");
  running.set_generation(1);
  Beat("w1", {running});  // the assignment reached the worker
  scheduler_.reset();
  scheduler_ = *Scheduler::Create(store_.get(), &clock_, {});
  Register("w1");
  Beat("w1", {running});
  const v1::JobStatus job = Job("job");
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.attempts_size(), 1);
  EXPECT_TRUE(scheduler_->IsActiveAttempt("job", 1));
}

TEST_F(RestartTest, AnAssignmentLostInACoordinatorRestartIsRestartedNotStuck) {
  // Placed, then the coordinator is killed before the worker heard of it.
  AddJob(1);
  scheduler_.reset();
  scheduler_ = *Scheduler::Create(store_.get(), &clock_, {});
  EXPECT_EQ(Job("job").attempts(0).state(), v1::ATTEMPT_STATE_STARTING);
  Register("w1");
  Beat("w1");  // it runs nothing
  v1::JobStatus job = Job("job");
  EXPECT_EQ(job.state(), v1::JOB_STATE_QUEUED);
  EXPECT_EQ(job.attempts(0).state(), v1::ATTEMPT_STATE_FAILED);
  EXPECT_EQ(job.attempts(0).failure(), v1::FAILURE_KIND_INFRASTRUCTURE);
  EXPECT_THAT(job.attempts(0).error(), HasSubstr("registered again without its rank"));
  // The slot is free again and the restart is placed there after its backoff.
  clock_.Advance(absl::Seconds(1));
  scheduler_->CheckHeartbeats();
  scheduler_->Settle();
  job = Job("job");
  ASSERT_EQ(job.attempts_size(), 2);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Beat("w1").assignments_size(), 1);
}

TEST_F(RestartTest, ADrainedWorkersRanksMoveWithoutUsingUpRestarts) {
  AddJob(0);  // no restarts allowed: a drain is not the job's failure
  Register("w2");
  Beat("w1");  // the assignment reaches w1
  ASSERT_EQ(Job("job").attempts(0).placements(0).worker_id(), "w1");
  absl::StatusOr<v1::WorkerStatus> drained = scheduler_->DrainWorker("w1");
  scheduler_->Settle();
  ASSERT_TRUE(drained.ok());
  EXPECT_EQ(drained->state(), v1::WORKER_STATE_DRAINING);
  v1::JobStatus job = Job("job");
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.attempts(0).state(), v1::ATTEMPT_STATE_FAILED);
  EXPECT_THAT(job.attempts(0).error(), HasSubstr("worker w1 is being drained"));
  // w1's trainer is told to stop. Until it has (it checkpoints on the way out), the job
  // waits, although w2 is free.
  v1::SlotStatus running;
  running.set_slot(0);
  running.set_job_id("job");
  running.set_generation(1);
  EXPECT_EQ(Beat("w1", {running}).cancellations_size(), 1);
  EXPECT_EQ(Job("job").attempts_size(), 1);
  EXPECT_EQ(Job("job").reason(),
            "waiting for the ranks of attempt 1 to end (they may be writing a checkpoint)");
  EXPECT_TRUE(Report("w1", "job", 1, 0, v1::RANK_EVENT_CANCELLED).ok());
  job = Job("job");
  ASSERT_EQ(job.attempts_size(), 2);  // now placed, on w2
  EXPECT_EQ(job.attempts(1).placements(0).worker_id(), "w2");
  // It stays drained when its agent registers again.
  Register("w1");
  EXPECT_EQ(scheduler_->ListWorkers()[0].state(), v1::WORKER_STATE_DRAINING);
  // Removal: refused while it is alive (it would only register again); fine once lost.
  EXPECT_THAT(scheduler_->RemoveWorker("w1").message(), HasSubstr("w1 is not lost"));
  scheduler_->Settle();
  EXPECT_EQ(scheduler_->RemoveWorker("nobody").code(), absl::StatusCode::kNotFound);
  scheduler_->Settle();
  clock_.Advance(absl::Seconds(20));
  Register("w2");
  scheduler_->CheckHeartbeats();  // w1's agent stopped
  EXPECT_TRUE(scheduler_->RemoveWorker("w1").ok());
  scheduler_->Settle();
  EXPECT_EQ(scheduler_->ListWorkers().size(), 1u);
  scheduler_.reset();
  scheduler_ = *Scheduler::Create(store_.get(), &clock_, {});
  EXPECT_EQ(scheduler_->ListWorkers().size(), 1u);  // gone from the store too
}

TEST_F(SchedulerTest, CancelStopsRunningRanksAndFreesTheSlot) {
  Register("w1");
  Add("job");
  Add("next");
  v1::HeartbeatResponse first = Beat("w1");
  ASSERT_EQ(first.assignments_size(), 1);
  v1::SlotStatus running;
  running.set_slot(0);
  running.set_job_id("job");
  running.set_generation(1);
  absl::StatusOr<v1::JobStatus> cancelled = scheduler_->CancelJob("job", "not needed");
  scheduler_->Settle();
  ASSERT_TRUE(cancelled.ok());
  EXPECT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_THAT(cancelled->reason(), HasSubstr("cancelled by the user: not needed"));
  v1::HeartbeatResponse second = Beat("w1", {running});
  ASSERT_EQ(second.cancellations_size(), 1);
  EXPECT_EQ(Job("next").state(), v1::JOB_STATE_QUEUED);  // the trainer still runs
  EXPECT_TRUE(Report("w1", "job", 1, 0, v1::RANK_EVENT_CANCELLED).ok());
  EXPECT_EQ(Job("next").state(), v1::JOB_STATE_RUNNING);
  // Cancelling a finished job changes nothing.
  EXPECT_EQ(scheduler_->CancelJob("job", "again")->reason(), cancelled->reason());
  scheduler_->Settle();
  EXPECT_EQ(scheduler_->CancelJob("nope", "").status().code(), absl::StatusCode::kNotFound);
  scheduler_->Settle();
}

// --- profiling (`lathe profile`) ---

class ProfileTest : public SchedulerTest {
 protected:
  absl::StatusOr<v1::ProfileJobResponse> Profile(const std::string& job, int64_t rank,
                                                 bool all_ranks = false, int64_t steps = 0,
                                                 const Requester& requester = {}) {
    v1::ProfileJobRequest request;
    request.set_job_id(job);
    request.set_rank(rank);
    request.set_all_ranks(all_ranks);
    request.set_steps(steps);
    absl::StatusOr<v1::ProfileJobResponse> response = scheduler_->ProfileJob(request, requester);
    scheduler_->Settle();
    return response;
  }

  absl::Status Answer(const std::string& worker, const std::string& job, int64_t rank,
                      const std::string& capture, const std::vector<std::string>& files,
                      const std::string& error = "", int64_t generation = 1) {
    v1::ReportProfileRequest request;
    request.set_worker_id(worker);
    request.set_job_id(job);
    request.set_generation(generation);
    request.set_rank(rank);
    request.set_capture_id(capture);
    request.set_first_step(4);
    request.set_last_step(6);
    for (const std::string& name : files) {
      v1::ProfileFile* file = request.add_files();
      file->set_name(name);
      file->set_size(100);
    }
    request.set_error(error);
    absl::Status status = scheduler_->ReportProfile(request);
    scheduler_->Settle();
    return status;
  }

  // Two workers running the two ranks of `job`; returns the worker of each rank.
  std::vector<std::string> RunTwoRanks(const std::string& job) {
    Register("w1");
    Register("w2");
    Add(job, 2);
    Beat("w1");
    Beat("w2");
    const v1::Attempt attempt = Job(job).attempts(0);
    return {attempt.placements(0).worker_id(), attempt.placements(1).worker_id()};
  }
};

TEST_F(ProfileTest, AProfileIsOrderedToItsRanksAndIsDoneWhenEveryRankAnswered) {
  const std::vector<std::string> workers = RunTwoRanks("job");
  absl::StatusOr<v1::ProfileJobResponse> asked = Profile("job", 0, /*all_ranks=*/true);
  ASSERT_TRUE(asked.ok()) << asked.status();
  EXPECT_EQ(asked->generation(), 1);
  EXPECT_EQ(asked->capture().capture_id(), "prof-1");
  EXPECT_EQ(asked->capture().steps(), Scheduler::kDefaultProfileSteps);
  EXPECT_EQ(asked->capture().state(), v1::PROFILE_STATE_PENDING);
  EXPECT_THAT(asked->capture().ranks(), ::testing::ElementsAre(0, 1));

  // Each worker gets the order for its rank, once.
  for (int64_t rank : {0, 1}) {
    v1::HeartbeatResponse mail = Beat(workers[rank]);
    ASSERT_EQ(mail.profiles_size(), 1) << rank;
    EXPECT_EQ(mail.profiles(0).job_id(), "job");
    EXPECT_EQ(mail.profiles(0).generation(), 1);
    EXPECT_EQ(mail.profiles(0).rank(), rank);
    EXPECT_EQ(mail.profiles(0).capture_id(), "prof-1");
    EXPECT_EQ(mail.profiles(0).steps(), 3);
    EXPECT_EQ(Beat(workers[rank]).profiles_size(), 0);
  }

  ASSERT_TRUE(Answer(workers[0], "job", 0, "prof-1", {"trace.json"}).ok());
  EXPECT_EQ(Job("job").attempts(0).profiles(0).state(), v1::PROFILE_STATE_PENDING);
  // The answer resent (its response was lost) changes nothing.
  ASSERT_TRUE(Answer(workers[0], "job", 0, "prof-1", {"trace.json"}).ok());
  ASSERT_TRUE(Answer(workers[1], "job", 1, "prof-1", {"trace.json", "memory.json"}).ok());
  const v1::ProfileCapture done = Job("job").attempts(0).profiles(0);
  EXPECT_EQ(done.state(), v1::PROFILE_STATE_DONE);
  EXPECT_EQ(done.results_size(), 2);
  ASSERT_EQ(done.files_size(), 3);
  EXPECT_EQ(done.files(0).rank(), 0);
  EXPECT_EQ(done.files(2).rank(), 1);
  EXPECT_EQ(done.files(2).name(), "memory.json");
  EXPECT_GT(done.ended_unix_ms(), 0);
  EXPECT_EQ(done.requested_by(), "the user");
  // Once it ended, it takes no more.
  EXPECT_EQ(Answer(workers[1], "job", 1, "prof-1", {}, "late").code(),
            absl::StatusCode::kOk);  // rank 1 answered already: a resend
  EXPECT_EQ(scheduler_->CheckProfileWriter("job", 1, 1, "prof-1", workers[1]).code(),
            absl::StatusCode::kFailedPrecondition);

  // The next capture of one rank gets the next id; the capture survives a restart.
  asked = Profile("job", 1, false, 5);
  ASSERT_TRUE(asked.ok()) << asked.status();
  EXPECT_EQ(asked->capture().capture_id(), "prof-2");
  EXPECT_THAT(asked->capture().ranks(), ::testing::ElementsAre(1));
  EXPECT_EQ(Beat(workers[0]).profiles_size(), 0);
  EXPECT_EQ(Beat(workers[1]).profiles_size(), 1);
  scheduler_ = *Scheduler::Create(store_.get(), &clock_, {});
  absl::StatusOr<std::pair<int64_t, v1::ProfileCapture>> found =
      scheduler_->FindProfile("job", "prof-1");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->first, 1);
  EXPECT_EQ(found->second.files_size(), 3);
  EXPECT_EQ(scheduler_->FindProfile("job", "prof-9").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ProfileTest, BadRequestsAreRefusedWithOneLine) {
  Add("queued");
  EXPECT_THAT(Profile("queued", 0).status().message(),
              HasSubstr("job queued is queued, not running"));
  EXPECT_EQ(Profile("queued", 0).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Profile("nope", 0).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(scheduler_->CancelJob("queued", "").ok());  // it would take a slot
  EXPECT_THAT(Profile("queued", 0).status().message(), HasSubstr("is cancelled, not running"));
  RunTwoRanks("job");
  EXPECT_EQ(Profile("job", 0, false, 21).status().message(), "steps: must be in 1..20, got 21");
  EXPECT_EQ(Profile("job", 0, false, -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Profile("job", 2).status().message(),
            "rank: attempt 1 of job job has ranks 0 to 1, not 2");
  EXPECT_EQ(Profile("job", -1).status().code(), absl::StatusCode::kInvalidArgument);
  // Another client's job is not there for it.
  EXPECT_EQ(
      Profile("job", 0, false, 0, Requester{"mallory", false, "mallory (client)"}).status().code(),
      absl::StatusCode::kNotFound);
  ASSERT_TRUE(Profile("job", 0, false, 20).ok());
  absl::Status again = Profile("job", 1).status();
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.message(), HasSubstr("capture prof-1 is still pending"));
  EXPECT_TRUE(Job("job").attempts(0).profiles_size() == 1);  // nothing recorded
}

TEST_F(ProfileTest, OnlyTheRanksWorkerAnswersAndAFailedRankFailsTheCapture) {
  const std::vector<std::string> workers = RunTwoRanks("job");
  ASSERT_TRUE(Profile("job", 0, true).ok());
  const std::string other = workers[0] == "w1" ? "w2" : "w1";
  EXPECT_EQ(Answer(other, "job", 0, "prof-1", {}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Answer(workers[0], "job", 0, "prof-7", {}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Answer(workers[0], "job", 0, "prof-1", {}, "", 2).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Answer(workers[0], "nope", 0, "prof-1", {}).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(Answer(workers[1], "job", 1, "prof-1", {}, "the profiler could not start").ok());
  const v1::ProfileCapture failed = Job("job").attempts(0).profiles(0);
  EXPECT_EQ(failed.state(), v1::PROFILE_STATE_FAILED);
  EXPECT_EQ(failed.error(), "rank 1: the profiler could not start");
  // Rank 0's late answer finds it ended; the next capture may start.
  EXPECT_EQ(Answer(workers[0], "job", 0, "prof-1", {"trace.json"}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Profile("job", 0).ok());
}

TEST_F(ProfileTest, APendingCaptureFailsWhenItsAttemptEnds) {
  Register("w1");
  Add("job");
  Beat("w1");
  ASSERT_TRUE(Profile("job", 0).ok());
  ASSERT_TRUE(Report("w1", "job", 1, 0, v1::RANK_EVENT_FAILED, "killed by signal 9").ok());
  const v1::ProfileCapture failed = Job("job").attempts(0).profiles(0);
  EXPECT_EQ(failed.state(), v1::PROFILE_STATE_FAILED);
  EXPECT_THAT(failed.error(), HasSubstr("attempt 1 ended (failed) before every rank answered: "));
  EXPECT_EQ(Answer("w1", "job", 0, "prof-1", {"trace.json"}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Profile("job", 0).status().code(), absl::StatusCode::kFailedPrecondition);

  // Cancelling the job ends a pending capture the same way.
  Add("other");
  Beat("w1");
  ASSERT_TRUE(Profile("other", 0).ok());
  ASSERT_TRUE(scheduler_->CancelJob("other", "").ok());
  EXPECT_EQ(Job("other").attempts(0).profiles(0).state(), v1::PROFILE_STATE_FAILED);
  EXPECT_THAT(Job("other").attempts(0).profiles(0).error(),
              HasSubstr("attempt 1 ended (cancelled) before every rank answered"));
}

TEST_F(SchedulerTest, CancellingAQueuedJobNeverPlacesIt) {
  Add("job");
  ASSERT_EQ(scheduler_->CancelJob("job", "")->state(), v1::JOB_STATE_CANCELLED);
  scheduler_->Settle();
  Register("w1");
  EXPECT_EQ(Beat("w1").assignments_size(), 0);
}

TEST_F(SchedulerTest, StaleGenerationsAndForeignRanksAreRefused) {
  Register("w1");
  Register("w2");
  Add("job");
  EXPECT_EQ(Report("w1", "job", 2, 0, v1::RANK_EVENT_PROGRESS).code(),
            absl::StatusCode::kFailedPrecondition);
  std::string placed = Job("job").attempts(0).placements(0).worker_id();
  std::string other = placed == "w1" ? "w2" : "w1";
  EXPECT_EQ(Report(other, "job", 1, 0, v1::RANK_EVENT_PROGRESS).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Report(placed, "nope", 1, 0, v1::RANK_EVENT_PROGRESS).code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(scheduler_->IsActiveAttempt("job", 1));
  EXPECT_FALSE(scheduler_->IsActiveAttempt("job", 2));
}

TEST_F(SchedulerTest, AFailedRankFailsTheJobAndStopsTheOthers) {
  Register("w1");
  Register("w2");
  Add("job", 2);
  Beat("w1");
  Beat("w2");
  const v1::Attempt attempt = Job("job").attempts(0);
  const std::string failing = attempt.placements(0).worker_id();
  const std::string surviving = attempt.placements(1).worker_id();
  ASSERT_TRUE(
      Report(failing, "job", 1, 0, v1::RANK_EVENT_FAILED, "killed by signal 9 (SIGKILL)").ok());
  v1::JobStatus job = Job("job");
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.reason(),
              HasSubstr("rank 0 on worker " + failing + " failed: killed by signal 9 (SIGKILL)"));
  EXPECT_EQ(Beat(surviving).cancellations_size(), 1);
  // The surviving rank's late report is accepted and frees its slot.
  EXPECT_TRUE(Report(surviving, "job", 1, 1, v1::RANK_EVENT_CANCELLED).ok());
}

TEST_F(SchedulerTest, ProgressIsVisibleAndSuccessRecordsTheResult) {
  Register("w1");
  Add("job");
  std::vector<v1::JobStatus> seen;
  absl::StatusOr<uint64_t> watch = scheduler_->Watch(
      "job", [&](std::shared_ptr<const v1::JobStatus> status) { seen.push_back(*status); });
  ASSERT_TRUE(watch.ok()) << watch.status();
  ASSERT_EQ(seen.size(), 1u) << "the status at once";
  EXPECT_EQ(scheduler_->Watch("nope", [](std::shared_ptr<const v1::JobStatus>) {}).status().code(),
            absl::StatusCode::kNotFound);
  v1::ReportProgressRequest progress;
  progress.set_worker_id("w1");
  progress.set_job_id("job");
  progress.set_generation(1);
  progress.set_event(v1::RANK_EVENT_PROGRESS);
  progress.mutable_progress()->set_step(3);
  progress.mutable_progress()->set_loss(2.5);
  ASSERT_TRUE(scheduler_->ReportProgress(progress).ok());
  scheduler_->Settle();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen.back().attempts(0).progress().step(), 3);
  progress.set_event(v1::RANK_EVENT_SUCCEEDED);
  // A result is where the trainer writes it: in the job's output directory.
  progress.set_adapter_path("/etc/shadow");
  absl::Status elsewhere = scheduler_->ReportProgress(progress);
  scheduler_->Settle();
  EXPECT_EQ(elsewhere.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(elsewhere.message(), HasSubstr("adapter_path: /etc/shadow is not /runs/job/adapter"));
  EXPECT_EQ(Job("job").state(), v1::JOB_STATE_RUNNING);
  progress.set_adapter_path("/runs/job/adapter");
  ASSERT_TRUE(scheduler_->ReportProgress(progress).ok());
  scheduler_->Settle();
  v1::JobStatus job = Job("job");
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_DOUBLE_EQ(job.final_loss(), 2.5);
  EXPECT_EQ(job.adapter_path(), "/runs/job/adapter");
  EXPECT_EQ(seen.back().state(), v1::JOB_STATE_SUCCEEDED);
  const size_t calls = seen.size();
  scheduler_->Unwatch(*watch);
  Register("w2");
  Add("other");
  EXPECT_EQ(seen.size(), calls) << "called after Unwatch";
}

TEST_F(SchedulerTest, WhatWorkersSendIsBounded) {
  v1::RegisterWorkerRequest request;
  request.set_slots(1);
  for (const std::string& id : {std::string(), std::string(200, 'w'), std::string("a/b")}) {
    request.set_worker_id(id);
    EXPECT_THAT(scheduler_->RegisterWorker(request).status().message(),
                HasSubstr("worker_id: must be 1 to 128 characters"));
  }
  request.set_worker_id("w1");
  request.set_slots(64000);
  EXPECT_THAT(scheduler_->RegisterWorker(request).status().message(),
              HasSubstr("slots: must be 1 to 1024, got 64000"));
  request.set_slots(1);
  request.set_address(std::string(1000, 'x'));
  EXPECT_EQ(scheduler_->RegisterWorker(request).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(scheduler_->ListWorkers().empty());

  // A failed rank's error is kept, but not all of a huge one: its head and its tail.
  Register("w1");
  Add("job");
  v1::ReportProgressRequest failed;
  failed.set_worker_id("w1");
  failed.set_job_id("job");
  failed.set_generation(1);
  failed.set_event(v1::RANK_EVENT_FAILED);
  failed.set_error("cause " + std::string(1 << 20, '.') + " last line");
  ASSERT_TRUE(scheduler_->ReportProgress(failed).ok());
  scheduler_->Settle();
  const std::string error = Job("job").attempts(0).error();
  EXPECT_LT(error.size(), 20000u);
  EXPECT_THAT(error, HasSubstr("failed: cause"));
  EXPECT_THAT(error, HasSubstr("bytes left out"));
  EXPECT_THAT(error, ::testing::EndsWith(" last line"));
}

TEST_F(SchedulerTest, ARestartedSchedulerKeepsEveryJob) {
  Register("w1");
  Add("done");
  ASSERT_TRUE(Report("w1", "done", 1, 0, v1::RANK_EVENT_SUCCEEDED).ok());
  Add("queued", 4);
  scheduler_.reset();
  scheduler_ = *Scheduler::Create(store_.get(), &clock_, {});
  EXPECT_EQ(Job("done").state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(Job("queued").state(), v1::JOB_STATE_QUEUED);
  // The worker comes back without a session and must register again.
  EXPECT_EQ(scheduler_->Heartbeat(v1::HeartbeatRequest()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(SchedulerTest, MeasuredPeaksTeachTheCalibrationAndSurviveARestart) {
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  Register("w1", 2, 64 * kGiB);
  v1::JobStatus job = PlannedJob("job", 2, 10 * kGiB, 1.0, "k");
  bool existing = false;
  ASSERT_TRUE(scheduler_->AddJob(job, "", &existing).ok());
  scheduler_->Settle();
  EXPECT_EQ(Job("job").attempts(0).predicted_memory().total(), 10 * kGiB);
  // Every rank's peak counts; the largest is the attempt's.
  for (int64_t rank : {0, 1}) {
    v1::ReportProgressRequest progress;
    progress.set_worker_id("w1");
    progress.set_job_id("job");
    progress.set_generation(1);
    progress.set_rank(rank);
    progress.set_event(v1::RANK_EVENT_PROGRESS);
    progress.mutable_progress()->set_step(1);
    progress.mutable_progress()->mutable_memory()->set_total((rank == 0 ? 11 : 12) * kGiB);
    ASSERT_TRUE(scheduler_->ReportProgress(progress).ok());
    scheduler_->Settle();
  }
  EXPECT_EQ(Job("job").attempts(0).peak_memory().total(), 12 * kGiB);
  EXPECT_EQ(scheduler_->Calibration().Lookup("k").samples, 0) << "learned before the end";
  ASSERT_TRUE(Report("w1", "job", 1, 0, v1::RANK_EVENT_SUCCEEDED).ok());
  ASSERT_TRUE(Report("w1", "job", 1, 1, v1::RANK_EVENT_SUCCEEDED).ok());
  EXPECT_DOUBLE_EQ(scheduler_->Calibration().Lookup("k").factor, 1.2);

  // An attempt that never finished a step teaches nothing.
  job.set_job_id("early");
  ASSERT_TRUE(scheduler_->AddJob(job, "", &existing).ok());
  scheduler_->Settle();
  ASSERT_TRUE(Report("w1", "early", 1, 0, v1::RANK_EVENT_FAILED, "boom").ok());
  EXPECT_EQ(scheduler_->Calibration().Lookup("k").samples, 1);

  const v1::GetPlanHistoryResponse history = scheduler_->PlanHistory(10);
  ASSERT_EQ(history.attempts_size(), 1);
  EXPECT_EQ(history.attempts(0).job_id(), "job");
  EXPECT_EQ(history.attempts(0).measured().total(), 12 * kGiB);
  EXPECT_EQ(history.attempts(0).predicted().total(), 10 * kGiB);
  ASSERT_EQ(history.corrections_size(), 1);
  EXPECT_DOUBLE_EQ(history.corrections(0).factor(), 1.2);

  scheduler_.reset();
  scheduler_ = *Scheduler::Create(store_.get(), &clock_, {});
  EXPECT_DOUBLE_EQ(scheduler_->Calibration().Lookup("k").factor, 1.2);
  EXPECT_EQ(scheduler_->PlanHistory(10).attempts_size(), 1);
}

TEST_F(SchedulerTest, PlacementUsesTheCorrectedPeak) {
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  Register("w1", 1, 16 * kGiB);
  bool existing = false;
  ASSERT_TRUE(scheduler_->AddJob(PlannedJob("job", 1, 10 * kGiB, 2.0, "k"), "", &existing).ok());
  scheduler_->Settle();
  EXPECT_EQ(Job("job").state(), v1::JOB_STATE_QUEUED);
  EXPECT_THAT(Job("job").reason(), HasSubstr("needs 20.0 GiB per rank"));
}

TEST(RendezvousStoreTest, ScopesAreFencedByGeneration) {
  int64_t active = 1;
  RendezvousStore store([&](absl::string_view job, int64_t generation) {
    return job == "j" && generation == active;
  });
  ASSERT_TRUE(store.Set("j", 1, "rank0", "addr").ok());
  EXPECT_EQ(*store.Get("j", 1, "rank0"), "addr");
  EXPECT_EQ(store.Get("j", 1, "rank1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*store.Add("j", 1, "barrier", 1), 1);
  EXPECT_EQ(*store.Add("j", 1, "barrier", 2), 3);
  EXPECT_TRUE(store.Wait("j", 1, {"rank0"}, absl::Now()).ok());
  absl::Status timeout = store.Wait("j", 1, {"rank0", "rank1"}, absl::Now());
  EXPECT_EQ(timeout.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(timeout.message(), HasSubstr("rank1"));
  active = 2;
  EXPECT_EQ(store.Get("j", 1, "rank0").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store.Get("j", 2, "rank0").status().code(), absl::StatusCode::kNotFound);
}

// Issue #27: a scope's keys and bytes are capped, a replaced value counts once, and an ended
// attempt's values are freed without waiting for a call to its scope.
TEST(RendezvousStoreTest, ScopesAreBoundedAndFreedWhenTheirAttemptEnds) {
  bool active = true;
  RendezvousStore store([&](absl::string_view, int64_t) { return active; });
  const std::string mib(1 << 20, 'x');
  for (int i = 0; i < 63; ++i) ASSERT_TRUE(store.Set("j", 1, "big", mib).ok()) << i;
  int64_t held = store.BytesHeld();
  EXPECT_EQ(held, static_cast<int64_t>(3 + mib.size()));  // replaced, not added
  for (int i = 0; i < 62; ++i) ASSERT_TRUE(store.Set("j", 1, absl::StrCat("k", i), mib).ok());
  absl::Status over = store.Set("j", 1, "one-more", mib);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.message(), HasSubstr("job j would hold"));
  // Another attempt's scope has limits of its own; a counter past the key limit is refused.
  for (int64_t i = 0; i < RendezvousStore::kMaxKeysPerScope; ++i) {
    ASSERT_TRUE(store.Add("j", 2, absl::StrCat(i), 1).ok()) << i;
  }
  EXPECT_EQ(store.Add("j", 2, "extra", 1).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_GT(store.BytesHeld(), held);
  active = false;
  store.DropEnded();
  EXPECT_EQ(store.BytesHeld(), 0);
}

// --- JobManager: admission -----------------------------------------------------------

class JobManagerTest : public SchedulerTest {
 protected:
  void SetUp() override {
    SchedulerTest::SetUp();
    ModelConfig config = testing::TinyModelConfig();
    ASSERT_TRUE(WriteSyntheticModel(config, DType::kF32, 1, 0, dir_.Path("model")).ok());
    dir_.Write("train.jsonl", "{\"input_ids\": [1, 2, 3]}\n");
    spec_.name = "job";
    spec_.model.path = dir_.Path("model");
    spec_.data.train = dir_.Path("train.jsonl");
    spec_.data.seq_len = 32;
    spec_.train.steps = 2;
    spec_.output = dir_.Path("out");
  }

  absl::StatusOr<v1::SubmitJobResponse> Submit(const v1::JobSpec& spec,
                                               const std::string& request_id = "",
                                               JobManagerOptions options = {}) {
    JobManager manager(scheduler_.get(), options);
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    request.set_request_id(request_id);
    absl::StatusOr<v1::SubmitJobResponse> response = manager.Submit(request);
    scheduler_->Settle();
    return response;
  }

  void ExpectRefused(const v1::JobSpec& spec, const std::string& fragment,
                     JobManagerOptions options = {},
                     absl::StatusCode code = absl::StatusCode::kInvalidArgument) {
    absl::StatusOr<v1::SubmitJobResponse> response = Submit(spec, "", options);
    EXPECT_EQ(response.status().code(), code) << fragment;
    EXPECT_THAT(response.status().message(), HasSubstr(fragment));
    EXPECT_TRUE(scheduler_->ListJobs({}).jobs.empty()) << "a refused job was stored";
  }

  TempDir dir_;
  JobSpec spec_;
};

TEST_F(JobManagerTest, ARepeatedRequestIdReturnsTheSameJob) {
  absl::StatusOr<v1::SubmitJobResponse> first = Submit(JobSpecToProto(spec_), "req-1");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->existing());
  absl::StatusOr<v1::SubmitJobResponse> again = Submit(JobSpecToProto(spec_), "req-1");
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->existing());
  EXPECT_EQ(again->job_id(), first->job_id());
  EXPECT_EQ(scheduler_->ListJobs({}).jobs.size(), 1u);
  // The same id with another spec is a mistake, not a retry.
  spec_.output = dir_.Path("out2");
  absl::StatusOr<v1::SubmitJobResponse> other = Submit(JobSpecToProto(spec_), "req-1");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(other.status().message(), HasSubstr("request_id req-1 already created job " +
                                                  first->job_id() + " with another spec"));
  EXPECT_NE(Submit(JobSpecToProto(spec_), "req-2")->job_id(), first->job_id());
  EXPECT_EQ(scheduler_->ListJobs({}).jobs.size(), 2u);
}

TEST_F(JobManagerTest, AnOutputDirectoryBelongsToOneJobAtATime) {
  absl::StatusOr<v1::SubmitJobResponse> first = Submit(JobSpecToProto(spec_));
  ASSERT_TRUE(first.ok()) << first.status();
  v1::JobSpec same_output = JobSpecToProto(spec_);
  same_output.set_name("other");
  same_output.set_output(spec_.output + "/./");
  absl::StatusOr<v1::SubmitJobResponse> second = Submit(same_output);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(),
              HasSubstr("spec: output: " + spec_.output + " belongs to job " + first->job_id() +
                        " (queued); wait for it to end"));
  EXPECT_EQ(scheduler_->ListJobs({}).jobs.size(), 1u);
  // Once that job has ended (here: cancelled), the directory may be used again, and a new
  // job resumes from what the old one left there.
  ASSERT_TRUE(scheduler_->CancelJob(first->job_id(), "").ok());
  scheduler_->Settle();
  EXPECT_TRUE(Submit(same_output).ok());
}

TEST_F(JobManagerTest, BadSpecsAreRefusedNamingTheFieldAndNothingIsStored) {
  v1::JobSpec spec = JobSpecToProto(spec_);
  v1::JobSpec bad = spec;
  bad.mutable_model()->clear_path();
  ExpectRefused(bad, "spec: model.path");
  bad = spec;
  bad.set_method(static_cast<v1::Method>(42));
  ExpectRefused(bad, "spec: method");
  bad = spec;
  bad.mutable_resources()->set_ranks(0);
  ExpectRefused(bad, "spec: resources.ranks");
  bad = spec;
  bad.mutable_train()->set_lr(-1);
  ExpectRefused(bad, "spec: train.lr");
  bad = spec;
  bad.mutable_model()->set_path(dir_.Path("missing-model"));
  ExpectRefused(bad, "spec: model.path: ");
  // What the trainer would refuse: an output that holds a finished run.
  bad = spec;
  std::filesystem::create_directories(dir_.Path("done/adapter"));
  dir_.Write("done/adapter/adapter_config.json", "{}");
  bad.set_output(dir_.Path("done"));
  ExpectRefused(bad, "spec: output: " + dir_.Path("done") +
                         " already holds a finished run (adapter/adapter_config.json)");
  bad = spec;
  bad.mutable_data()->set_train("relative/train.jsonl");
  ExpectRefused(bad, "spec: data.train: must be an absolute path");
  bad = spec;
  bad.mutable_data()->set_train(dir_.Path("nope.jsonl"));
  ExpectRefused(bad, "spec: data.train: " + dir_.Path("nope.jsonl") + ": no such file");
  bad = spec;
  bad.mutable_data()->set_seq_len(65);
  ExpectRefused(bad, "spec: data.seq_len: 65 exceeds the model's max_position_embeddings 64");
  bad = spec;
  bad.set_output(dir_.path() + "/../../etc/out");
  ExpectRefused(bad, "spec: output: ", {{dir_.path()}});
  ExpectRefused(bad, "outside the allowed roots", {{dir_.path()}});
}

// Issue #27: another spelling of a running job's output (a link to its parent), and an
// output inside it or holding it, are refused; the stored spec names the canonical path.
TEST_F(JobManagerTest, AnOutputIsComparedCanonicallyAndNeverNests) {
  Register("w1");
  const std::string root = std::filesystem::canonical(dir_.path()).string();
  std::filesystem::create_directories(root + "/runs");
  std::filesystem::create_symlink(root + "/runs", root + "/alias");
  v1::JobSpec spec = JobSpecToProto(spec_);
  spec.set_output(root + "/runs/a");
  absl::StatusOr<v1::SubmitJobResponse> a = Submit(spec, "", {{root}});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(Job(a->job_id()).state(), v1::JOB_STATE_RUNNING);
  for (const auto& [output, problem] :
       {std::pair{root + "/alias/a", "belongs to job " + a->job_id() + " (running)"},
        std::pair{root + "/alias/a/inner", "lies inside " + root + "/runs/a, the output of job"},
        std::pair{root + "/runs", "holds " + root + "/runs/a, the output of job"}}) {
    spec.set_output(output);
    absl::StatusOr<v1::SubmitJobResponse> refused = Submit(spec, "", {{root}});
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << output;
    EXPECT_THAT(refused.status().message(), HasSubstr(problem));
  }
  spec.set_output(root + "/alias/b");  // a sibling is fine, stored canonical
  absl::StatusOr<v1::SubmitJobResponse> b = Submit(spec, "", {{root}});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->status().spec().output(), root + "/runs/b");
  EXPECT_EQ(b->status().spec().model().path(), std::filesystem::canonical(spec_.model.path));
}

// Issue #32: a hub id in model.path fails as a missing path; it says that only local
// directories are read, and how to get one.
// Issue #32: what the trainer would refuse a second after starting is refused at submit,
// before the queue: weights that are missing or malformed, and bad records among a data
// file's first lines (at most 1000 lines, 4 MiB).
TEST_F(JobManagerTest, BadWeightsAndDataAreRefusedAtSubmit) {
  const v1::JobSpec spec = JobSpecToProto(spec_);
  // A model directory with a config.json but no weights.
  std::filesystem::create_directories(dir_.Path("bare"));
  std::filesystem::copy_file(dir_.Path("model/config.json"), dir_.Path("bare/config.json"));
  v1::JobSpec bad = spec;
  bad.mutable_model()->set_path(dir_.Path("bare"));
  ExpectRefused(bad, "spec: model.path: " + dir_.Path("bare") +
                         ": neither model.safetensors nor model.safetensors.index.json exists");
  // Truncated weights: the header's offsets run past the end of the file.
  std::filesystem::create_directories(dir_.Path("cut"));
  std::filesystem::copy_file(dir_.Path("model/config.json"), dir_.Path("cut/config.json"));
  std::filesystem::copy_file(dir_.Path("model/model.safetensors"),
                             dir_.Path("cut/model.safetensors"));
  std::filesystem::resize_file(dir_.Path("cut/model.safetensors"),
                               std::filesystem::file_size(dir_.Path("cut/model.safetensors")) - 4);
  bad.mutable_model()->set_path(dir_.Path("cut"));
  ExpectRefused(bad, "spec: model.path: " + dir_.Path("cut/model.safetensors"), {},
                absl::StatusCode::kInvalidArgument);
  // An init adapter without its files.
  std::filesystem::create_directories(dir_.Path("adapter"));
  bad = spec;
  bad.mutable_lora()->set_init_from(dir_.Path("adapter"));
  ExpectRefused(bad, "spec: lora.init_from: " + dir_.Path("adapter/adapter_config.json"));
  // A token id outside the vocabulary (64) on line 3 of the training file.
  dir_.Write("bad.jsonl", "{\"input_ids\": [1, 2]}\n\n{\"input_ids\": [1, 2, 3, 70]}\n");
  bad = spec;
  bad.mutable_data()->set_train(dir_.Path("bad.jsonl"));
  ExpectRefused(bad, "spec: data.train: " + dir_.Path("bad.jsonl") +
                         ": line 3: input_ids[3]: token id 70 is outside the vocabulary "
                         "(vocab_size 64)");
  // A broken line in the eval file.
  dir_.Write("eval.jsonl", "{\"input_ids\": [1, 2\n");
  bad = spec;
  bad.mutable_data()->set_eval(dir_.Path("eval.jsonl"));
  ExpectRefused(bad, "spec: data.eval: " + dir_.Path("eval.jsonl") + ": line 1: not valid JSON");
  // Beyond the bound the trainer checks, when the job starts.
  std::string lines;
  for (int i = 0; i < 1000; ++i) lines += "{\"input_ids\": [1, 2]}\n";
  dir_.Write("late.jsonl", lines + "{\"input_ids\": [70]}\n");
  v1::JobSpec late = spec;
  late.mutable_data()->set_train(dir_.Path("late.jsonl"));
  EXPECT_TRUE(Submit(late).ok());
}

TEST_F(JobManagerTest, AMissingModelDirectorySaysModelsAreLocal) {
  v1::JobSpec spec = JobSpecToProto(spec_);
  spec.mutable_model()->set_path(dir_.path() + "/Qwen/Qwen2.5-0.5B");
  ExpectRefused(spec, "spec: model.path: " + std::filesystem::canonical(dir_.path()).string() +
                          "/Qwen/Qwen2.5-0.5B does not exist: a model is read from a local "
                          "directory (a Hugging Face hub model must be downloaded first");
}

// Issue #32: a plan whose ranks outnumber the registered slots says the job would wait.
TEST_F(JobManagerTest, APlanWarnsWhenTooFewSlotsAreRegistered) {
  JobManager manager(scheduler_.get(), {});
  v1::PlanJobRequest request;
  *request.mutable_spec() = JobSpecToProto(spec_);
  request.mutable_spec()->mutable_resources()->set_ranks(2);
  Register("w1");
  absl::StatusOr<v1::PlanJobResponse> plan = manager.Plan(request);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->warnings_size(), 1);
  EXPECT_EQ(plan->warnings(0),
            "needs 2 cpu slots at once; 1 registered: it would wait in the queue until more "
            "workers register");
  Register("w2");
  EXPECT_EQ(manager.Plan(request)->warnings_size(), 0);
}

TEST_F(JobManagerTest, WhatTheEngineCannotRunIsRefusedAtTheDoor) {
  const v1::JobSpec spec = JobSpecToProto(spec_);
  v1::JobSpec sharded_mezo = spec;
  sharded_mezo.set_method(v1::METHOD_MEZO);
  sharded_mezo.mutable_strategy()->set_zero_stage(1);
  ExpectRefused(sharded_mezo, "spec: strategy.zero_stage: 1 with method mezo", {},
                absl::StatusCode::kUnimplemented);
}

TEST_F(JobManagerTest, ThePlanIsMadeOnceHere) {
  spec_.train.global_batch = 8;
  testing::FixStrategy(&spec_.strategy);
  spec_.strategy.activation_checkpointing = true;
  absl::StatusOr<v1::SubmitJobResponse> response = Submit(JobSpecToProto(spec_));
  ASSERT_TRUE(response.ok()) << response.status();
  const v1::Plan& plan = response->status().plan();
  EXPECT_EQ(plan.strategy().micro_batch(),
            8);  // auto: 8 sequences of 32 tokens fit in one micro-batch
  EXPECT_EQ(plan.gradient_accumulation(), 1);
  EXPECT_TRUE(plan.strategy().activation_checkpointing());
  EXPECT_EQ(plan.total_steps(), 2);
  // The stored spec has every default filled in.
  EXPECT_TRUE(response->status().spec().train().has_lr());
}

TEST_F(JobManagerTest, WhatFitsNowhereIsRefusedWithNothingStored) {
  v1::JobSpec spec = JobSpecToProto(spec_);
  spec.mutable_resources()->set_memory_per_rank_bytes(16 << 10);
  ExpectRefused(spec, "spec: nothing fits: the smallest configuration", {},
                absl::StatusCode::kResourceExhausted);
  ExpectRefused(spec, "more than 14.4 KiB (16.0 KiB less 10% headroom)", {},
                absl::StatusCode::kResourceExhausted);
}

TEST_F(JobManagerTest, PlansLearnFromTheMeasuredPeaksOfEarlierAttempts) {
  Register("w1", 1, uint64_t{64} << 30);
  absl::StatusOr<v1::SubmitJobResponse> first = Submit(JobSpecToProto(spec_));
  ASSERT_TRUE(first.ok()) << first.status();
  const v1::Plan& plan = first->status().plan();
  EXPECT_EQ(plan.memory_correction(), 1.0);
  EXPECT_THAT(plan.calibration_key(), HasSubstr("| 1 x cpu"));
  // It ran a step and measured 10% more than predicted.
  v1::ReportProgressRequest done;
  done.set_worker_id("w1");
  done.set_job_id(first->job_id());
  done.set_generation(1);
  done.set_event(v1::RANK_EVENT_SUCCEEDED);
  done.mutable_progress()->set_step(2);
  done.mutable_progress()->mutable_memory()->set_total(plan.predicted_memory().total() * 11 / 10);
  ASSERT_TRUE(scheduler_->ReportProgress(done).ok());
  scheduler_->Settle();

  spec_.output = dir_.Path("out2");
  absl::StatusOr<v1::SubmitJobResponse> second = Submit(JobSpecToProto(spec_));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NEAR(second->status().plan().memory_correction(), 1.1, 1e-6);
  EXPECT_THAT(second->status().plan().explanation(), HasSubstr("learned from 1 measured attempt"));
  JobManager manager(scheduler_.get(), {});
  v1::GetPlanHistoryRequest request;
  absl::StatusOr<v1::GetPlanHistoryResponse> history = manager.PlanHistory(request);
  ASSERT_TRUE(history.ok());
  EXPECT_EQ(history->attempts_size(), 1);
  request.set_limit(-1);
  EXPECT_EQ(manager.PlanHistory(request).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(JobManagerTest, AGpuJobIsPlannedForTheRegisteredPool) {
  v1::RegisterWorkerRequest worker;
  worker.set_worker_id("gpu");
  worker.set_device(v1::DEVICE_CUDA);
  worker.set_slots(1);
  v1::DeviceInfo* device = worker.add_devices();
  device->set_name("NVIDIA H200");
  device->set_memory_bytes(141000000000);
  ASSERT_TRUE(scheduler_->RegisterWorker(worker).ok());
  scheduler_->Settle();
  spec_.resources.device = DeviceKind::kCuda;
  JobManager manager(scheduler_.get(), {});
  v1::PlanJobRequest request;
  *request.mutable_spec() = JobSpecToProto(spec_);
  absl::StatusOr<v1::PlanJobResponse> plan = manager.Plan(request);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->memory_per_rank(), 141000000000u);
  EXPECT_THAT(plan->plan().calibration_key(), HasSubstr("| 1 x h200"));
}

// Issue #32: `lathe plan --local` planned an 8-rank CUDA full fine-tune that the coordinator
// then refused. Both now take the one capability list and the one planning call
// (planner/plan_spec.h): the coordinator admits and plans the spec as the CLI plans it here.
TEST_F(JobManagerTest, TheCoordinatorPlansWhatPlanLocalPlans) {
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  v1::RegisterWorkerRequest worker;
  worker.set_worker_id("gpus");
  worker.set_device(v1::DEVICE_CUDA);
  worker.set_slots(8);
  for (int i = 0; i < 8; ++i) {
    v1::DeviceInfo* device = worker.add_devices();
    device->set_index(i);
    device->set_name("NVIDIA H100 80GB HBM3");
    device->set_memory_bytes(80 * kGiB);
  }
  ASSERT_TRUE(scheduler_->RegisterWorker(worker).ok());
  scheduler_->Settle();
  spec_.method = Method::kFull;
  spec_.resources.device = DeviceKind::kCuda;
  spec_.resources.ranks = 8;
  spec_.train.global_batch = 16;
  JobManager manager(scheduler_.get(), {});
  v1::PlanJobRequest request;
  *request.mutable_spec() = JobSpecToProto(spec_);
  absl::StatusOr<v1::PlanJobResponse> coordinator = manager.Plan(request);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();

  absl::StatusOr<DeviceRates> rates = DefaultRates("h100");  // as `lathe plan --local --gpu h100`
  ASSERT_TRUE(rates.ok());
  rates->memory_bytes = 80 * kGiB;
  absl::StatusOr<PlanOptions> options = PlanOptionsFor(spec_, "h100", *rates);
  ASSERT_TRUE(options.ok()) << options.status();
  absl::StatusOr<PlanResult> local = PlanSpec(spec_, *options);
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_TRUE(CheckEngineSupports(spec_).ok());
  const v1::Plan& admitted = coordinator->plan();
  EXPECT_EQ(admitted.ranks(), 8);
  EXPECT_EQ(admitted.strategy().zero_stage(), local->plan.strategy.zero_stage);
  EXPECT_EQ(admitted.strategy().offload_optimizer(), local->plan.strategy.offload_optimizer);
  EXPECT_EQ(admitted.strategy().activation_checkpointing(),
            local->plan.strategy.activation_checkpointing);
  EXPECT_EQ(admitted.strategy().micro_batch(), local->plan.strategy.micro_batch);
  EXPECT_EQ(admitted.explanation(), local->plan.explanation);
  // And it is admitted, not refused as "8 ranks on cuda are not supported".
  absl::StatusOr<v1::SubmitJobResponse> submitted = Submit(JobSpecToProto(spec_));
  EXPECT_TRUE(submitted.ok()) << submitted.status();
}

TEST_F(JobManagerTest, AllowedRootsAdmitPathsInside) {
  EXPECT_TRUE(Submit(JobSpecToProto(spec_), "", {{dir_.path() + "/"}}).ok());
}

TEST_F(JobManagerTest, ASymlinkOutOfAnAllowedRootIsOutside) {
  // The root holds the model and the data; "escape" inside it points elsewhere.
  TempDir outside;
  std::filesystem::create_symlink(outside.path(), dir_.Path("escape"));
  v1::JobSpec spec = JobSpecToProto(spec_);
  spec.set_output(dir_.Path("escape/run"));
  ExpectRefused(spec, "spec: output: " + dir_.Path("escape/run") + " is outside the allowed roots",
                {{dir_.path()}});
  // A root reached through a link is fine: both sides are resolved.
  std::filesystem::create_symlink(dir_.path(), outside.Path("root-link"));
  spec = JobSpecToProto(spec_);
  spec.set_output(dir_.Path("run"));
  EXPECT_TRUE(Submit(spec, "", {{outside.Path("root-link")}}).ok());
}

TEST_F(JobManagerTest, AListPageStaysUnderTheMessageLimit) {
  // Three jobs of 1.5 MiB each (a coordinator's store may hold what no check bounded then).
  for (const char* id : {"a", "b", "c"}) {
    v1::JobStatus job;
    job.set_job_id(id);
    job.mutable_spec()->set_name(std::string(3 << 19, 'x'));
    job.mutable_spec()->set_output(std::string("/runs/") + id);
    bool existing = false;
    ASSERT_TRUE(scheduler_->AddJob(job, "", &existing).ok());
    scheduler_->Settle();
  }
  JobManager manager(scheduler_.get(), {});
  v1::ListJobsRequest request;
  std::vector<std::string> seen;
  for (;;) {
    absl::StatusOr<v1::ListJobsResponse> page = manager.List(request);
    ASSERT_TRUE(page.ok());
    EXPECT_EQ(page->jobs_size(), 1);
    EXPECT_LT(page->ByteSizeLong(), size_t{4} << 20);
    for (const v1::JobStatus& j : page->jobs()) seen.push_back(j.job_id());
    if (page->next_page_token().empty()) break;
    request.set_page_token(page->next_page_token());
  }
  EXPECT_EQ(seen, (std::vector<std::string>{"c", "b", "a"}));
}

TEST_F(JobManagerTest, ListPagesNewestFirst) {
  for (int i = 0; i < 5; ++i) {
    spec_.output = dir_.Path(absl::StrCat("out", i));
    ASSERT_TRUE(Submit(JobSpecToProto(spec_)).ok());
  }
  JobManager manager(scheduler_.get(), {});
  v1::ListJobsRequest request;
  request.set_page_size(2);
  std::vector<std::string> seen;
  for (;;) {
    absl::StatusOr<v1::ListJobsResponse> page = manager.List(request);
    ASSERT_TRUE(page.ok());
    for (const v1::JobStatus& j : page->jobs()) seen.push_back(j.job_id());
    if (page->next_page_token().empty()) break;
    request.set_page_token(page->next_page_token());
  }
  std::vector<std::string> all;
  for (const v1::JobStatus& j : scheduler_->ListJobs({}).jobs) all.push_back(j.job_id());
  EXPECT_EQ(seen, all);
  EXPECT_EQ(seen.size(), 5u);
  request.set_page_token("bogus");
  EXPECT_EQ(manager.List(request).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SchedulerTest, ListJobsFiltersByStateNameAndTimeAndPagesByKey) {
  Register("w1");
  // Submitted one second apart: a0 (runs on w1), b1, a2, b3, a4, the last four queued.
  for (int i = 0; i < 5; ++i) {
    Add(absl::StrCat(i % 2 == 0 ? "a" : "b", i));
    clock_.Advance(absl::Seconds(1));
  }
  ASSERT_TRUE(scheduler_->CancelJob("b3", "").ok());
  auto ids = [&](const JobQuery& query) {
    std::vector<std::string> out;
    for (const v1::JobStatus& j : scheduler_->ListJobs(query).jobs) out.push_back(j.job_id());
    return out;
  };
  JobQuery query;
  EXPECT_EQ(ids(query), (std::vector<std::string>{"a4", "b3", "a2", "b1", "a0"}));
  query.states = {v1::JOB_STATE_QUEUED, v1::JOB_STATE_RUNNING};
  EXPECT_EQ(ids(query), (std::vector<std::string>{"a4", "a2", "b1", "a0"}));
  query.name = "a2";  // Add names a job after its id
  EXPECT_EQ(ids(query), (std::vector<std::string>{"a2"}));
  query.name = "";
  query.states = {};
  query.since_unix_ms = Job("a2").submitted_unix_ms();
  EXPECT_EQ(ids(query), (std::vector<std::string>{"a4", "b3", "a2"}));
  // Pages of two, each starting after the previous page's last job.
  query = JobQuery();
  query.limit = 2;
  std::vector<std::string> all;
  for (int page = 0; page < 5; ++page) {
    JobPage result = scheduler_->ListJobs(query);
    for (const v1::JobStatus& j : result.jobs) all.push_back(j.job_id());
    if (result.next_before < 0) break;
    query.before_sequence = result.next_before;
  }
  EXPECT_EQ(all, (std::vector<std::string>{"a4", "b3", "a2", "b1", "a0"}));
}

}  // namespace
}  // namespace lathe
