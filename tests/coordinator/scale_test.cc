// The coordinator under a registration burst while its scheduling loop is stuck in the store
// (issue #13): a real CoordinatorServer on 127.0.0.1 with an injected store whose writes
// wait at a gate, hundreds of queued jobs, and 50 workers registering at once and
// heartbeating over real gRPC streams. While the scheduling loop cannot finish (its pass's
// placements wait for the store for longer than the heartbeat timeout), every heartbeat is
// still answered and no worker is declared lost; no assignment leaves before its placement
// is durable; once the store writes again every free slot is filled and no job failed.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/proto/job_spec_proto.h"
#include "coordinator/server/coordinator_server.h"
#include "coordinator/store/store.h"
#include "gtest/gtest.h"
#include "lathe/v1/coordinator.grpc.pb.h"
#include "tests/testing/forwarding_store.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tiny_model.h"
#include "worker/tools/synthetic.h"

namespace lathe {
namespace {

constexpr int kJobs = 300;
constexpr int kWorkers = 50;
constexpr int kSlots = 2;
constexpr absl::Duration kInterval = absl::Milliseconds(200);
constexpr absl::Duration kTimeout = absl::Milliseconds(1500);

// A memory store whose batch writes wait while the gate is closed.
class GatedStore : public testing::ForwardingStore {
 public:
  using ForwardingStore::ForwardingStore;
  absl::Status Write(const StoreBatch& batch) override {
    {
      absl::MutexLock lock(&mu_);
      if (closed_) ++blocked_;
      mu_.Await(absl::Condition(
          +[](bool* closed) { return !*closed; }, &closed_));
    }
    return ForwardingStore::Write(batch);
  }

  void SetClosed(bool closed) {
    absl::MutexLock lock(&mu_);
    closed_ = closed;
  }
  // Writes that waited (or wait) at the closed gate.
  int blocked() {
    absl::MutexLock lock(&mu_);
    return blocked_;
  }

 private:
  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  int blocked_ ABSL_GUARDED_BY(mu_) = 0;
};

// One simulated worker: registers, then heartbeats every kInterval on one stream, listing
// the ranks it was given, until told to stop.
struct SimWorker {
  std::string id;
  std::atomic<int> answered{0};
  std::atomic<int> answered_while_stuck{0};
  std::atomic<int> assignments{0};
  std::atomic<int> assigned_while_stuck{0};
  std::string error;  // set when the stream ended badly

  void Run(v1::WorkerService::Stub* stub, GatedStore* store, const std::atomic<bool>* stuck,
           const std::atomic<bool>* stop) {
    v1::RegisterWorkerRequest registration;
    registration.set_worker_id(id);
    registration.set_slots(kSlots);
    registration.set_host_memory_bytes(uint64_t{64} << 30);
    v1::RegisterWorkerResponse registered;
    {
      grpc::ClientContext context;
      grpc::Status status = stub->RegisterWorker(&context, registration, &registered);
      if (!status.ok()) {
        error = "register: " + status.error_message();
        return;
      }
    }
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    auto stream = stub->Heartbeat(&context);
    v1::HeartbeatRequest beat;
    beat.set_worker_id(id);
    beat.set_session_id(registered.session_id());
    for (int64_t sequence = 1; !stop->load(); ++sequence) {
      beat.set_sequence(sequence);
      if (!stream->Write(beat)) break;
      // Pushed assignments may come first; the answer echoes the sequence.
      v1::HeartbeatResponse response;
      while (stream->Read(&response)) {
        for (const v1::Assignment& a : response.assignments()) {
          v1::SlotStatus* slot = beat.add_slots();
          slot->set_slot(a.slot());
          slot->set_job_id(a.job_id());
          slot->set_generation(a.generation());
          ++assignments;
          if (stuck->load()) ++assigned_while_stuck;
        }
        if (response.in_reply_to() == sequence) break;
      }
      if (response.in_reply_to() != sequence) break;
      ++answered;
      if (stuck->load() && store->blocked() > 0) ++answered_while_stuck;
      absl::SleepFor(kInterval);
    }
    stream->WritesDone();
    grpc::Status status = stream->Finish();
    if (!status.ok() && !stop->load()) error = "heartbeat: " + status.error_message();
  }
};

TEST(CoordinatorScaleTest, HeartbeatsAreAnsweredAndNobodyIsLostWhileTheSchedulerIsStuck) {
  testing::TempDir dir;
  ASSERT_TRUE(
      WriteSyntheticModel(testing::TinyModelConfig(), DType::kF32, 1, 0, dir.Path("model")).ok());
  dir.Write("train.jsonl", "{\"input_ids\": [1, 2, 3]}\n");

  CoordinatorConfig config;
  config.listen = "127.0.0.1:0";
  config.insecure_no_auth = true;
  config.heartbeat_interval = kInterval;
  config.heartbeat_timeout = kTimeout;
  config.allowed_roots = {dir.path()};
  std::unique_ptr<Store> memory = NewMemoryStore();  // outlives the server
  auto owned_store = std::make_unique<GatedStore>(memory.get());
  GatedStore* store = owned_store.get();
  absl::StatusOr<std::unique_ptr<CoordinatorServer>> server =
      CoordinatorServer::Start(config, std::move(owned_store));
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->port()),
                                     grpc::InsecureChannelCredentials());
  auto jobs = v1::JobService::NewStub(channel);

  JobSpec spec;
  spec.model.path = dir.Path("model");
  spec.data.train = dir.Path("train.jsonl");
  spec.data.seq_len = 32;
  spec.train.steps = 2;
  for (int i = 0; i < kJobs; ++i) {
    spec.name = absl::StrCat("job-", i);
    spec.output = dir.Path(absl::StrCat("out-", i));
    v1::SubmitJobRequest request;
    *request.mutable_spec() = JobSpecToProto(spec);
    v1::SubmitJobResponse response;
    grpc::ClientContext context;
    grpc::Status status = jobs->SubmitJob(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }

  // The store stops writing; the workers register in one burst and heartbeat.
  store->SetClosed(true);
  std::atomic<bool> stuck{true}, stop{false};
  std::vector<std::unique_ptr<SimWorker>> workers;
  std::vector<std::thread> threads;
  // Each worker on a connection of its own, as real workers are.
  std::vector<std::unique_ptr<v1::WorkerService::Stub>> stubs;
  for (int i = 0; i < kWorkers; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("lathe.test_worker", i);
    stubs.push_back(v1::WorkerService::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", (*server)->port()), grpc::InsecureChannelCredentials(), args)));
    workers.push_back(std::make_unique<SimWorker>());
    workers.back()->id = absl::StrCat("w", i);
  }
  for (int i = 0; i < kWorkers; ++i) {
    threads.emplace_back([&, i] { workers[i]->Run(stubs[i].get(), store, &stuck, &stop); });
  }

  // Until every worker has had heartbeats answered for twice the heartbeat timeout while the
  // scheduling loop waits in the store.
  const int wanted = static_cast<int>(2 * (kTimeout / kInterval)) + 1;
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  auto all_answered = [&] {
    for (const auto& w : workers) {
      if (w->answered_while_stuck.load() < wanted || !w->error.empty()) return false;
    }
    return true;
  };
  while (!all_answered() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_GE(store->blocked(), 1) << "the scheduling loop never reached the store";
  for (const auto& w : workers) {
    EXPECT_EQ(w->error, "") << w->id;
    EXPECT_GE(w->answered_while_stuck.load(), wanted) << w->id;
  }
  // Nobody is lost, and nothing was delivered before it was durable.
  auto worker_stub = v1::WorkerService::NewStub(channel);
  {
    v1::ListWorkersResponse listed;
    grpc::ClientContext context;
    ASSERT_TRUE(worker_stub->ListWorkers(&context, v1::ListWorkersRequest(), &listed).ok());
    EXPECT_EQ(listed.workers_size(), kWorkers);
    for (const v1::WorkerStatus& w : listed.workers()) {
      EXPECT_EQ(w.state(), v1::WORKER_STATE_READY) << w.worker_id();
    }
  }
  for (const auto& w : workers) EXPECT_EQ(w->assigned_while_stuck.load(), 0) << w->id;

  // The store writes again: every slot gets a rank.
  stuck = false;
  store->SetClosed(false);
  auto all_assigned = [&] {
    for (const auto& w : workers) {
      if (w->assignments.load() < kSlots) return false;
    }
    return true;
  };
  while (!all_assigned() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(50));
  for (const auto& w : workers) EXPECT_EQ(w->assignments.load(), kSlots) << w->id;

  stop = true;
  for (std::thread& t : threads) t.join();
  v1::ListJobsRequest failed;
  failed.add_states(v1::JOB_STATE_FAILED);
  v1::ListJobsResponse listed;
  grpc::ClientContext context;
  ASSERT_TRUE(jobs->ListJobs(&context, failed, &listed).ok());
  EXPECT_EQ(listed.jobs_size(), 0);
  (*server)->Shutdown();
}

}  // namespace
}  // namespace lathe
