// The agent's LogShipper (worker/agent/log_shipper.h) against an in-process WorkerService on
// 127.0.0.1: lines go out in order at contiguous offsets, a batch the coordinator could not
// take (UNAVAILABLE) goes again with the next, a refused one is dropped, Stop sends what is
// left, and what overflowed while the coordinator was away is declared lost.
#include "worker/agent/log_shipper.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace lathe {
namespace {

// Keeps what it is sent; refuses the first `unavailable` calls with UNAVAILABLE and any log
// of job "refused" with FAILED_PRECONDITION.
class FakeWorkerService : public v1::WorkerService::Service {
 public:
  grpc::Status AppendLogs(grpc::ServerContext* context, const v1::AppendLogsRequest* request,
                          v1::AppendLogsResponse* response) override {
    absl::MutexLock lock(&mu);
    auto auth = context->client_metadata().find("authorization");
    authorization = auth == context->client_metadata().end()
                        ? ""
                        : std::string(auth->second.data(), auth->second.size());
    if (unavailable > 0) {
      --unavailable;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "restarting");
    }
    if (request->job_id() == "refused") {
      ++refused;
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "not yours");
    }
    const int64_t gap = request->offset() - static_cast<int64_t>(received.size());
    EXPECT_EQ(gap, request->lost()) << "an undeclared gap or an overlap";
    if (gap > 0) received += absl::StrCat("[", gap, " lost]");
    received += request->data();
    response->set_size(static_cast<int64_t>(received.size()));
    return grpc::Status::OK;
  }

  absl::Mutex mu;
  std::string received ABSL_GUARDED_BY(mu);
  int unavailable ABSL_GUARDED_BY(mu) = 0;
  int refused ABSL_GUARDED_BY(mu) = 0;
  std::string authorization ABSL_GUARDED_BY(mu);
};

// The fake service on 127.0.0.1, and a stub to it.
struct Coordinator {
  Coordinator() {
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    stub = v1::WorkerService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }
  ~Coordinator() { server->Shutdown(); }

  FakeWorkerService service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::WorkerService::Stub> stub;
};

TEST(LogShipperTest, SendsInOrderRetriesWhatWasNotTakenAndDropsWhatWasRefused) {
  Coordinator coordinator;
  FakeWorkerService& service = coordinator.service;
  v1::WorkerService::Stub* stub = coordinator.stub.get();
  {
    absl::MutexLock lock(&service.mu);
    service.unavailable = 2;  // the first two batches are not taken
  }
  LogShipperOptions options;
  options.period = absl::Milliseconds(20);
  options.token = "worker-token-0123456789";
  LogShipper shipper(stub, options);
  std::string expected;
  for (int i = 0; i < 50; ++i) {
    const std::string line = absl::StrCat("step ", i, " loss ", 3.0 - i * 0.01);
    shipper.AppendLine("w1", "job-1", 1, 0, line);
    shipper.AppendLine("w1", "refused", 1, 0, line);
    expected += line + "\n";
    if (i % 10 == 0) absl::SleepFor(absl::Milliseconds(30));
  }
  shipper.Finished("job-1", 1, 0);
  shipper.Stop();
  absl::MutexLock lock(&service.mu);
  EXPECT_EQ(service.received, expected);
  EXPECT_EQ(service.unavailable, 0);
  EXPECT_GE(service.refused, 1);
  EXPECT_EQ(service.authorization, "Bearer worker-token-0123456789");
}

TEST(LogShipperTest, DeclaresWhatOverflowedWhileTheCoordinatorWasAway) {
  Coordinator coordinator;
  FakeWorkerService& service = coordinator.service;
  v1::WorkerService::Stub* stub = coordinator.stub.get();
  {
    absl::MutexLock lock(&service.mu);
    service.unavailable = 1 << 30;  // away
  }
  LogShipperOptions options;
  options.period = absl::Milliseconds(5);
  options.max_pending = 100;
  LogShipper shipper(stub, options);
  std::string all;
  for (int i = 0; i < 30; ++i) {  // 30 lines of 10 bytes: the first 200 overflow
    const std::string line = absl::StrCat("line ", 1000 + i);
    shipper.AppendLine("w1", "job-1", 1, 0, line);
    all += line + "\n";
  }
  {
    absl::MutexLock lock(&service.mu);
    service.unavailable = 0;  // back
  }
  shipper.Stop();
  absl::MutexLock lock(&service.mu);
  EXPECT_EQ(service.received, "[200 lost]" + all.substr(200));
}

// What the agent waits for before it may remove a finished rank's folder (its local log).
TEST(LogShipperTest, SaysWhenARanksLogHasAllGone) {
  Coordinator coordinator;
  FakeWorkerService& service = coordinator.service;
  {
    absl::MutexLock lock(&service.mu);
    service.unavailable = 1 << 30;  // away
  }
  LogShipperOptions options;
  options.period = absl::Milliseconds(5);
  LogShipper shipper(coordinator.stub.get(), options);
  EXPECT_TRUE(shipper.Shipped("job-1", 1, 0));  // no log at all
  shipper.AppendLine("w1", "job-1", 1, 0, "step 1");
  shipper.AppendLine("w1", "refused", 1, 0, "step 1");
  shipper.Finished("job-1", 1, 0);
  shipper.Finished("refused", 1, 0);
  absl::SleepFor(absl::Milliseconds(50));  // a few periods: nothing is taken
  EXPECT_FALSE(shipper.Shipped("job-1", 1, 0));
  EXPECT_FALSE(shipper.Shipped("refused", 1, 0));
  {
    absl::MutexLock lock(&service.mu);
    service.unavailable = 0;  // back
  }
  const absl::Time limit = absl::Now() + absl::Seconds(60);
  while (!(shipper.Shipped("job-1", 1, 0) && shipper.Shipped("refused", 1, 0)) &&
         absl::Now() < limit) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(shipper.Shipped("job-1", 1, 0));
  EXPECT_TRUE(shipper.Shipped("refused", 1, 0));  // refused: dropped, done with
  absl::MutexLock lock(&service.mu);
  EXPECT_EQ(service.received, "step 1\n");
}

}  // namespace
}  // namespace lathe
