// `lathe profile`'s RPCs over gRPC on 127.0.0.1 (issue #33): a capture asked for
// (JobService.ProfileJob), ordered to the ranks' worker in its heartbeat, its files uploaded in
// chunks (WorkerService.UploadProfile) within the bounds, answered (ReportProfile, the sizes
// checked against what the coordinator holds) and read back (GetProfileFile).
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/rpc/auth.h"
#include "coordinator/api/services.h"
#include "coordinator/logs/profile_store.h"
#include "coordinator/scheduler/job_manager.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/store/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lathe/v1/coordinator.grpc.pb.h"
#include "tests/testing/temp_dir.h"

namespace lathe {
namespace {

using ::testing::HasSubstr;

class ProfileServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = NewMemoryStore();
    scheduler_ = *Scheduler::Create(store_.get(), &clock_, {});
    jobs_ = std::make_unique<JobManager>(scheduler_.get(), JobManagerOptions{});
    // Small bounds: 16 bytes a file, 24 a capture.
    profiles_ = *ProfileStore::Open(dir_.Path("logs"), 16, 24);
    JobServiceOptions job_options;
    job_options.profiles = profiles_.get();
    job_service_ =
        std::make_unique<JobServiceImpl>(jobs_.get(), scheduler_.get(), &auth_, job_options);
    WorkerServiceOptions worker_options;
    worker_options.profiles = profiles_.get();
    worker_service_ = std::make_unique<WorkerServiceImpl>(scheduler_.get(), &auth_, worker_options);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(job_service_.get());
    builder.RegisterService(worker_service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    auto channel =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    jobs_stub_ = v1::JobService::NewStub(channel);
    workers_stub_ = v1::WorkerService::NewStub(channel);

    // One worker with two slots runs both ranks of "job".
    v1::RegisterWorkerRequest w1;
    w1.set_worker_id("w1");
    w1.set_device(v1::DEVICE_CPU);
    w1.set_slots(2);
    session_ = scheduler_->RegisterWorker(w1)->session_id();
    v1::JobStatus job;
    job.set_job_id("job");
    job.mutable_spec()->set_output("/runs/job");
    job.mutable_plan()->set_ranks(2);
    bool existing = false;
    ASSERT_TRUE(scheduler_->AddJob(job, "", &existing).ok());
    scheduler_->Settle();
    ASSERT_EQ(Job().state(), v1::JOB_STATE_RUNNING);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

  v1::JobStatus Job() {
    grpc::ClientContext context;
    v1::GetJobRequest request;
    request.set_job_id("job");
    v1::JobStatus job;
    EXPECT_TRUE(jobs_stub_->GetJob(&context, request, &job).ok());
    return job;
  }

  grpc::Status Upload(int64_t rank, const std::string& capture, const std::string& name,
                      int64_t offset, const std::string& data, int64_t* size = nullptr) {
    grpc::ClientContext context;
    v1::UploadProfileRequest request;
    request.set_worker_id("w1");
    request.set_job_id("job");
    request.set_generation(1);
    request.set_rank(rank);
    request.set_capture_id(capture);
    request.set_name(name);
    request.set_offset(offset);
    request.set_data(data);
    v1::UploadProfileResponse response;
    grpc::Status status = workers_stub_->UploadProfile(&context, request, &response);
    if (size != nullptr) *size = response.size();
    return status;
  }

  grpc::Status Answer(int64_t rank, const std::string& capture,
                      const std::vector<std::pair<std::string, uint64_t>>& files,
                      const std::string& error = "") {
    grpc::ClientContext context;
    v1::ReportProfileRequest request;
    request.set_worker_id("w1");
    request.set_job_id("job");
    request.set_generation(1);
    request.set_rank(rank);
    request.set_capture_id(capture);
    request.set_first_step(2);
    request.set_last_step(4);
    for (const auto& [name, size] : files) {
      v1::ProfileFile* file = request.add_files();
      file->set_name(name);
      file->set_size(size);
    }
    request.set_error(error);
    v1::ReportProfileResponse response;
    return workers_stub_->ReportProfile(&context, request, &response);
  }

  absl::StatusOr<v1::ProfileJobResponse> Profile(bool all_ranks, int64_t rank = 0) {
    grpc::ClientContext context;
    v1::ProfileJobRequest request;
    request.set_job_id("job");
    request.set_all_ranks(all_ranks);
    request.set_rank(rank);
    request.set_memory(true);
    v1::ProfileJobResponse response;
    grpc::Status status = jobs_stub_->ProfileJob(&context, request, &response);
    scheduler_->Settle();
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          status.error_message());
    }
    return response;
  }

  FakeClock clock_;
  testing::TempDir dir_;
  const Authenticator auth_ = Authenticator::AllowAll();
  std::unique_ptr<Store> store_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<JobManager> jobs_;
  std::unique_ptr<ProfileStore> profiles_;
  std::unique_ptr<JobServiceImpl> job_service_;
  std::unique_ptr<WorkerServiceImpl> worker_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::JobService::Stub> jobs_stub_;
  std::unique_ptr<v1::WorkerService::Stub> workers_stub_;
  std::string session_;
};

TEST_F(ProfileServiceTest, ACaptureIsOrderedUploadedAnsweredAndReadBack) {
  absl::StatusOr<v1::ProfileJobResponse> asked = Profile(/*all_ranks=*/true);
  ASSERT_TRUE(asked.ok()) << asked.status();
  const std::string id = asked->capture().capture_id();
  v1::HeartbeatRequest beat;
  beat.set_worker_id("w1");
  beat.set_session_id(session_);
  absl::StatusOr<v1::HeartbeatResponse> mail = scheduler_->Heartbeat(beat);
  ASSERT_TRUE(mail.ok());
  ASSERT_EQ(mail->profiles_size(), 2);
  EXPECT_TRUE(mail->profiles(0).memory());

  // Chunks at contiguous offsets; a resend is skipped, a path or a gap refused.
  int64_t size = 0;
  ASSERT_TRUE(Upload(0, id, "trace.json", 0, "{\"a\":", &size).ok());
  ASSERT_TRUE(Upload(0, id, "trace.json", 5, "1}", &size).ok());
  ASSERT_TRUE(Upload(0, id, "trace.json", 5, "1}", &size).ok());
  EXPECT_EQ(size, 7);
  EXPECT_EQ(Upload(0, id, "../trace.json", 0, "x").error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Upload(0, id, "trace.json", 9, "x").error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(Upload(0, "prof-9", "trace.json", 0, "x").error_code(), grpc::StatusCode::NOT_FOUND);
  // A file past its bound is refused, saying which.
  grpc::Status big = Upload(1, id, "memory.json", 0, std::string(17, 'm'));
  EXPECT_EQ(big.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(big.error_message(), HasSubstr("rank 1's memory.json: 17 bytes pass the bound"));
  ASSERT_TRUE(Upload(1, id, "memory.json", 0, "0123456789").ok());

  ASSERT_TRUE(Answer(0, id, {{"trace.json", 7}}).ok());
  ASSERT_TRUE(Answer(1, id, {{"memory.json", 10}}).ok());
  v1::ProfileCapture done = Job().attempts(0).profiles(0);
  EXPECT_EQ(done.state(), v1::PROFILE_STATE_DONE) << done.error();
  ASSERT_EQ(done.files_size(), 2);
  EXPECT_EQ(done.files(1).rank(), 1);
  EXPECT_EQ(done.files(1).size(), 10u);

  // Read back in chunks; only a listed file.
  std::string read;
  for (int64_t offset = 0;;) {
    grpc::ClientContext context;
    v1::GetProfileFileRequest request;
    request.set_job_id("job");
    request.set_capture_id(id);
    request.set_rank(1);
    request.set_name("memory.json");
    request.set_offset(offset);
    request.set_max_bytes(4);
    v1::GetProfileFileResponse chunk;
    ASSERT_TRUE(jobs_stub_->GetProfileFile(&context, request, &chunk).ok());
    EXPECT_EQ(chunk.size(), 10);
    if (chunk.data().empty()) break;
    read += chunk.data();
    offset += static_cast<int64_t>(chunk.data().size());
  }
  EXPECT_EQ(read, "0123456789");
  grpc::ClientContext context;
  v1::GetProfileFileRequest unlisted;
  unlisted.set_job_id("job");
  unlisted.set_capture_id(id);
  unlisted.set_rank(0);
  unlisted.set_name("memory.json");
  v1::GetProfileFileResponse chunk;
  EXPECT_EQ(jobs_stub_->GetProfileFile(&context, unlisted, &chunk).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(ProfileServiceTest, AFileTheCoordinatorDoesNotHoldFailsTheCapture) {
  absl::StatusOr<v1::ProfileJobResponse> asked = Profile(false, 1);
  ASSERT_TRUE(asked.ok()) << asked.status();
  const std::string id = asked->capture().capture_id();
  ASSERT_TRUE(Upload(1, id, "trace.json", 0, "abc").ok());
  EXPECT_EQ(Answer(1, id, {{"a/b", 3}}).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(Answer(1, id, {{"trace.json", 5}}).ok());
  const v1::ProfileCapture failed = Job().attempts(0).profiles(0);
  EXPECT_EQ(failed.state(), v1::PROFILE_STATE_FAILED);
  EXPECT_EQ(failed.error(), "rank 1: file trace.json: the coordinator holds 3 of its 5 bytes");
  EXPECT_EQ(failed.files(0).size(), 3u);
}

}  // namespace
}  // namespace lathe
