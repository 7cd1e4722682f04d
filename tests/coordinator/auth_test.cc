// Every RPC of the coordinator against every kind of caller (issue #12, the auth matrix):
// the three services over gRPC on 127.0.0.1 with an Authenticator, called with no token, an
// unknown one and each role's; a worker token against another worker's ranks (issue #27).
// And the token file's parser.
#include "common/rpc/auth.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "coordinator/api/services.h"
#include "coordinator/rendezvous/rendezvous_service.h"
#include "coordinator/rendezvous/rendezvous_store.h"
#include "coordinator/scheduler/job_manager.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/store/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lathe/v1/coordinator.grpc.pb.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kTokens[] = R"(# role name token
client alice alice-secret-0123456789
worker w1    w1-secret-0123456789
worker pool  pool-secret-0123456789 w2,pool-*

admin  root  root-secret-0123456789
)";

class AuthMatrixTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<Authenticator> auth = Authenticator::FromText(kTokens, "tokens");
    ASSERT_TRUE(auth.ok()) << auth.status();
    auth_ = std::make_unique<Authenticator>(*std::move(auth));
    store_ = NewMemoryStore();
    scheduler_ = *Scheduler::Create(store_.get(), &clock_, {});
    jobs_ = std::make_unique<JobManager>(scheduler_.get(), JobManagerOptions{});
    job_service_ = std::make_unique<JobServiceImpl>(jobs_.get(), scheduler_.get(), auth_.get());
    worker_service_ = std::make_unique<WorkerServiceImpl>(scheduler_.get(), auth_.get());
    rendezvous_service_ = std::make_unique<RendezvousServiceImpl>(
        &rendezvous_, auth_.get(), [this](absl::string_view job, int64_t generation) {
          return scheduler_->AttemptWorkers(job, generation);
        });
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(job_service_.get());
    builder.RegisterService(worker_service_.get());
    builder.RegisterService(rendezvous_service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    auto channel =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    jobs_stub_ = v1::JobService::NewStub(channel);
    workers_stub_ = v1::WorkerService::NewStub(channel);
    rendezvous_stub_ = v1::RendezvousService::NewStub(channel);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

  enum Kind { kClient, kWorker, kAdmin };  // whose call it is
  struct Rpc {
    std::string name;
    Kind kind;
    std::function<grpc::Status(grpc::ClientContext*)> call;
  };

  // One call of every method, with requests the domain refuses or answers quickly.
  std::vector<Rpc> EveryRpc() {
    v1::JobService::Stub* jobs = jobs_stub_.get();
    v1::WorkerService::Stub* workers = workers_stub_.get();
    v1::RendezvousService::Stub* rendezvous = rendezvous_stub_.get();
    return {
        {"SubmitJob", kClient,
         [jobs](grpc::ClientContext* c) {
           v1::SubmitJobResponse r;
           return jobs->SubmitJob(c, v1::SubmitJobRequest(), &r);
         }},
        {"PlanJob", kClient,
         [jobs](grpc::ClientContext* c) {
           v1::PlanJobResponse r;
           return jobs->PlanJob(c, v1::PlanJobRequest(), &r);
         }},
        {"GetPlanHistory", kClient,
         [jobs](grpc::ClientContext* c) {
           v1::GetPlanHistoryResponse r;
           return jobs->GetPlanHistory(c, v1::GetPlanHistoryRequest(), &r);
         }},
        {"GetJob", kClient,
         [jobs](grpc::ClientContext* c) {
           v1::JobStatus r;
           return jobs->GetJob(c, v1::GetJobRequest(), &r);
         }},
        {"ListJobs", kClient,
         [jobs](grpc::ClientContext* c) {
           v1::ListJobsResponse r;
           return jobs->ListJobs(c, v1::ListJobsRequest(), &r);
         }},
        {"CancelJob", kClient,
         [jobs](grpc::ClientContext* c) {
           v1::JobStatus r;
           return jobs->CancelJob(c, v1::CancelJobRequest(), &r);
         }},
        {"WatchJob", kClient,
         [jobs](grpc::ClientContext* c) {
           auto reader = jobs->WatchJob(c, v1::WatchJobRequest());
           v1::JobStatus r;
           while (reader->Read(&r)) {
           }
           return reader->Finish();
         }},
        {"GetLogs", kClient,
         [jobs](grpc::ClientContext* c) {
           v1::GetLogsResponse r;
           return jobs->GetLogs(c, v1::GetLogsRequest(), &r);
         }},
        {"ProfileJob", kClient,
         [jobs](grpc::ClientContext* c) {
           v1::ProfileJobResponse r;
           return jobs->ProfileJob(c, v1::ProfileJobRequest(), &r);
         }},
        {"GetProfileFile", kClient,
         [jobs](grpc::ClientContext* c) {
           v1::GetProfileFileResponse r;
           return jobs->GetProfileFile(c, v1::GetProfileFileRequest(), &r);
         }},
        {"UploadProfile", kWorker,
         [workers](grpc::ClientContext* c) {
           v1::UploadProfileRequest request;
           request.set_worker_id("w1");
           v1::UploadProfileResponse r;
           return workers->UploadProfile(c, request, &r);
         }},
        {"ReportProfile", kWorker,
         [workers](grpc::ClientContext* c) {
           v1::ReportProfileRequest request;
           request.set_worker_id("w1");
           v1::ReportProfileResponse r;
           return workers->ReportProfile(c, request, &r);
         }},
        {"AppendLogs", kWorker,
         [workers](grpc::ClientContext* c) {
           v1::AppendLogsRequest request;
           request.set_worker_id("w1");
           v1::AppendLogsResponse r;
           return workers->AppendLogs(c, request, &r);
         }},
        {"ListWorkers", kClient,
         [workers](grpc::ClientContext* c) {
           v1::ListWorkersResponse r;
           return workers->ListWorkers(c, v1::ListWorkersRequest(), &r);
         }},
        {"RegisterWorker", kWorker,
         [workers](grpc::ClientContext* c) {
           v1::RegisterWorkerRequest request;
           request.set_worker_id("w1");
           v1::RegisterWorkerResponse r;
           return workers->RegisterWorker(c, request, &r);
         }},
        {"Heartbeat", kWorker,
         [workers](grpc::ClientContext* c) {
           auto stream = workers->Heartbeat(c);
           v1::HeartbeatRequest request;
           request.set_worker_id("w1");
           stream->Write(request);
           stream->WritesDone();
           v1::HeartbeatResponse r;
           while (stream->Read(&r)) {
           }
           return stream->Finish();
         }},
        {"ReportProgress", kWorker,
         [workers](grpc::ClientContext* c) {
           v1::ReportProgressRequest request;
           request.set_worker_id("w1");
           v1::ReportProgressResponse r;
           return workers->ReportProgress(c, request, &r);
         }},
        {"Set", kWorker,
         [rendezvous](grpc::ClientContext* c) {
           v1::RendezvousSetResponse r;
           return rendezvous->Set(c, v1::RendezvousSetRequest(), &r);
         }},
        {"Get", kWorker,
         [rendezvous](grpc::ClientContext* c) {
           v1::RendezvousGetResponse r;
           return rendezvous->Get(c, v1::RendezvousGetRequest(), &r);
         }},
        {"Wait", kWorker,
         [rendezvous](grpc::ClientContext* c) {
           v1::RendezvousWaitRequest request;
           request.add_keys("k");
           request.set_timeout_ms(1);
           v1::RendezvousWaitResponse r;
           return rendezvous->Wait(c, request, &r);
         }},
        {"DrainWorker", kAdmin,
         [workers](grpc::ClientContext* c) {
           v1::DrainWorkerRequest request;
           request.set_worker_id("nobody");
           v1::WorkerStatus r;
           return workers->DrainWorker(c, request, &r);
         }},
        {"RemoveWorker", kAdmin,
         [workers](grpc::ClientContext* c) {
           v1::RemoveWorkerRequest request;
           request.set_worker_id("nobody");
           v1::RemoveWorkerResponse r;
           return workers->RemoveWorker(c, request, &r);
         }},
        {"Add", kWorker,
         [rendezvous](grpc::ClientContext* c) {
           v1::RendezvousAddResponse r;
           return rendezvous->Add(c, v1::RendezvousAddRequest(), &r);
         }},
    };
  }

  grpc::Status CallAs(const Rpc& rpc, const std::string& token) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    AttachToken(&context, token);
    return rpc.call(&context);
  }

  FakeClock clock_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<JobManager> jobs_;
  RendezvousStore rendezvous_{[this](absl::string_view job, int64_t generation) {
    return scheduler_->IsActiveAttempt(job, generation);
  }};
  std::unique_ptr<JobServiceImpl> job_service_;
  std::unique_ptr<WorkerServiceImpl> worker_service_;
  std::unique_ptr<RendezvousServiceImpl> rendezvous_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::JobService::Stub> jobs_stub_;
  std::unique_ptr<v1::WorkerService::Stub> workers_stub_;
  std::unique_ptr<v1::RendezvousService::Stub> rendezvous_stub_;
};

bool IsAuthError(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
         status.error_code() == grpc::StatusCode::PERMISSION_DENIED;
}

TEST_F(AuthMatrixTest, EveryRpcAgainstEveryCaller) {
  const std::vector<Rpc> rpcs = EveryRpc();
  ASSERT_EQ(rpcs.size(), 23u);  // every method of the three services
  for (const Rpc& rpc : rpcs) {
    SCOPED_TRACE(rpc.name);
    grpc::Status none = CallAs(rpc, "");
    EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_THAT(none.error_message(), HasSubstr("no bearer token"));
    grpc::Status wrong = CallAs(rpc, "not-a-token-0123456789");
    EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(wrong.error_message(), "unknown token");
    const grpc::Status client = CallAs(rpc, "alice-secret-0123456789");
    const grpc::Status admin = CallAs(rpc, "root-secret-0123456789");
    const grpc::Status worker = CallAs(rpc, "w1-secret-0123456789");
    if (rpc.kind == kWorker) {
      EXPECT_FALSE(IsAuthError(worker)) << worker.error_message();
      for (const grpc::Status& other : {client, admin}) {
        EXPECT_EQ(other.error_code(), grpc::StatusCode::PERMISSION_DENIED);
        EXPECT_THAT(other.error_message(), HasSubstr("may not call " + rpc.name));
      }
    } else if (rpc.kind == kAdmin) {
      EXPECT_FALSE(IsAuthError(admin)) << admin.error_message();
      for (const grpc::Status& other : {client, worker}) {
        EXPECT_EQ(other.error_code(), grpc::StatusCode::PERMISSION_DENIED);
        EXPECT_THAT(other.error_message(), HasSubstr("(admin only)"));
      }
    } else {
      EXPECT_FALSE(IsAuthError(client)) << client.error_message();
      EXPECT_FALSE(IsAuthError(admin)) << admin.error_message();
      EXPECT_EQ(worker.error_code(), grpc::StatusCode::PERMISSION_DENIED);
      EXPECT_EQ(worker.error_message(),
                absl::StrCat("w1 (worker) may not call ", rpc.name, " (client or admin only)"));
    }
    // No answer repeats a token.
    for (const grpc::Status& s : {none, wrong, client, admin, worker}) {
      EXPECT_THAT(s.error_message(), Not(HasSubstr("secret")));
    }
  }
}

TEST(WatchLimitTest, WatchStreamsAreBoundedPerHost) {
  FakeClock clock;
  std::unique_ptr<Store> store = NewMemoryStore();
  std::unique_ptr<Scheduler> scheduler = *Scheduler::Create(store.get(), &clock, {});
  JobManager jobs(scheduler.get(), {});
  const Authenticator auth = Authenticator::AllowAll();
  JobServiceImpl service(&jobs, scheduler.get(), &auth,
                         {/*max_watches=*/3,
                          /*max_watches_per_host=*/2});
  v1::JobStatus job;
  job.set_job_id("job");
  bool existing = false;
  ASSERT_TRUE(scheduler->AddJob(job, "", &existing).ok());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  auto stub = v1::JobService::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  v1::WatchJobRequest request;
  request.set_job_id("job");
  struct Watch {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<v1::JobStatus>> reader;
  };
  std::vector<std::unique_ptr<Watch>> open;
  for (int i = 0; i < 2; ++i) {
    auto watch = std::make_unique<Watch>();
    watch->reader = stub->WatchJob(&watch->context, request);
    v1::JobStatus status;
    ASSERT_TRUE(watch->reader->Read(&status));  // the stream is up
    open.push_back(std::move(watch));
  }
  {
    grpc::ClientContext context;
    auto reader = stub->WatchJob(&context, request);
    v1::JobStatus status;
    EXPECT_FALSE(reader->Read(&status));
    grpc::Status refused = reader->Finish();
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(refused.error_message(), HasSubstr("2 from one host"));
  }
  // One ends: another may start.
  open.back()->context.TryCancel();
  (void)open.back()->reader->Finish();
  open.pop_back();
  grpc::Status ended;
  for (int tries = 0; tries < 50; ++tries) {  // the server notices the cancel within ~1 s
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
    auto reader = stub->WatchJob(&context, request);
    v1::JobStatus status;
    if (reader->Read(&status)) {
      ended = grpc::Status::OK;
      context.TryCancel();
      (void)reader->Finish();
      break;
    }
    ended = reader->Finish();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(ended.ok()) << ended.error_message();
  for (auto& watch : open) watch->context.TryCancel();
  for (auto& watch : open) (void)watch->reader->Finish();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

// Issue #27: a worker token acts only for the worker ids it names. With another worker's
// token every call for that worker's ranks is refused (registering under its id, a heartbeat
// of its session, its rank's report and log, its attempt's rendezvous keys); with its own id
// the call reaches the domain, which refuses ranks that are not placed there.
TEST_F(AuthMatrixTest, AWorkerTokenActsOnlyForItsWorkerIds) {
  v1::RegisterWorkerRequest w1;
  w1.set_worker_id("w1");
  w1.set_slots(1);
  ASSERT_TRUE(scheduler_->RegisterWorker(w1).ok());
  v1::JobStatus job;
  job.set_job_id("job");
  job.mutable_spec()->set_output("/runs/job");
  job.mutable_plan()->set_ranks(1);
  bool existing = false;
  ASSERT_TRUE(scheduler_->AddJob(job, "", &existing).ok());
  scheduler_->Settle();
  ASSERT_EQ(scheduler_->GetJob("job")->attempts_size(), 1);

  const std::string own = "w1-secret-0123456789", other = "pool-secret-0123456789";
  auto as = [](const std::string& token) {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    AttachToken(context.get(), token);
    return context;
  };
  const std::string denied =
      "pool (worker) may not act for worker \"w1\" (its token names w2, pool-*)";
  {
    v1::RegisterWorkerRequest takeover = w1;
    takeover.set_slots(4);
    v1::RegisterWorkerResponse r;
    grpc::Status status = workers_stub_->RegisterWorker(as(other).get(), takeover, &r);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_EQ(status.error_message(), denied);
    takeover.set_worker_id("pool-7");  // its own ids: the prefix
    EXPECT_TRUE(workers_stub_->RegisterWorker(as(other).get(), takeover, &r).ok());
  }
  {
    auto context = as(other);
    auto stream = workers_stub_->Heartbeat(context.get());
    v1::HeartbeatRequest beat;
    beat.set_worker_id("w1");
    stream->Write(beat);
    stream->WritesDone();
    v1::HeartbeatResponse r;
    while (stream->Read(&r)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  v1::ReportProgressRequest report;
  report.set_worker_id("w1");
  report.set_job_id("job");
  report.set_generation(1);
  report.set_event(v1::RANK_EVENT_SUCCEEDED);
  v1::ReportProgressResponse progress;
  grpc::Status status = workers_stub_->ReportProgress(as(other).get(), report, &progress);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  report.set_worker_id("w2");  // its own id, but the rank is not placed there
  status = workers_stub_->ReportProgress(as(other).get(), report, &progress);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("rank 0 is not placed on worker w2"));
  EXPECT_EQ(scheduler_->GetJob("job")->state(), v1::JOB_STATE_RUNNING);

  v1::AppendLogsRequest log;
  log.set_worker_id("w1");
  log.set_job_id("job");
  log.set_generation(1);
  log.set_data("forged\n");
  v1::AppendLogsResponse appended;
  status = workers_stub_->AppendLogs(as(other).get(), log, &appended);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);

  v1::RendezvousSetRequest set;
  set.mutable_scope()->set_job_id("job");
  set.mutable_scope()->set_generation(1);
  set.set_key("rank0");
  set.set_value("addr");
  v1::RendezvousSetResponse done;
  status = rendezvous_stub_->Set(as(other).get(), set, &done);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(status.error_message(), "pool (worker) acts for no worker of attempt 1 of job job");
  EXPECT_TRUE(rendezvous_stub_->Set(as(own).get(), set, &done).ok());
  v1::RendezvousGetRequest get;
  *get.mutable_scope() = set.scope();
  get.set_key("rank0");
  v1::RendezvousGetResponse value;
  EXPECT_EQ(rendezvous_stub_->Get(as(other).get(), get, &value).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(rendezvous_stub_->Get(as(own).get(), get, &value).ok());
}

TEST(CallerTest, WorkerIdsAreNamesOrPrefixes) {
  Caller pool{true, Role::kWorker, "pool", {"w2", "pool-*"}};
  EXPECT_TRUE(pool.MayActFor("w2"));
  EXPECT_TRUE(pool.MayActFor("pool-0"));
  EXPECT_TRUE(pool.MayActFor("pool-"));
  EXPECT_FALSE(pool.MayActFor("w20"));
  EXPECT_FALSE(pool.MayActFor("pool"));
  EXPECT_FALSE(pool.MayActFor(""));
  Caller any{true, Role::kWorker, "any", {"*"}};
  EXPECT_TRUE(any.MayActFor("anything"));
  Caller client{true, Role::kClient, "alice", {}};
  EXPECT_FALSE(client.MayActFor("alice"));
  EXPECT_TRUE(Caller().MayActFor("w1")) << "authentication off";
  EXPECT_TRUE(Caller().SeesEveryJob());
  EXPECT_FALSE(client.SeesEveryJob());
  EXPECT_EQ(client.Describe(), "alice (client)");
}

TEST(AuthenticatorTest, AllowAllLetsEveryCallThrough) {
  const Authenticator auth = Authenticator::AllowAll();
  EXPECT_FALSE(auth.enabled());
  grpc::ServerContext context;
  EXPECT_TRUE(auth.Check(context, kWorkerCall, "Heartbeat").ok());
}

TEST(AuthenticatorTest, BadTokenFilesNameTheLineNeverTheToken) {
  const std::pair<const char*, const char*> cases[] = {
      {"client alice", "tokens:1: expected \"<role> <name> <token>\""},
      {"client alice secret-0123456789abc w1", "got 4 fields"},
      {"worker w1 secret-0123456789abc w1,w/2", "tokens:1: the worker ids of w1 must be names"},
      {"worker w1 secret-0123456789abc w1,,w2", "tokens:1: the worker ids of w1 must be names"},
      {"worker w1 secret-0123456789abc w*1", "tokens:1: the worker ids of w1 must be names"},
      {"client team replace-me-client-token-0123456789",
       "tokens:1: the token of team is the example value from deploy/: replace it"},
      {"# only a comment\n\n", "tokens: holds no tokens"},
      {"root alice secret-0123456789abc", "tokens:1: unknown role \"root\""},
      {"client al/ice secret-0123456789abc", "tokens:1: the name must be 1 to 63 characters"},
      {"client alice short", "tokens:1: the token of alice must be at least 16"},
      {"client alice secret-0123456789abc\nworker w1 secret-0123456789abc",
       "tokens:2: the token of w1 is also alice's"},
  };
  for (const auto& [text, message] : cases) {
    absl::StatusOr<Authenticator> auth = Authenticator::FromText(text, "tokens");
    EXPECT_EQ(auth.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(auth.status().message(), HasSubstr(message)) << text;
    EXPECT_THAT(auth.status().message(), Not(HasSubstr("secret"))) << text;
  }
}

}  // namespace
}  // namespace lathe
