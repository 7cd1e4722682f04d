// Runs the `lathe` CLI in-process against a fake JobService and WorkerService served over
// gRPC on 127.0.0.1, and checks what it prints, what it sends and its exit status.
#include "client/cli.h"

#include <arpa/inet.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/job_client.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lathe/v1/coordinator.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace lathe {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::MatchesRegex;
using ::testing::Not;
using ::testing::StartsWith;
using ::testing::UnorderedElementsAre;

// A JobService that records what it receives and answers from canned statuses.
class FakeJobService final : public v1::JobService::Service {
 public:
  grpc::Status SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest* request,
                         v1::SubmitJobResponse* response) override {
    absl::MutexLock lock(&mu_);
    ++submit_calls_;
    if (failing_submits_ > 0) {
      --failing_submits_;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator restarting");
    }
    if (!submit_error_.ok()) return submit_error_;
    submits_.push_back(*request);
    auto [it, inserted] = job_by_request_.emplace(request->request_id(),
                                                  absl::StrCat("job-", job_by_request_.size() + 1));
    response->set_job_id(it->second);
    response->mutable_status()->set_job_id(it->second);
    *response->mutable_status()->mutable_spec() = request->spec();
    response->mutable_status()->set_state(v1::JOB_STATE_QUEUED);
    response->set_existing(!inserted);
    return grpc::Status::OK;
  }

  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest* request,
                      v1::JobStatus* response) override {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request->job_id());
    if (it == jobs_.end()) return NotFound(request->job_id());
    *response = it->second;
    return grpc::Status::OK;
  }

  grpc::Status ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest* request,
                        v1::ListJobsResponse* response) override {
    absl::MutexLock lock(&mu_);
    list_requests_.push_back(*request);
    auto auth = context->client_metadata().find("authorization");
    authorizations_.push_back(auth == context->client_metadata().end()
                                  ? ""
                                  : std::string(auth->second.data(), auth->second.size()));
    size_t page = 0;
    if (!request->page_token().empty()) page = std::stoul(request->page_token());
    if (page >= pages_.size()) return grpc::Status::OK;
    *response = pages_[page];
    if (page + 1 < pages_.size()) response->set_next_page_token(std::to_string(page + 1));
    return grpc::Status::OK;
  }

  grpc::Status CancelJob(grpc::ServerContext*, const v1::CancelJobRequest* request,
                         v1::JobStatus* response) override {
    absl::MutexLock lock(&mu_);
    cancels_.push_back(*request);
    auto it = jobs_.find(request->job_id());
    if (it == jobs_.end()) return NotFound(request->job_id());
    if (it->second.state() == v1::JOB_STATE_QUEUED || it->second.state() == v1::JOB_STATE_RUNNING) {
      it->second.set_state(v1::JOB_STATE_CANCELLED);
      it->second.set_reason(request->reason());
    }
    *response = it->second;
    return grpc::Status::OK;
  }

  grpc::Status WatchJob(grpc::ServerContext*, const v1::WatchJobRequest* request,
                        grpc::ServerWriter<v1::JobStatus>* writer) override {
    std::vector<v1::JobStatus> updates;
    {
      absl::MutexLock lock(&mu_);
      auto it = watch_updates_.find(request->job_id());
      if (it == watch_updates_.end()) return NotFound(request->job_id());
      updates = it->second;
    }
    for (const v1::JobStatus& update : updates) {
      if (!writer->Write(update)) break;
    }
    return grpc::Status::OK;
  }

  grpc::Status ProfileJob(grpc::ServerContext*, const v1::ProfileJobRequest* request,
                          v1::ProfileJobResponse* response) override {
    absl::MutexLock lock(&mu_);
    profile_requests_.push_back(*request);
    if (!profile_error_.ok()) return profile_error_;
    response->set_generation(1);
    v1::ProfileCapture* capture = response->mutable_capture();
    capture->set_capture_id("prof-1");
    capture->set_state(v1::PROFILE_STATE_PENDING);
    capture->set_steps(request->steps());
    capture->set_memory(request->memory());
    if (request->all_ranks()) {
      capture->add_ranks(0);
      capture->add_ranks(1);
    } else {
      capture->add_ranks(request->rank());
    }
    return grpc::Status::OK;
  }

  // Serves the files set with SetProfileFile, at most 4 bytes a call (so that the CLI must
  // ask again).
  grpc::Status GetProfileFile(grpc::ServerContext*, const v1::GetProfileFileRequest* request,
                              v1::GetProfileFileResponse* response) override {
    absl::MutexLock lock(&mu_);
    auto it = profile_files_.find(absl::StrCat(request->job_id(), "/", request->capture_id(), "/",
                                               request->rank(), "/", request->name()));
    if (it == profile_files_.end()) return grpc::Status(grpc::StatusCode::NOT_FOUND, "no file");
    response->set_size(static_cast<int64_t>(it->second.size()));
    if (request->offset() < static_cast<int64_t>(it->second.size())) {
      response->set_data(it->second.substr(static_cast<size_t>(request->offset()), 4));
    }
    return grpc::Status::OK;
  }

  grpc::Status PlanJob(grpc::ServerContext*, const v1::PlanJobRequest* request,
                       v1::PlanJobResponse* response) override {
    absl::MutexLock lock(&mu_);
    plan_requests_.push_back(*request);
    if (!plan_error_.ok()) return plan_error_;
    *response = plan_;
    return grpc::Status::OK;
  }

  grpc::Status GetPlanHistory(grpc::ServerContext*, const v1::GetPlanHistoryRequest* request,
                              v1::GetPlanHistoryResponse* response) override {
    absl::MutexLock lock(&mu_);
    history_limits_.push_back(request->limit());
    *response = history_;
    return grpc::Status::OK;
  }

  void SetProfileError(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    profile_error_ = std::move(status);
  }
  std::vector<v1::ProfileJobRequest> profile_requests() {
    absl::MutexLock lock(&mu_);
    return profile_requests_;
  }
  void SetProfileFile(const std::string& job, const std::string& capture, int64_t rank,
                      const std::string& name, const std::string& data) {
    absl::MutexLock lock(&mu_);
    profile_files_[absl::StrCat(job, "/", capture, "/", rank, "/", name)] = data;
  }
  void SetJob(const v1::JobStatus& job) {
    absl::MutexLock lock(&mu_);
    jobs_[job.job_id()] = job;
  }
  void SetPlan(v1::PlanJobResponse plan, grpc::Status error = grpc::Status::OK) {
    absl::MutexLock lock(&mu_);
    plan_ = std::move(plan);
    plan_error_ = std::move(error);
  }
  void SetHistory(v1::GetPlanHistoryResponse history) {
    absl::MutexLock lock(&mu_);
    history_ = std::move(history);
  }
  std::vector<v1::PlanJobRequest> plan_requests() {
    absl::MutexLock lock(&mu_);
    return plan_requests_;
  }
  std::vector<int32_t> history_limits() {
    absl::MutexLock lock(&mu_);
    return history_limits_;
  }
  void SetPages(std::vector<v1::ListJobsResponse> pages) {
    absl::MutexLock lock(&mu_);
    pages_ = std::move(pages);
  }
  void SetWatchUpdates(const std::string& job_id, std::vector<v1::JobStatus> updates) {
    absl::MutexLock lock(&mu_);
    watch_updates_[job_id] = std::move(updates);
  }
  void SetSubmitError(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    submit_error_ = std::move(status);
  }
  // The next `count` submissions answer UNAVAILABLE.
  void FailSubmits(int count) {
    absl::MutexLock lock(&mu_);
    failing_submits_ = count;
  }
  int submit_calls() {
    absl::MutexLock lock(&mu_);
    return submit_calls_;
  }
  std::vector<v1::SubmitJobRequest> submits() {
    absl::MutexLock lock(&mu_);
    return submits_;
  }
  std::vector<v1::ListJobsRequest> list_requests() {
    absl::MutexLock lock(&mu_);
    return list_requests_;
  }
  // The authorization header of each ListJobs call ("" when none).
  std::vector<std::string> authorizations() {
    absl::MutexLock lock(&mu_);
    return authorizations_;
  }
  std::vector<v1::CancelJobRequest> cancels() {
    absl::MutexLock lock(&mu_);
    return cancels_;
  }

 private:
  static grpc::Status NotFound(const std::string& id) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("no job \"", id, "\""));
  }

  absl::Mutex mu_;
  grpc::Status submit_error_ ABSL_GUARDED_BY(mu_);
  int failing_submits_ ABSL_GUARDED_BY(mu_) = 0;
  int submit_calls_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<v1::SubmitJobRequest> submits_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> job_by_request_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, v1::JobStatus> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ListJobsResponse> pages_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ListJobsRequest> list_requests_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> authorizations_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::CancelJobRequest> cancels_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<v1::JobStatus>> watch_updates_ ABSL_GUARDED_BY(mu_);
  v1::PlanJobResponse plan_ ABSL_GUARDED_BY(mu_);
  grpc::Status plan_error_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::PlanJobRequest> plan_requests_ ABSL_GUARDED_BY(mu_);
  v1::GetPlanHistoryResponse history_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> history_limits_ ABSL_GUARDED_BY(mu_);
  grpc::Status profile_error_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ProfileJobRequest> profile_requests_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> profile_files_ ABSL_GUARDED_BY(mu_);
};

class FakeWorkerService final : public v1::WorkerService::Service {
 public:
  grpc::Status ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                           v1::ListWorkersResponse* response) override {
    absl::MutexLock lock(&mu_);
    *response = workers_;
    return grpc::Status::OK;
  }
  void SetWorkers(v1::ListWorkersResponse workers) {
    absl::MutexLock lock(&mu_);
    workers_ = std::move(workers);
  }

 private:
  absl::Mutex mu_;
  v1::ListWorkersResponse workers_ ABSL_GUARDED_BY(mu_);
};

struct CliResult {
  int code = -1;
  std::string out;
  std::string err;
};

CliResult RunLathe(const std::vector<std::string>& args, bool tty = false) {
  std::ostringstream out;
  std::ostringstream err;
  CliResult result;
  result.code = RunCli(args, out, err, tty);
  result.out = out.str();
  result.err = err.str();
  return result;
}

int64_t MillisAgo(absl::Duration ago) { return absl::ToUnixMillis(absl::Now() - ago); }

v1::JobStatus RunningJob(const std::string& id, int64_t step, int64_t updated_unix_ms) {
  v1::JobStatus job;
  job.set_job_id(id);
  job.mutable_spec()->set_name("demo-lora");
  job.set_state(v1::JOB_STATE_RUNNING);
  job.set_submitted_unix_ms(MillisAgo(absl::Hours(2)));
  job.set_updated_unix_ms(updated_unix_ms);
  job.mutable_plan()->set_ranks(2);
  job.mutable_plan()->set_total_steps(100);
  v1::Attempt* attempt = job.add_attempts();
  attempt->set_generation(1);
  attempt->set_state(v1::ATTEMPT_STATE_RUNNING);
  v1::Progress* progress = attempt->mutable_progress();
  progress->set_step(step);
  progress->set_total_steps(100);
  progress->set_loss(3.211);
  progress->set_tokens_per_second(1234);
  progress->set_updated_unix_ms(updated_unix_ms);
  return job;
}

v1::JobStatus FinishedJob(const std::string& id, v1::JobState state, const std::string& reason) {
  v1::JobStatus job = RunningJob(id, 100, 1'700'000'100'000);
  job.set_state(state);
  job.set_reason(reason);
  job.mutable_attempts(0)->set_state(state == v1::JOB_STATE_SUCCEEDED ? v1::ATTEMPT_STATE_SUCCEEDED
                                                                      : v1::ATTEMPT_STATE_FAILED);
  if (state == v1::JOB_STATE_SUCCEEDED) {
    job.set_final_loss(1.5);
    job.set_adapter_path("/runs/demo/adapter");
  }
  return job;
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&jobs_);
    builder.RegisterService(&workers_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now()));
  }

  // Runs `lathe --coordinator <fake> args...`.
  CliResult Run(std::vector<std::string> args, bool tty = false) {
    args.insert(args.begin(), {"--coordinator", address_});
    return RunLathe(args, tty);
  }

  std::string WriteSpec(const std::string& body) { return dir_.Write("job.yaml", body); }

  FakeJobService jobs_;
  FakeWorkerService workers_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  testing::TempDir dir_;
};

constexpr char kRelativeSpec[] = R"(name: demo-lora
model: {path: models/tiny}
data: {train: data/train.jsonl, eval: ./data/eval.jsonl}
lora: {rank: 8, init_from: adapters/start}
train: {steps: 10, global_batch: 4, lr: 1.0e-3}
output: runs/demo
)";

TEST_F(CliTest, SubmitSendsAbsolutePathsAndARandomRequestId) {
  const std::string spec_path = WriteSpec(kRelativeSpec);
  CliResult result = Run({"submit", spec_path});
  ASSERT_EQ(result.code, 0) << result.err;
  EXPECT_EQ(result.out, "job-1\n");
  EXPECT_EQ(result.err, "");

  std::vector<v1::SubmitJobRequest> submits = jobs_.submits();
  ASSERT_EQ(submits.size(), 1u);
  const v1::JobSpec& spec = submits[0].spec();
  const std::string cwd = std::filesystem::current_path().string();
  EXPECT_EQ(spec.name(), "demo-lora");
  EXPECT_EQ(spec.model().path(), cwd + "/models/tiny");
  EXPECT_EQ(spec.data().train(), cwd + "/data/train.jsonl");
  EXPECT_EQ(spec.data().eval(), cwd + "/data/eval.jsonl");
  EXPECT_EQ(spec.lora().init_from(), cwd + "/adapters/start");
  EXPECT_EQ(spec.output(), cwd + "/runs/demo");
  EXPECT_EQ(spec.lora().rank(), 8);
  EXPECT_EQ(spec.train().steps(), 10);
  EXPECT_THAT(submits[0].request_id(),
              MatchesRegex("[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"));

  // A second submission gets a fresh id, hence a second job.
  result = Run({"submit", spec_path});
  ASSERT_EQ(result.code, 0) << result.err;
  EXPECT_EQ(result.out, "job-2\n");
  submits = jobs_.submits();
  ASSERT_EQ(submits.size(), 2u);
  EXPECT_NE(submits[0].request_id(), submits[1].request_id());
}

TEST_F(CliTest, SubmitKeepsAbsolutePaths) {
  const std::string spec_path = WriteSpec(
      "name: a\nmodel: {path: /models/tiny}\ndata: {train: /data/t.jsonl}\n"
      "train: {steps: 1}\noutput: /runs/a\n");
  ASSERT_EQ(Run({"submit", spec_path}).code, 0);
  ASSERT_EQ(jobs_.submits().size(), 1u);
  EXPECT_EQ(jobs_.submits()[0].spec().model().path(), "/models/tiny");
  EXPECT_EQ(jobs_.submits()[0].spec().output(), "/runs/a");
  EXPECT_EQ(jobs_.submits()[0].spec().data().eval(), "");
}

TEST_F(CliTest, SubmitReusesAGivenRequestId) {
  const std::string spec_path = WriteSpec(kRelativeSpec);
  CliResult first = Run({"submit", spec_path, "--request-id", "retry-me"});
  ASSERT_EQ(first.code, 0) << first.err;
  CliResult second = Run({"submit", "--request-id=retry-me", spec_path});
  ASSERT_EQ(second.code, 0) << second.err;
  EXPECT_EQ(second.out, first.out);
  EXPECT_THAT(second.err, HasSubstr("matched job job-1"));
  std::vector<v1::SubmitJobRequest> submits = jobs_.submits();
  ASSERT_EQ(submits.size(), 2u);
  EXPECT_EQ(submits[0].request_id(), "retry-me");
  EXPECT_EQ(submits[1].request_id(), "retry-me");
}

TEST_F(CliTest, SubmitJsonPrintsTheJobObject) {
  const std::string spec_path = WriteSpec(kRelativeSpec);
  CliResult result = Run({"submit", spec_path, "--output", "json", "--request-id", "r-1"});
  ASSERT_EQ(result.code, 0) << result.err;
  nlohmann::json json = nlohmann::json::parse(result.out);
  EXPECT_EQ(json["job_id"], "job-1");
  EXPECT_EQ(json["state"], "queued");
  EXPECT_EQ(json["name"], "demo-lora");
  EXPECT_EQ(json["spec"]["train"]["steps"], 10);
  EXPECT_EQ(result.err, "");

  // A repeated request id: the same object, and the note on stderr.
  CliResult again = Run({"submit", spec_path, "--output", "json", "--request-id", "r-1"});
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_EQ(nlohmann::json::parse(again.out)["job_id"], "job-1");
  EXPECT_THAT(again.err, HasSubstr("request id r-1 matched job job-1"));
}

TEST_F(CliTest, SubmitRefusesABadSpecWithoutSendingIt) {
  const std::string spec_path = WriteSpec(
      "name: demo\nmodel: {path: m}\ndata: {train: t.jsonl}\ntrain: {steps: 10, lr: -1}\n"
      "output: o\n");
  CliResult result = Run({"submit", spec_path});
  EXPECT_EQ(result.code, 1);
  EXPECT_EQ(result.out, "");
  EXPECT_THAT(result.err, AllOf(StartsWith("lathe: "), HasSubstr("train.lr")));
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
  EXPECT_THAT(jobs_.submits(), IsEmpty());
}

TEST_F(CliTest, SubmitOfAMissingFileFails) {
  CliResult result = Run({"submit", dir_.Path("absent.yaml")});
  EXPECT_EQ(result.code, 1);
  EXPECT_THAT(result.err, HasSubstr("absent.yaml"));
  EXPECT_THAT(jobs_.submits(), IsEmpty());
}

TEST_F(CliTest, SubmitRefusedByTheCoordinator) {
  jobs_.SetSubmitError(
      grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "spec: model.path: no config.json"));
  CliResult result = Run({"submit", WriteSpec(kRelativeSpec)});
  EXPECT_EQ(result.code, 1);
  EXPECT_EQ(result.err,
            "lathe: the coordinator refused the job: spec: model.path: no config.json\n");
}

// The coordinator's UNIMPLEMENTED (a feature the engine lacks) keeps its message; only gRPC's
// own, empty one means "not a Lathe coordinator".
TEST_F(CliTest, SubmitOfWhatTheEngineCannotRunIsRefusedOnOneLine) {
  jobs_.SetSubmitError(grpc::Status(
      grpc::StatusCode::UNIMPLEMENTED,
      "spec: method: qlora is not supported by this engine yet (supported: lora, full, mezo)"));
  CliResult result = Run({"submit", WriteSpec(kRelativeSpec)});
  EXPECT_EQ(result.code, 1);
  EXPECT_EQ(result.out, "");
  EXPECT_EQ(result.err,
            "lathe: the coordinator refused the job: spec: method: qlora is not supported by "
            "this engine yet (supported: lora, full, mezo)\n");
}

// The retry policy: UNAVAILABLE is tried again (a submission is idempotent by its request
// id); without a request id a submission goes once.
TEST_F(CliTest, AnUnavailableCoordinatorIsTriedAgain) {
  jobs_.FailSubmits(2);
  CliResult result = Run({"submit", WriteSpec(kRelativeSpec)});
  EXPECT_EQ(result.code, 0) << result.err;
  EXPECT_EQ(result.out, "job-1\n");
  EXPECT_EQ(jobs_.submit_calls(), 3);

  jobs_.FailSubmits(1);
  JobClient client(address_);
  absl::StatusOr<v1::SubmitJobResponse> once = client.SubmitJob(v1::JobSpec(), "");
  EXPECT_EQ(once.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(jobs_.submit_calls(), 4);
}

TEST_F(CliTest, ListFollowsPagesAndPrintsATable) {
  v1::ListJobsResponse page1;
  *page1.add_jobs() = RunningJob("job-2", 12, MillisAgo(absl::Seconds(1)));
  v1::ListJobsResponse page2;
  v1::JobStatus queued;
  queued.set_job_id("job-1");
  queued.mutable_spec()->set_name("waiting");
  queued.set_state(v1::JOB_STATE_QUEUED);
  queued.set_submitted_unix_ms(MillisAgo(absl::Minutes(5)));
  queued.set_reason(std::string(100, 'r'));
  *page2.add_jobs() = queued;
  jobs_.SetPages({page1, page2});

  CliResult result = Run({"list", "--state", "running", "--state=queued,FAILED"});
  ASSERT_EQ(result.code, 0) << result.err;
  std::vector<std::string> lines = absl::StrSplit(result.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << result.out;
  EXPECT_THAT(lines[0], MatchesRegex("ID +NAME +STATE +STEP +LOSS +AGE +REASON"));
  EXPECT_THAT(lines[1], MatchesRegex("job-2 +demo-lora +RUNNING +12/100 +3.2110 +2h00m"));
  EXPECT_THAT(lines[2], MatchesRegex("job-1 +waiting +QUEUED +- +- +5m0[0-9]s +r+\\.\\.\\."));
  EXPECT_LT(lines[2].size(), 120u);

  std::vector<v1::ListJobsRequest> requests = jobs_.list_requests();
  ASSERT_EQ(requests.size(), 2u);
  EXPECT_EQ(requests[1].page_token(), "1");
  EXPECT_THAT(requests[0].states(),
              ElementsAre(v1::JOB_STATE_RUNNING, v1::JOB_STATE_QUEUED, v1::JOB_STATE_FAILED));
}

TEST_F(CliTest, TheTokenComesFromTheFlagTheFileOrTheEnvironment) {
  unsetenv("LATHE_TOKEN");
  ASSERT_EQ(Run({"list"}).code, 0);
  ASSERT_EQ(Run({"--token", "flag-token-0123456789", "list"}).code, 0);
  const std::string file = dir_.Write("token", "  file-token-0123456789\n");
  ASSERT_EQ(Run({"list", "--token-file", file}).code, 0);
  setenv("LATHE_TOKEN", "env-token-0123456789", 1);
  ASSERT_EQ(Run({"list"}).code, 0);
  ASSERT_EQ(Run({"list", "--token", "flag-token-0123456789"}).code, 0);  // the flag wins
  unsetenv("LATHE_TOKEN");
  EXPECT_THAT(jobs_.authorizations(),
              ElementsAre("", "Bearer flag-token-0123456789", "Bearer file-token-0123456789",
                          "Bearer env-token-0123456789", "Bearer flag-token-0123456789"));
  CliResult missing = Run({"list", "--token-file", dir_.Path("nope")});
  EXPECT_EQ(missing.code, 2);
  EXPECT_EQ(missing.err, "lathe: --token-file: " + dir_.Path("nope") + ": no such file\n")
      << "one line, without the usage (issue #32)";
}

TEST_F(CliTest, ListJsonIsAnArrayOfJobObjects) {
  v1::ListJobsResponse page1;
  *page1.add_jobs() = RunningJob("job-2", 12, 1'700'000'000'000);
  v1::ListJobsResponse page2;
  *page2.add_jobs() = FinishedJob("job-1", v1::JOB_STATE_SUCCEEDED, "");
  jobs_.SetPages({page1, page2});

  CliResult result = Run({"--output", "json", "list"});
  ASSERT_EQ(result.code, 0) << result.err;
  nlohmann::json json = nlohmann::json::parse(result.out);
  ASSERT_TRUE(json.is_array());
  ASSERT_EQ(json.size(), 2u);
  EXPECT_EQ(json[0]["job_id"], "job-2");
  EXPECT_EQ(json[0]["state"], "running");
  EXPECT_EQ(json[0]["attempts"][0]["progress"]["total_steps"], 100);
  EXPECT_EQ(json[0]["progress"]["step"], 12);
  EXPECT_EQ(json[1]["state"], "succeeded");
  EXPECT_EQ(json[1]["final_loss"], 1.5);

  jobs_.SetPages({});
  result = Run({"--output", "json", "list"});
  ASSERT_EQ(result.code, 0) << result.err;
  EXPECT_EQ(result.out, "[]\n");
}

TEST_F(CliTest, ListShowsTheNewestPageUnlessAskedForMore) {
  std::vector<v1::ListJobsResponse> pages(2);
  for (int i = 0; i < 6; ++i) {
    *pages[i / 3].add_jobs() =
        RunningJob(absl::StrCat("job-", 6 - i), 1, MillisAgo(absl::Hours(1)));
  }
  jobs_.SetPages(pages);
  CliResult result = Run({"list", "--limit", "2", "--name", "demo-lora", "--since", "2h"});
  ASSERT_EQ(result.code, 0) << result.err;
  std::vector<std::string> lines = absl::StrSplit(result.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u) << result.out;
  EXPECT_THAT(lines[1], HasSubstr("job-6"));
  EXPECT_THAT(lines[3], HasSubstr("the newest 2; --limit N or --all for older ones"));
  std::vector<v1::ListJobsRequest> requests = jobs_.list_requests();
  ASSERT_EQ(requests.size(), 1u) << "one page was enough";
  EXPECT_EQ(requests[0].name(), "demo-lora");
  const int64_t since = requests[0].since_unix_ms();
  EXPECT_NEAR(since, MillisAgo(absl::Hours(2)), 60'000);

  result = Run({"list", "--all"});
  ASSERT_EQ(result.code, 0) << result.err;
  lines = absl::StrSplit(result.out, '\n', absl::SkipEmpty());
  EXPECT_EQ(lines.size(), 7u) << result.out;  // the header and six jobs, no footer

  result = Run({"--output", "json", "list"});  // scripts get every job
  ASSERT_EQ(result.code, 0) << result.err;
  EXPECT_EQ(nlohmann::json::parse(result.out).size(), 6u);
  result = Run({"--output", "json", "list", "--limit", "4"});
  ASSERT_EQ(result.code, 0) << result.err;
  EXPECT_EQ(nlohmann::json::parse(result.out).size(), 4u);

  result = Run({"list", "--since", "yesterday"});
  EXPECT_EQ(result.code, 1);
  EXPECT_THAT(result.err, HasSubstr("--since: expected a duration such as 30m or 2h"));
  result = Run({"list", "--limit", "0"});
  EXPECT_EQ(result.code, 1);
  EXPECT_THAT(result.err, HasSubstr("--limit: must be at least 1, got 0"));
}

TEST_F(CliTest, ListWithAnUnknownStateFails) {
  CliResult result = Run({"list", "--state", "sleeping"});
  EXPECT_EQ(result.code, 1);
  EXPECT_THAT(result.err, HasSubstr("unknown job state \"sleeping\""));
}

// Issue #32: a failed job's reason and its last attempt's error were the same text, printed
// twice; the attempt now points at the reason.
TEST_F(CliTest, StatusSaysAFailedJobsErrorOnce) {
  v1::JobStatus job = RunningJob("job-8", 0, MillisAgo(absl::Seconds(3)));
  const std::string error =
      "rank 0 on worker w1 failed: data.train: /d/train.jsonl: line 1001: input_ids[1]: token id "
      "999999 is outside the vocabulary (vocab_size 256)";
  job.set_state(v1::JOB_STATE_FAILED);
  job.set_reason(error);
  v1::Attempt* attempt = job.mutable_attempts(0);
  attempt->set_state(v1::ATTEMPT_STATE_FAILED);
  attempt->set_failure(v1::FAILURE_KIND_USER);
  attempt->set_error(error);
  jobs_.SetJob(job);
  CliResult result = Run({"status", "job-8"});
  ASSERT_EQ(result.code, 0) << result.err;
  EXPECT_THAT(result.out, HasSubstr("user error: (the reason above)"));
  EXPECT_EQ(result.out.find("token id 999999"), result.out.rfind("token id 999999")) << result.out;
}

TEST_F(CliTest, StatusShowsPlanAttemptsProgressAndMemory) {
  v1::JobStatus job = RunningJob("job-7", 40, MillisAgo(absl::Seconds(3)));
  job.set_restarts(1);
  job.mutable_spec()->set_max_restarts(3);
  v1::Plan* plan = job.mutable_plan();
  plan->mutable_strategy()->set_zero_stage(3);
  plan->mutable_strategy()->set_micro_batch(2);
  plan->set_gradient_accumulation(4);
  plan->set_precision(v1::PRECISION_BF16);
  plan->mutable_strategy()->set_offload_optimizer(true);
  plan->set_explanation("ZeRO-3 because the weights do not fit one rank");
  plan->mutable_predicted_memory()->set_weights(1ull << 30);
  plan->mutable_predicted_memory()->set_total(3ull << 29);
  v1::Attempt first = job.attempts(0);
  first.set_state(v1::ATTEMPT_STATE_FAILED);
  first.set_error("exit status 1\nRuntimeError: boom");
  first.set_failure(v1::FAILURE_KIND_INFRASTRUCTURE);
  v1::Attempt second = job.attempts(0);
  second.set_generation(2);
  second.set_resumed_from_step(30);
  v1::RankPlacement* placement = second.add_placements();
  placement->set_rank(0);
  placement->set_worker_id("w-a");
  placement->set_slot(1);
  second.mutable_progress()->mutable_memory()->set_weights(1100ull << 20);
  second.mutable_progress()->mutable_memory()->set_activations(64ull << 20);
  second.mutable_progress()->set_products("onednn f32 brg:avx512_core, bf16 widened to f32");
  plan->set_memory_correction(1.1);
  job.clear_attempts();
  *job.add_attempts() = first;
  *job.add_attempts() = second;
  job.set_owner("alice");
  for (const auto& [state, by] : {std::pair{v1::JOB_STATE_QUEUED, "alice (client)"},
                                  std::pair{v1::JOB_STATE_RUNNING, "the coordinator"}}) {
    v1::StateChange* change = job.add_history();
    change->set_state(state);
    change->set_by(by);
    change->set_unix_ms(1'700'000'000'000);
  }
  jobs_.SetJob(job);

  CliResult result = Run({"status", "job-7"});
  ASSERT_EQ(result.code, 0) << result.err;
  const std::string& out = result.out;
  EXPECT_THAT(out, HasSubstr("job-7 (demo-lora)"));
  EXPECT_THAT(out, MatchesRegex("(.|\n)*state +RUNNING\n(.|\n)*"));
  EXPECT_THAT(out, MatchesRegex("(.|\n)*owner +alice\n(.|\n)*"));
  EXPECT_THAT(out, HasSubstr("history      2023-11-14T22:13:20Z  QUEUED by alice (client)\n"
                             "             2023-11-14T22:13:20Z  RUNNING by the coordinator\n"));
  EXPECT_THAT(out, HasSubstr("2 ranks on cpu, ZeRO-3, micro-batch 2 x 4 accumulation, 100 steps, "
                             "bf16"));
  EXPECT_THAT(out, HasSubstr("offload optimizer"));
  EXPECT_THAT(out, HasSubstr("ZeRO-3 because the weights do not fit one rank"));
  EXPECT_THAT(out, HasSubstr("#1 FAILED"));
  EXPECT_THAT(out, HasSubstr("infrastructure: exit status 1"));
  EXPECT_THAT(out, HasSubstr("RuntimeError: boom"));
  EXPECT_THAT(out, HasSubstr("#2 RUNNING  rank 0 on w-a slot 1"));
  EXPECT_THAT(out, HasSubstr("resumed from step 30"));
  EXPECT_THAT(out, HasSubstr("step 40/100  loss 3.2110  tokens/s 1234  products onednn f32 "
                             "brg:avx512_core, bf16 widened to f32"));
  EXPECT_THAT(out, MatchesRegex("(.|\n)*weights +1.00 GiB +1.07 GiB\n(.|\n)*"));
  EXPECT_THAT(out, MatchesRegex("(.|\n)*activations +- +64.0 MiB\n(.|\n)*"));
  EXPECT_THAT(out, MatchesRegex("(.|\n)*total +1.50 GiB +-\n(.|\n)*"));
  EXPECT_THAT(out, MatchesRegex("(.|\n)*planned \\(x1.100\\) +1.65 GiB\n(.|\n)*"));
  EXPECT_THAT(out, Not(HasSubstr("gradients")));  // zero in both
  // Once the attempt holds its ranks' largest peak, that is the measured column.
  *job.mutable_attempts(1)->mutable_peak_memory() = job.attempts(1).progress().memory();
  job.mutable_attempts(1)->mutable_peak_memory()->set_total(1600ull << 20);
  jobs_.SetJob(job);
  result = Run({"status", "job-7"});
  EXPECT_THAT(result.out, MatchesRegex("(.|\n)*total +1.50 GiB +1.56 GiB\n(.|\n)*"));
  EXPECT_THAT(out, HasSubstr("restarts     1 of 3"));
}

TEST_F(CliTest, StatusOfAFinishedJobShowsTheResult) {
  jobs_.SetJob(FinishedJob("job-3", v1::JOB_STATE_SUCCEEDED, ""));
  CliResult result = Run({"status", "job-3"});
  ASSERT_EQ(result.code, 0) << result.err;
  EXPECT_THAT(result.out, HasSubstr("final loss   1.5000"));
  EXPECT_THAT(result.out, HasSubstr("adapter      /runs/demo/adapter"));

  result = Run({"status", "job-3", "--output", "json"});
  ASSERT_EQ(result.code, 0) << result.err;
  EXPECT_EQ(nlohmann::json::parse(result.out)["adapter_path"], "/runs/demo/adapter");
}

TEST_F(CliTest, WatchToSuccessPrintsOneLinePerUpdate) {
  v1::JobStatus queued;
  queued.set_job_id("job-1");
  queued.set_state(v1::JOB_STATE_QUEUED);
  queued.set_reason("waiting for 2 free cpu slots");
  queued.set_updated_unix_ms(1'700'000'000'000);
  jobs_.SetWatchUpdates("job-1", {queued, RunningJob("job-1", 12, 1'700'000'010'000),
                                  FinishedJob("job-1", v1::JOB_STATE_SUCCEEDED, "")});
  CliResult result = Run({"watch", "job-1"});
  EXPECT_EQ(result.code, 0) << result.err;
  std::vector<std::string> lines = absl::StrSplit(result.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << result.out;
  EXPECT_EQ(lines[0], "2023-11-14T22:13:20Z QUEUED: waiting for 2 free cpu slots");
  EXPECT_EQ(lines[1], "2023-11-14T22:13:30Z RUNNING step 12/100 loss 3.2110 tokens/s 1234");
  EXPECT_EQ(lines[2],
            "2023-11-14T22:15:00Z SUCCEEDED final loss 1.5000 adapter /runs/demo/adapter");
  EXPECT_THAT(result.out, Not(HasSubstr("\r")));
}

// Issue #32: `watch` printed "RUNNING RUNNING" for a started attempt without a step yet, and
// printed the last step's line again for an update that changed nothing it shows.
TEST_F(CliTest, WatchPrintsNeitherAStateTwiceNorALineAgain) {
  v1::JobStatus started = RunningJob("job-1", 12, 1'700'000'005'000);
  started.mutable_attempts(0)->clear_progress();
  started.mutable_attempts(0)->set_state(v1::ATTEMPT_STATE_RUNNING);
  v1::JobStatus step = RunningJob("job-1", 12, 1'700'000'010'000);
  v1::JobStatus same_step = RunningJob("job-1", 12, 1'700'000'011'000);
  jobs_.SetWatchUpdates(
      "job-1", {started, step, same_step, FinishedJob("job-1", v1::JOB_STATE_SUCCEEDED, "")});
  CliResult result = Run({"watch", "job-1"});
  EXPECT_EQ(result.code, 0) << result.err;
  std::vector<std::string> lines = absl::StrSplit(result.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << result.out;
  EXPECT_EQ(lines[0], "2023-11-14T22:13:25Z RUNNING");
  EXPECT_EQ(lines[1], "2023-11-14T22:13:30Z RUNNING step 12/100 loss 3.2110 tokens/s 1234");
  EXPECT_THAT(lines[2], StartsWith("2023-11-14T22:15:00Z SUCCEEDED"));
}

TEST_F(CliTest, WatchToFailureExitsOneWithTheReason) {
  jobs_.SetWatchUpdates("job-1", {RunningJob("job-1", 12, 1'700'000'010'000),
                                  FinishedJob("job-1", v1::JOB_STATE_FAILED,
                                              "rank 0 exited with status 1 (out of memory)")});
  CliResult result = Run({"watch", "job-1"});
  EXPECT_EQ(result.code, 1);
  EXPECT_THAT(result.out, HasSubstr("FAILED: rank 0 exited with status 1 (out of memory)"));
}

TEST_F(CliTest, WatchOfACancelledJobExitsOne) {
  jobs_.SetWatchUpdates("job-1", {FinishedJob("job-1", v1::JOB_STATE_CANCELLED, "by alice")});
  CliResult result = Run({"watch", "job-1", "--output", "json"});
  EXPECT_EQ(result.code, 1);
  EXPECT_EQ(nlohmann::json::parse(result.out)["state"], "cancelled");
  EXPECT_EQ(result.err, "lathe: job job-1 CANCELLED: by alice\n");
}

TEST_F(CliTest, WatchOnATerminalDrawsAProgressBar) {
  v1::JobStatus timed = RunningJob("job-1", 50, 1'700'000'040'000);
  timed.mutable_attempts(0)->mutable_progress()->set_step_seconds(1.0);
  jobs_.SetWatchUpdates("job-1", {RunningJob("job-1", 10, 1'700'000'000'000), timed,
                                  FinishedJob("job-1", v1::JOB_STATE_SUCCEEDED, "")});
  CliResult result = Run({"watch", "job-1"}, /*tty=*/true);
  EXPECT_EQ(result.code, 0) << result.err;
  EXPECT_THAT(result.out, HasSubstr("RUNNING step 10/100"));  // the state change, on its own line
  EXPECT_THAT(result.out,
              HasSubstr("\r[##..................] step 10/100  loss 3.2110  1234 tok/s  ETA --"));
  // 1 s a step: 50 steps to go take 50 s.
  EXPECT_THAT(result.out,
              HasSubstr("\r[##########..........] step 50/100  loss 3.2110  1234 tok/s  ETA 50s"));
  EXPECT_THAT(result.out, HasSubstr("ETA 50s\n2023-11-14T22:15:00Z SUCCEEDED final loss 1.5000"));
  EXPECT_TRUE(absl::EndsWith(result.out, "\n"));
}

TEST_F(CliTest, WatchJsonPrintsOneStatusPerLine) {
  jobs_.SetWatchUpdates("job-1", {RunningJob("job-1", 12, 1'700'000'010'000),
                                  FinishedJob("job-1", v1::JOB_STATE_SUCCEEDED, "")});
  CliResult result = Run({"watch", "job-1", "--output=json"});
  EXPECT_EQ(result.code, 0) << result.err;
  std::vector<std::string> lines = absl::StrSplit(result.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(nlohmann::json::parse(lines[0])["state"], "running");
  EXPECT_EQ(nlohmann::json::parse(lines[1])["state"], "succeeded");
}

TEST_F(CliTest, WatchThatEndsEarlyAsksForTheOutcome) {
  jobs_.SetWatchUpdates("job-1", {RunningJob("job-1", 12, 1'700'000'010'000)});
  jobs_.SetJob(FinishedJob("job-1", v1::JOB_STATE_SUCCEEDED, ""));
  CliResult result = Run({"watch", "job-1"});
  EXPECT_EQ(result.code, 0) << result.err;
  EXPECT_THAT(result.out, HasSubstr("SUCCEEDED"));

  jobs_.SetJob(RunningJob("job-1", 13, 1'700'000'010'000));
  result = Run({"watch", "job-1"});
  EXPECT_EQ(result.code, 1);
  EXPECT_THAT(result.err, HasSubstr("ended the watch of job job-1 while it is RUNNING"));
}

TEST_F(CliTest, CancelSendsTheReason) {
  jobs_.SetJob(RunningJob("job-1", 12, 1'700'000'010'000));
  CliResult result = Run({"cancel", "job-1", "--reason", "wrong data"});
  EXPECT_EQ(result.code, 0) << result.err;
  EXPECT_EQ(result.out, "job job-1 cancelled\n");
  ASSERT_EQ(jobs_.cancels().size(), 1u);
  EXPECT_EQ(jobs_.cancels()[0].reason(), "wrong data");

  jobs_.SetJob(FinishedJob("job-2", v1::JOB_STATE_SUCCEEDED, ""));
  result = Run({"cancel", "job-2"});
  EXPECT_EQ(result.code, 0) << result.err;
  EXPECT_EQ(result.out, "job job-2 had already finished: SUCCEEDED\n");
}

TEST_F(CliTest, CancelJsonPrintsTheJobObject) {
  jobs_.SetJob(RunningJob("job-1", 12, 1'700'000'010'000));
  CliResult result = Run({"cancel", "job-1", "--reason", "wrong data", "--output", "json"});
  EXPECT_EQ(result.code, 0) << result.err;
  nlohmann::json json = nlohmann::json::parse(result.out);
  EXPECT_EQ(json["job_id"], "job-1");
  EXPECT_EQ(json["state"], "cancelled");
  EXPECT_EQ(json["reason"], "wrong data");
}

TEST_F(CliTest, UnknownJobIsNotFound) {
  for (const char* command : {"status", "watch", "cancel"}) {
    CliResult result = Run({command, "nope"});
    EXPECT_EQ(result.code, 1) << command;
    EXPECT_EQ(result.out, "") << command;
    EXPECT_EQ(result.err, "lathe: job nope not found\n") << command;
  }
}

TEST_F(CliTest, WorkersTableAndJson) {
  v1::ListWorkersResponse response;
  v1::WorkerStatus* w = response.add_workers();
  w->set_worker_id("host-a/0");
  w->set_state(v1::WORKER_STATE_READY);
  w->set_device(v1::DEVICE_CUDA);
  w->add_devices()->set_name("NVIDIA H200");
  w->set_slots(2);
  w->set_busy_slots(1);
  w->set_last_heartbeat_unix_ms(MillisAgo(absl::Seconds(2)));
  v1::SlotStatus* slot = w->add_running();
  slot->set_job_id("job-1");
  slot->set_rank(0);
  v1::WorkerStatus* lost = response.add_workers();
  lost->set_worker_id("host-b/0");
  lost->set_state(v1::WORKER_STATE_LOST);
  lost->set_slots(1);
  workers_.SetWorkers(response);

  CliResult result = Run({"workers"});
  ASSERT_EQ(result.code, 0) << result.err;
  std::vector<std::string> lines = absl::StrSplit(result.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << result.out;
  EXPECT_THAT(lines[0], MatchesRegex("ID +STATE +DEVICE +SLOTS +LAST HEARTBEAT +RUNNING"));
  EXPECT_THAT(lines[1], MatchesRegex("host-a/0 +READY +cuda \\(NVIDIA H200\\) +1/2 +[23]s ago +"
                                     "job-1 r0"));
  EXPECT_THAT(lines[2], MatchesRegex("host-b/0 +LOST +cpu +0/1 +- +-"));

  result = Run({"workers", "--output", "json"});
  ASSERT_EQ(result.code, 0) << result.err;
  nlohmann::json json = nlohmann::json::parse(result.out);
  ASSERT_EQ(json.size(), 2u);
  EXPECT_EQ(json[0]["worker_id"], "host-a/0");
  EXPECT_EQ(json[0]["state"], "ready");
  EXPECT_EQ(json[0]["device"], "cuda");
  EXPECT_EQ(json[0]["busy_slots"], 1);
  EXPECT_EQ(json[0]["running"][0]["job_id"], "job-1");
  EXPECT_EQ(json[1]["state"], "lost");
}

TEST_F(CliTest, GlobalFlagsMayFollowTheCommand) {
  jobs_.SetJob(FinishedJob("job-3", v1::JOB_STATE_SUCCEEDED, ""));
  CliResult result = RunLathe({"status", "job-3", "--output", "json", "--coordinator", address_});
  ASSERT_EQ(result.code, 0) << result.err;
  EXPECT_EQ(nlohmann::json::parse(result.out)["job_id"], "job-3");
}

TEST_F(CliTest, CoordinatorDefaultsToTheEnvironment) {
  jobs_.SetJob(FinishedJob("job-3", v1::JOB_STATE_SUCCEEDED, ""));
  ASSERT_EQ(setenv("LATHE_COORDINATOR", address_.c_str(), 1), 0);
  CliResult result = RunLathe({"status", "job-3"});
  unsetenv("LATHE_COORDINATOR");
  EXPECT_EQ(result.code, 0) << result.err;
  EXPECT_THAT(result.out, HasSubstr("SUCCEEDED"));
}

// ---------------------------------------------------------------------------------------
// The JSON schema of docs/cli-json.md, pinned: every key at every level and its JSON type.
// Changing these definitions changes what scripts rely on; fields may only be added.
//
// A definition is an object (exactly these keys), a one-element array (every element has
// that schema), or a type: "integer", "number", "string", "boolean", "object" (not pinned
// here: the spec, whose schema is docs/job-spec.md), "$name" (the definition `name`), with
// "|null" when null is allowed.
constexpr char kJsonSchema[] = R"({
  "memory": {
    "weights": "integer", "trainable": "integer", "gradients": "integer",
    "optimizer": "integer", "activations": "integer", "logits": "integer",
    "comm_buffers": "integer", "overhead": "integer", "total": "integer"
  },
  "progress": {
    "step": "integer", "total_steps": "integer", "loss": "number|null",
    "eval_loss": "number|null", "lr": "number", "grad_norm": "number",
    "tokens_per_second": "number", "mfu": "number", "products": "string", "skipped_steps": "integer",
    "loss_scale": "number", "step_seconds": "number",
    "phases": {"forward": "number", "loss": "number", "backward": "number", "comm": "number",
               "optimizer": "number"},
    "memory": "$memory", "updated_unix_ms": "integer"
  },
  "job": {
    "job_id": "string", "name": "string", "state": "string", "reason": "string",
    "owner": "string",
    "history": [{"state": "string", "unix_ms": "integer", "by": "string", "reason": "string"}],
    "submitted_unix_ms": "integer", "updated_unix_ms": "integer", "restarts": "integer",
    "restart_after_unix_ms": "integer",
    "spec": "object|null",
    "plan": {
      "ranks": "integer", "device": "string", "zero_stage": "integer",
      "offload_optimizer": "boolean", "offload_params": "boolean",
      "activation_checkpointing": "boolean", "chunked_loss": "boolean",
      "fused_kernels": "boolean", "micro_batch": "integer", "gradient_accumulation": "integer",
      "total_steps": "integer", "precision": "string", "predicted_memory": "$memory",
      "memory_correction": "number", "calibration_key": "string", "method": "string|null",
      "optimizer": "string|null", "explanation": "string"
    },
    "attempts": [{
      "generation": "integer", "state": "string",
      "placements": [{"rank": "integer", "worker_id": "string", "slot": "integer"}],
      "started_unix_ms": "integer", "ended_unix_ms": "integer", "error": "string",
      "progress": "$progress", "predicted_memory": "$memory", "peak_memory": "$memory",
      "failure": "string", "resumed_from_step": "integer", "profiles": ["$profile"]
    }],
    "progress": "$progress|null", "eta_seconds": "number|null", "final_loss": "number|null",
    "adapter_path": "string", "model_path": "string"
  },
  "profile": {
    "capture_id": "string", "state": "string", "ranks": ["integer"], "steps": "integer",
    "memory": "boolean", "error": "string", "requested_unix_ms": "integer",
    "ended_unix_ms": "integer", "requested_by": "string",
    "results": [{"rank": "integer", "first_step": "integer", "last_step": "integer",
                 "error": "string"}],
    "files": [{"rank": "integer", "name": "string", "size": "integer"}]
  },
  "plan_report": {
    "plan": "object", "tokens_per_second": "number", "memory_per_rank": "integer",
    "warnings": ["string"],
    "candidates": [{
      "zero_stage": "integer", "offload_optimizer": "boolean", "offload_params": "boolean",
      "activation_checkpointing": "boolean", "chunked_loss": "boolean",
      "micro_batch": "integer", "memory": "$memory", "host_memory": "integer",
      "step_seconds": "number", "fits": "boolean", "verdict": "string",
      "memory_correction": "number"
    }]
  },
  "plan_history": {
    "attempts": [{
      "job_id": "string", "generation": "integer", "state": "string",
      "ended_unix_ms": "integer", "calibration_key": "string", "predicted": "$memory",
      "memory_correction": "number", "measured": "$memory"
    }],
    "corrections": [{"calibration_key": "string", "factor": "number", "attempts": "integer"}]
  },
  "worker": {
    "worker_id": "string", "state": "string", "address": "string", "device": "string",
    "slots": "integer", "busy_slots": "integer",
    "devices": [{"index": "integer", "name": "string", "memory_bytes": "integer"}],
    "last_heartbeat_unix_ms": "integer",
    "running": [{"slot": "integer", "job_id": "string", "generation": "integer",
                 "rank": "integer"}]
  }
})";

// Checks `value` against the definition `schema`; appends what does not match to `errors`
// and the paths of nulls to `nulls`.
void CheckSchema(const nlohmann::json& value, const nlohmann::json& schema, const std::string& path,
                 std::vector<std::string>* errors, std::vector<std::string>* nulls) {
  static const nlohmann::json definitions = nlohmann::json::parse(kJsonSchema);
  if (schema.is_object()) {
    if (!value.is_object()) {
      errors->push_back(absl::StrCat(path, ": expected an object, got ", value.dump()));
      return;
    }
    for (const auto& [key, sub] : schema.items()) {
      if (!value.contains(key)) {
        errors->push_back(absl::StrCat(path, ": missing \"", key, "\""));
      } else {
        CheckSchema(value[key], sub, absl::StrCat(path, ".", key), errors, nulls);
      }
    }
    for (const auto& [key, sub] : value.items()) {
      if (!schema.contains(key)) errors->push_back(absl::StrCat(path, ": extra \"", key, "\""));
    }
    return;
  }
  if (schema.is_array()) {
    if (!value.is_array()) {
      errors->push_back(absl::StrCat(path, ": expected an array, got ", value.dump()));
      return;
    }
    for (size_t i = 0; i < value.size(); ++i) {
      CheckSchema(value[i], schema[0], absl::StrCat(path, "[", i, "]"), errors, nulls);
    }
    return;
  }
  std::string type = schema.get<std::string>();
  if (absl::EndsWith(type, "|null")) {
    type.resize(type.size() - 5);
    if (value.is_null()) {
      nulls->push_back(path);
      return;
    }
  }
  if (absl::StartsWith(type, "$")) {
    CheckSchema(value, definitions.at(type.substr(1)), path, errors, nulls);
    return;
  }
  const bool ok =
      (type == "integer" && value.is_number_integer()) || (type == "number" && value.is_number()) ||
      (type == "string" && value.is_string()) || (type == "boolean" && value.is_boolean()) ||
      (type == "object" && value.is_object());
  if (!ok) errors->push_back(absl::StrCat(path, ": expected ", type, ", got ", value.dump()));
}

struct SchemaCheck {
  std::vector<std::string> errors;
  std::vector<std::string> nulls;
};

SchemaCheck CheckAgainst(const nlohmann::json& value, const std::string& definition) {
  SchemaCheck check;
  CheckSchema(value, absl::StrCat("$", definition), "", &check.errors, &check.nulls);
  return check;
}

// --- `lathe profile` (issue #33) ---

// A running job of two ranks whose attempt has the given captures.
v1::JobStatus ProfiledJob(const std::string& id, const std::vector<v1::ProfileCapture>& captures) {
  v1::JobStatus job = RunningJob(id, 10, 1'700'000'100'000);
  for (const v1::ProfileCapture& c : captures) *job.mutable_attempts(0)->add_profiles() = c;
  return job;
}

v1::ProfileCapture Capture(const std::string& id, v1::ProfileState state,
                           const std::vector<std::pair<int64_t, std::string>>& files) {
  v1::ProfileCapture capture;
  capture.set_capture_id(id);
  capture.set_state(state);
  capture.add_ranks(0);
  capture.add_ranks(1);
  capture.set_steps(3);
  for (const auto& [rank, name] : files) {
    v1::ProfileFile* file = capture.add_files();
    file->set_rank(rank);
    file->set_name(name);
    file->set_size(10);
  }
  return capture;
}

TEST_F(CliTest, ProfileAsksTheCoordinatorAndSaysWhatComesNext) {
  CliResult result = Run({"profile", "job-1"});
  ASSERT_EQ(result.code, 0) << result.err;
  result = Run({"profile", "job-1", "--steps", "5", "--all-ranks", "--memory"});
  ASSERT_EQ(result.code, 0) << result.err;
  EXPECT_EQ(result.out,
            "capture prof-1 of job job-1 (attempt 1): the next 5 steps of ranks 0,1, with memory\n"
            "follow it with `lathe status job-1`; once DONE: `lathe profile --fetch job-1 DIR`\n");
  result = Run({"profile", "job-1", "--rank", "1", "--output", "json"});
  ASSERT_EQ(result.code, 0) << result.err;
  SchemaCheck check = CheckAgainst(nlohmann::json::parse(result.out), "profile");
  EXPECT_THAT(check.errors, IsEmpty()) << result.out;

  const std::vector<v1::ProfileJobRequest> sent = jobs_.profile_requests();
  ASSERT_EQ(sent.size(), 3u);
  EXPECT_EQ(sent[0].job_id(), "job-1");
  EXPECT_EQ(sent[0].steps(), 3);
  EXPECT_EQ(sent[0].rank(), 0);
  EXPECT_FALSE(sent[0].all_ranks());
  EXPECT_FALSE(sent[0].memory());
  EXPECT_EQ(sent[1].steps(), 5);
  EXPECT_TRUE(sent[1].all_ranks());
  EXPECT_TRUE(sent[1].memory());
  EXPECT_EQ(sent[2].rank(), 1);

  // The coordinator's refusal, on one line.
  jobs_.SetProfileError(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                     "job job-1 is queued, not running: only a running job can "
                                     "be profiled"));
  result = Run({"profile", "job-1"});
  EXPECT_EQ(result.code, 1);
  EXPECT_EQ(result.err,
            "lathe: job job-1 is queued, not running: only a running job can be profiled\n");
  jobs_.SetProfileError(grpc::Status(grpc::StatusCode::NOT_FOUND, "no job"));
  EXPECT_EQ(Run({"profile", "nope"}).err, "lathe: job nope not found\n");
}

TEST_F(CliTest, ProfileArgumentsThatDoNotFitAreRefusedWithOneLine) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"profile", "job-1", "--steps", "0"}, "lathe: --steps: must be in 1..20, got 0\n"},
      {{"profile", "job-1", "--steps", "21"}, "lathe: --steps: must be in 1..20, got 21\n"},
      {{"profile", "job-1", "--rank", "-1"}, "lathe: --rank: must be >= 0, got -1\n"},
      {{"profile", "job-1", "--rank", "1", "--all-ranks"},
       "lathe: --rank and --all-ranks: choose one\n"},
      {{"profile", "job-1", "--capture", "prof-1"}, "lathe: --capture: only with --fetch\n"},
      {{"profile", "--fetch", "job-1", "dir", "--steps", "3"},
       "lathe: --steps: not with --fetch\n"},
  };
  for (const auto& [args, err] : cases) {
    CliResult result = Run(args);
    EXPECT_EQ(result.code, 2) << absl::StrJoin(args, " ");
    EXPECT_EQ(result.err, err);
    EXPECT_EQ(result.out, "");
  }
  EXPECT_THAT(Run({"profile", "job-1", "--steps", "many"}).err, StartsWith("lathe: --steps"));
  CliResult missing = Run({"profile", "--fetch", "job-1"});
  EXPECT_EQ(missing.code, 2);
  EXPECT_THAT(missing.err, HasSubstr("missing argument: profile"));
  EXPECT_THAT(Run({"profile"}).err, HasSubstr("missing argument: profile"));
  EXPECT_THAT(jobs_.profile_requests(), IsEmpty()) << "nothing was sent";
}

TEST_F(CliTest, ProfileFetchDownloadsACaptureAndNeverOverwrites) {
  jobs_.SetJob(ProfiledJob(
      "job-1", {Capture("prof-1", v1::PROFILE_STATE_DONE, {{0, "trace.json"}, {1, "trace.json"}}),
                Capture("prof-2", v1::PROFILE_STATE_PENDING, {})}));
  jobs_.SetProfileFile("job-1", "prof-1", 0, "trace.json", "rank zero's trace");
  jobs_.SetProfileFile("job-1", "prof-1", 1, "trace.json", "rank one");
  const std::string out = dir_.Path("profiles");

  // The newest capture is still pending.
  CliResult result = Run({"profile", "--fetch", "job-1", out});
  EXPECT_EQ(result.code, 1);
  EXPECT_EQ(result.err,
            "lathe: capture prof-2 of job job-1 is still pending; fetch it once it is done "
            "(lathe status job-1)\n");

  result = Run({"profile", "--fetch", "job-1", out, "--capture", "prof-1"});
  ASSERT_EQ(result.code, 0) << result.err;
  EXPECT_EQ(*ReadFile(out + "/prof-1/rank-0/trace.json"), "rank zero's trace");
  EXPECT_EQ(*ReadFile(out + "/prof-1/rank-1/trace.json"), "rank one");
  EXPECT_THAT(result.out, HasSubstr("capture prof-1: 2 file(s)"));
  EXPECT_FALSE(std::filesystem::exists(out + "/prof-1/rank-0/trace.json.part"));

  // Again: nothing is overwritten.
  jobs_.SetProfileFile("job-1", "prof-1", 0, "trace.json", "changed");
  result = Run({"profile", "--fetch", "job-1", out, "--capture", "prof-1"});
  EXPECT_EQ(result.code, 1);
  EXPECT_EQ(result.err,
            absl::StrCat("lathe: ", out, "/prof-1/rank-0/trace.json exists; not overwritten\n"));
  EXPECT_EQ(*ReadFile(out + "/prof-1/rank-0/trace.json"), "rank zero's trace");

  EXPECT_EQ(Run({"profile", "--fetch", "job-1", out, "--capture", "prof-9"}).err,
            "lathe: job job-1 has no capture prof-9\n");
  // A name that is not a file name never leaves DIR.
  jobs_.SetJob(
      ProfiledJob("job-2", {Capture("prof-1", v1::PROFILE_STATE_DONE, {{0, "../../escape"}})}));
  result = Run({"profile", "--fetch", "job-2", out});
  EXPECT_EQ(result.code, 1);
  EXPECT_THAT(result.err, HasSubstr("is not a file name"));
  jobs_.SetJob(ProfiledJob("job-3", {}));
  EXPECT_EQ(Run({"profile", "--fetch", "job-3", out}).err,
            "lathe: job job-3 has no profile captures\n");
}

TEST_F(CliTest, StatusListsTheCaptures) {
  v1::ProfileCapture failed = Capture("prof-1", v1::PROFILE_STATE_FAILED, {{0, "trace.json"}});
  failed.set_error("rank 1: the profiler could not start");
  v1::ProfileCapture done = Capture("prof-2", v1::PROFILE_STATE_DONE, {{0, "trace.json"}});
  done.set_memory(true);
  v1::ProfileRankResult* r = done.add_results();
  r->set_rank(0);
  r->set_first_step(11);
  r->set_last_step(13);
  jobs_.SetJob(ProfiledJob("job-1", {failed, done}));
  CliResult result = Run({"status", "job-1"});
  ASSERT_EQ(result.code, 0) << result.err;
  EXPECT_THAT(result.out, HasSubstr("prof-1 FAILED  attempt #1  ranks 0,1  3 steps\n"));
  EXPECT_THAT(result.out, HasSubstr("  error: rank 1: the profiler could not start\n"));
  EXPECT_THAT(result.out,
              HasSubstr("prof-2 DONE  attempt #1  ranks 0,1  3 steps + memory (11-13)"));
  EXPECT_THAT(result.out, HasSubstr("  rank 0  trace.json  "));
}

// A job with every field of the API set, nested messages and repeated fields included
// (final_loss too, although a running job has none yet, to pin its type).
v1::JobStatus FullJob(const std::string& id) {
  v1::JobStatus job = RunningJob(id, 40, 1'700'000'060'000);
  v1::JobSpec* spec = job.mutable_spec();
  spec->mutable_model()->set_path("/models/tiny");
  spec->mutable_data()->set_train("/data/train.jsonl");
  spec->mutable_data()->set_eval("/data/eval.jsonl");
  spec->mutable_train()->set_steps(100);
  spec->mutable_train()->set_global_batch(4);
  spec->set_output("/runs/demo");
  job.set_reason("restarted after worker w-b was lost");
  job.set_restarts(1);
  job.set_final_loss(1.75);
  job.set_adapter_path("/runs/demo/adapter");
  job.set_model_path("/runs/demo/model");
  job.set_owner("alice");
  v1::StateChange* change = job.add_history();
  change->set_state(v1::JOB_STATE_QUEUED);
  change->set_by("alice (client)");
  change->set_reason("submitted");
  v1::Plan* plan = job.mutable_plan();
  plan->set_device(v1::DEVICE_CUDA);
  plan->mutable_strategy()->set_zero_stage(3);
  plan->mutable_strategy()->set_offload_optimizer(true);
  plan->mutable_strategy()->set_offload_params(true);
  plan->mutable_strategy()->set_activation_checkpointing(true);
  plan->mutable_strategy()->set_chunked_loss(true);
  plan->mutable_strategy()->set_fused_kernels(true);
  plan->mutable_strategy()->set_micro_batch(2);
  plan->set_gradient_accumulation(2);
  plan->set_precision(v1::PRECISION_BF16);
  plan->set_explanation("ZeRO-3: the weights do not fit one rank");
  plan->set_memory_correction(1.05);
  plan->set_calibration_key("llama h64 | lora | fp32 | ZeRO-3 | 2 x h100");
  plan->set_method(v1::METHOD_QLORA);  // as the planner's choice under strategy auto
  plan->set_optimizer(v1::OPTIMIZER_ADAMW_8BIT);
  v1::MemoryBreakdown* predicted = plan->mutable_predicted_memory();
  for (auto setter : {&v1::MemoryBreakdown::set_weights, &v1::MemoryBreakdown::set_trainable,
                      &v1::MemoryBreakdown::set_gradients, &v1::MemoryBreakdown::set_optimizer,
                      &v1::MemoryBreakdown::set_activations, &v1::MemoryBreakdown::set_logits,
                      &v1::MemoryBreakdown::set_comm_buffers, &v1::MemoryBreakdown::set_overhead,
                      &v1::MemoryBreakdown::set_total}) {
    (predicted->*setter)(5ull << 30);
  }
  v1::Attempt* attempt = job.mutable_attempts(0);
  attempt->set_started_unix_ms(1'700'000'001'000);
  attempt->set_ended_unix_ms(1'700'000'002'000);
  attempt->set_state(v1::ATTEMPT_STATE_FAILED);
  attempt->set_error("worker w-b lost");
  attempt->set_failure(v1::FAILURE_KIND_INFRASTRUCTURE);
  attempt->set_resumed_from_step(20);
  for (int64_t rank : {0, 1}) {
    v1::RankPlacement* placement = attempt->add_placements();
    placement->set_rank(rank);
    placement->set_worker_id(rank == 0 ? "w-a" : "w-b");
    placement->set_slot(rank);
  }
  v1::Progress* p = attempt->mutable_progress();
  p->set_eval_loss(2.75);
  p->set_lr(2e-4);
  p->set_grad_norm(0.5);
  p->set_mfu(0.4);
  p->set_products("onednn f32 brg:avx512_core, bf16 widened to f32");
  p->set_skipped_steps(1);
  p->set_loss_scale(65536);
  p->set_step_seconds(0.25);
  p->mutable_phases()->set_forward(0.1);
  p->mutable_phases()->set_loss(0.02);
  p->mutable_phases()->set_backward(0.1);
  p->mutable_phases()->set_comm(0.01);
  p->mutable_phases()->set_optimizer(0.02);
  *p->mutable_memory() = *predicted;
  *attempt->mutable_predicted_memory() = *predicted;
  *attempt->mutable_peak_memory() = *predicted;
  v1::ProfileCapture* capture = attempt->add_profiles();
  capture->set_capture_id("prof-1");
  capture->set_state(v1::PROFILE_STATE_DONE);
  capture->add_ranks(0);
  capture->set_steps(3);
  capture->set_memory(true);
  capture->set_requested_unix_ms(1'700'000'001'500);
  capture->set_ended_unix_ms(1'700'000'001'900);
  capture->set_requested_by("alice (client)");
  v1::ProfileRankResult* answered = capture->add_results();
  answered->set_rank(0);
  answered->set_first_step(21);
  answered->set_last_step(23);
  v1::ProfileFile* file = capture->add_files();
  file->set_rank(0);
  file->set_name("trace.json");
  file->set_size(2048);
  v1::Attempt second = *attempt;
  second.set_generation(2);
  second.set_state(v1::ATTEMPT_STATE_RUNNING);
  second.set_ended_unix_ms(0);
  second.clear_error();
  *job.add_attempts() = second;
  return job;
}

v1::PlanJobResponse APlan() {
  v1::PlanJobResponse response;
  v1::Plan* plan = response.mutable_plan();
  plan->set_ranks(1);
  plan->mutable_strategy()->set_micro_batch(4);
  plan->set_gradient_accumulation(1);
  plan->set_total_steps(10);
  plan->set_explanation("planner: ZeRO-0, micro-batch 4, the fastest of 2");
  plan->set_method(v1::METHOD_QLORA);  // chosen by the planner: said in the plan's text
  plan->mutable_predicted_memory()->set_weights(3ull << 30);
  plan->mutable_predicted_memory()->set_total(4ull << 30);
  plan->set_memory_correction(1.25);
  response.set_tokens_per_second(1500);
  response.set_memory_per_rank(16ull << 30);
  response.add_warnings("needs 2 cpu slots at once; 1 registered: it would wait");
  v1::PlanCandidate* chosen = response.add_candidates();
  chosen->mutable_strategy()->set_micro_batch(4);
  *chosen->mutable_memory() = plan->predicted_memory();
  chosen->set_memory_correction(1.25);
  chosen->set_step_seconds(0.5);
  chosen->set_fits(true);
  chosen->set_verdict("chosen");
  v1::PlanCandidate* other = response.add_candidates();
  other->mutable_strategy()->set_micro_batch(1);
  other->mutable_strategy()->set_activation_checkpointing(true);
  other->mutable_memory()->set_total(2ull << 30);
  other->set_memory_correction(1);
  other->set_step_seconds(0.75);
  other->set_fits(true);
  other->set_verdict("50% slower (compute)");
  return response;
}

TEST_F(CliTest, PlanAsksTheCoordinatorAndPrintsTheChoiceAndTheAlternatives) {
  jobs_.SetPlan(APlan());
  const std::string spec_path = WriteSpec(kRelativeSpec);
  CliResult result = Run({"plan", spec_path});
  ASSERT_EQ(result.code, 0) << result.err;
  ASSERT_EQ(jobs_.plan_requests().size(), 1u);
  EXPECT_EQ(jobs_.plan_requests()[0].spec().model().path(),
            std::filesystem::current_path().string() + "/models/tiny");
  EXPECT_THAT(result.out, AllOf(HasSubstr("1500 tokens/s; peak 5.00 GiB per rank of 16.0 GiB"),
                                HasSubstr("QLoRA (NF4 frozen projections)"),
                                HasSubstr("warning      needs 2 cpu slots at once; 1 registered"),
                                HasSubstr("planned (x1.250)  5.00 GiB"),
                                HasSubstr("50% slower (compute)"), HasSubstr("chosen")));
  // The chosen row's peak is the corrected one.
  EXPECT_THAT(result.out,
              HasSubstr("0     -        off   logits  4      5.00 GiB   0.5 s   chosen"));

  result = Run({"plan", spec_path, "--output", "json"});
  ASSERT_EQ(result.code, 0) << result.err;
  SchemaCheck check = CheckAgainst(nlohmann::json::parse(result.out), "plan_report");
  EXPECT_THAT(check.errors, IsEmpty());

  jobs_.SetPlan({}, grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                 "spec: nothing fits: the smallest configuration needs 9 GiB"));
  result = Run({"plan", spec_path});
  EXPECT_EQ(result.code, 1);
  EXPECT_EQ(result.err, "lathe: spec: nothing fits: the smallest configuration needs 9 GiB\n");
}

TEST_F(CliTest, PlanHistoryShowsTheErrorsAndTheCorrections) {
  v1::GetPlanHistoryResponse history;
  for (int i = 0; i < 2; ++i) {
    v1::PlanHistoryEntry* e = history.add_attempts();
    e->set_job_id(absl::StrCat("job-", i));
    e->set_generation(1);
    e->set_state(v1::ATTEMPT_STATE_SUCCEEDED);
    e->set_calibration_key("k");
    e->mutable_predicted()->set_total(100ull << 20);
    e->set_memory_correction(i == 0 ? 1.1 : 1.0);
    e->mutable_measured()->set_total((i == 0 ? 110ull : 104ull) << 20);
  }
  v1::MemoryCorrection* c = history.add_corrections();
  c->set_calibration_key("llama h64 | lora | fp32 | ZeRO-0 fused | 1 x cpu");
  c->set_factor(1.07);
  c->set_attempts(2);
  jobs_.SetHistory(history);

  CliResult result = Run({"plan", "--history", "--limit", "5"});
  ASSERT_EQ(result.code, 0) << result.err;
  EXPECT_EQ(jobs_.history_limits(), std::vector<int32_t>{5});
  EXPECT_THAT(
      result.out,
      AllOf(HasSubstr("job-0  #1       SUCCEEDED  100 MiB    110 MiB  110 MiB   -9.1%      "
                      "+0.0%"),
            HasSubstr("2 attempts; memory model: median |error| 6.5%, worst -9.1%; as "
                      "planned: median |error| 1.9%, worst -3.8%"),
            HasSubstr("1.070   2         llama h64 | lora | fp32 | ZeRO-0 fused | 1 x cpu")));

  result = Run({"plan", "--history", "--output", "json"});
  ASSERT_EQ(result.code, 0) << result.err;
  SchemaCheck check = CheckAgainst(nlohmann::json::parse(result.out), "plan_history");
  EXPECT_THAT(check.errors, IsEmpty());

  result = Run({"plan", "--history", "job.yaml"});
  EXPECT_EQ(result.code, 2);
  EXPECT_THAT(result.err, HasSubstr("unexpected argument \"job.yaml\""));
  result = Run({"plan", "--history", "--limit", "0"});
  EXPECT_EQ(result.code, 1);
  EXPECT_EQ(result.err, "lathe: --limit: must be 1 to 1000, got 0\n");
  jobs_.SetHistory({});
  result = Run({"plan", "--history"});
  EXPECT_THAT(result.out, HasSubstr("no measured attempts yet"));
}

TEST_F(CliTest, JsonSchemaOfStatus) {
  jobs_.SetJob(FullJob("job-full"));
  v1::JobStatus empty;
  empty.set_job_id("job-empty");
  jobs_.SetJob(empty);

  CliResult result = Run({"status", "job-full", "--output", "json"});
  ASSERT_EQ(result.code, 0) << result.err;
  nlohmann::json json = nlohmann::json::parse(result.out);
  SchemaCheck check = CheckAgainst(json, "job");
  EXPECT_THAT(check.errors, IsEmpty()) << result.out;
  EXPECT_THAT(check.nulls, IsEmpty()) << result.out;
  ASSERT_EQ(json["attempts"].size(), 2u);
  EXPECT_EQ(json["attempts"][0]["placements"].size(), 2u);
  EXPECT_EQ(json["eta_seconds"], 15.0);  // 60 steps of 0.25 s
  EXPECT_EQ(json["plan"]["method"], "qlora");
  EXPECT_EQ(json["plan"]["optimizer"], "adamw8bit");

  result = Run({"status", "job-empty", "--output", "json"});
  ASSERT_EQ(result.code, 0) << result.err;
  json = nlohmann::json::parse(result.out);
  check = CheckAgainst(json, "job");
  EXPECT_THAT(check.errors, IsEmpty()) << result.out;
  EXPECT_THAT(check.nulls, UnorderedElementsAre(".spec", ".progress", ".eta_seconds", ".final_loss",
                                                ".plan.method", ".plan.optimizer"))
      << result.out;
  EXPECT_EQ(json["state"], "unknown");
  EXPECT_EQ(json["plan"]["device"], "cpu");
  EXPECT_EQ(json["plan"]["precision"], "fp32");
  EXPECT_EQ(json["attempts"], nlohmann::json::array());
  EXPECT_EQ(json["restarts"], 0);
}

TEST_F(CliTest, JsonSchemaOfWorkers) {
  v1::ListWorkersResponse response;
  v1::WorkerStatus* full = response.add_workers();
  full->set_worker_id("host-a/0");
  full->set_state(v1::WORKER_STATE_READY);
  full->set_address("host-a:9100");
  full->set_device(v1::DEVICE_CUDA);
  full->set_slots(2);
  full->set_busy_slots(1);
  for (int64_t index : {0, 1}) {
    v1::DeviceInfo* device = full->add_devices();
    device->set_index(index);
    device->set_name("NVIDIA H200");
    device->set_memory_bytes(141ull << 30);
  }
  full->set_last_heartbeat_unix_ms(1'700'000'000'000);
  v1::SlotStatus* slot = full->add_running();
  slot->set_slot(1);
  slot->set_job_id("job-1");
  slot->set_generation(2);
  slot->set_rank(1);
  response.add_workers();  // every field zero
  workers_.SetWorkers(response);

  CliResult result = Run({"workers", "--output", "json"});
  ASSERT_EQ(result.code, 0) << result.err;
  nlohmann::json json = nlohmann::json::parse(result.out);
  ASSERT_TRUE(json.is_array());
  ASSERT_EQ(json.size(), 2u);
  for (const nlohmann::json& worker : json) {
    SchemaCheck check = CheckAgainst(worker, "worker");
    EXPECT_THAT(check.errors, IsEmpty()) << worker.dump();
    EXPECT_THAT(check.nulls, IsEmpty()) << worker.dump();
  }
  EXPECT_EQ(json[0]["devices"][1]["memory_bytes"], 141ull << 30);
  EXPECT_EQ(json[1]["state"], "unknown");
  EXPECT_EQ(json[1]["devices"], nlohmann::json::array());
}

TEST_F(CliTest, EveryJobCommandPrintsTheJobObject) {
  jobs_.SetJob(FullJob("job-full"));
  v1::ListJobsResponse page;
  *page.add_jobs() = FullJob("job-full");
  jobs_.SetPages({page});
  jobs_.SetWatchUpdates(
      "job-full", {FullJob("job-full"), FinishedJob("job-full", v1::JOB_STATE_SUCCEEDED, "")});
  std::vector<nlohmann::json> objects;
  CliResult result = Run({"--output", "json", "submit", WriteSpec(kRelativeSpec)});
  ASSERT_EQ(result.code, 0) << result.err;
  objects.push_back(nlohmann::json::parse(result.out));
  result = Run({"--output", "json", "list"});
  ASSERT_EQ(result.code, 0) << result.err;
  for (const nlohmann::json& job : nlohmann::json::parse(result.out)) objects.push_back(job);
  result = Run({"--output", "json", "watch", "job-full"});
  ASSERT_EQ(result.code, 0) << result.err;
  for (absl::string_view line : absl::StrSplit(result.out, '\n', absl::SkipEmpty())) {
    objects.push_back(nlohmann::json::parse(line));
  }
  result = Run({"--output", "json", "cancel", "job-full"});
  ASSERT_EQ(result.code, 0) << result.err;
  objects.push_back(nlohmann::json::parse(result.out));

  ASSERT_EQ(objects.size(), 5u);
  for (const nlohmann::json& job : objects) {
    EXPECT_THAT(CheckAgainst(job, "job").errors, IsEmpty()) << job.dump();
  }
  // watch's lines are the status objects, ETA included.
  EXPECT_EQ(objects[2]["eta_seconds"], 15.0);
  EXPECT_TRUE(objects[3]["eta_seconds"].is_null());
}

// A port on 127.0.0.1 that is bound but not listening: connecting to it is refused, and no
// other process can take it while `fd` stays open.
class ClosedPort {
 public:
  ClosedPort() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    if (fd_ >= 0 && bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) == 0 &&
        getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port_ = ntohs(addr.sin_port);
    }
  }
  ~ClosedPort() {
    if (fd_ >= 0) close(fd_);
  }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(CliUnreachableTest, EveryCommandFailsWithOneLine) {
  ClosedPort closed;
  ASSERT_GT(closed.port(), 0);
  const std::string address = absl::StrCat("127.0.0.1:", closed.port());
  testing::TempDir dir;
  const std::string spec = dir.Write("job.yaml", kRelativeSpec);
  const std::vector<std::vector<std::string>> commands = {{"submit", spec},    {"list"},
                                                          {"status", "job-1"}, {"watch", "job-1"},
                                                          {"cancel", "job-1"}, {"workers"}};
  for (std::vector<std::string> args : commands) {
    args.insert(args.begin(), {"--coordinator", address});
    CliResult result = RunLathe(args);
    EXPECT_EQ(result.code, 1) << args[2];
    EXPECT_EQ(result.out, "") << args[2];
    EXPECT_THAT(result.err,
                StartsWith(absl::StrCat("lathe: cannot reach the coordinator at ", address, ": ")))
        << args[2];
    EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
  }
}

TEST(CliWrongServerTest, AServerWithoutJobServiceIsReported) {
  FakeWorkerService workers;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&workers);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  const std::string address = absl::StrCat("127.0.0.1:", port);
  CliResult result = RunLathe({"--coordinator", address, "list"});
  EXPECT_EQ(result.code, 1);
  EXPECT_THAT(result.err, StartsWith(absl::StrCat("lathe: the server at ", address,
                                                  " does not serve this call")));
  server->Shutdown(absl::ToChronoTime(absl::Now()));
}

TEST(CliUsageTest, UsageErrorsExitTwo) {
  const std::vector<std::vector<std::string>> cases = {
      {},
      {"frobnicate"},
      {"--verbose", "list"},
      {"list", "--verbose"},
      {"status"},
      {"status", "a", "b"},
      {"submit"},
      {"watch", "job-1", "--output", "yaml"},
      {"cancel", "job-1", "--reason"},
      {"--coordinator"},
      {"list", "--state"},
  };
  for (const std::vector<std::string>& args : cases) {
    CliResult result = RunLathe(args);
    const std::string joined = absl::StrJoin(args, " ");
    EXPECT_EQ(result.code, 2) << joined;
    EXPECT_EQ(result.out, "") << joined;
    EXPECT_THAT(result.err, StartsWith("lathe: ")) << joined;
    EXPECT_THAT(result.err, HasSubstr("usage: lathe")) << joined;
  }
  EXPECT_THAT(RunLathe({"frobnicate"}).err, HasSubstr("unknown command \"frobnicate\""));
  EXPECT_THAT(RunLathe({"list", "--verbose"}).err, HasSubstr("unknown flag --verbose"));
  EXPECT_THAT(RunLathe({"status"}).err, HasSubstr("missing argument: status ID"));
}

TEST(CliUsageTest, HelpExitsZero) {
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"--help"}, {"help"}, {"-h"}, {"watch", "--help"}}) {
    CliResult result = RunLathe(args);
    EXPECT_EQ(result.code, 0);
    EXPECT_THAT(result.out, HasSubstr("usage: lathe"));
    EXPECT_EQ(result.err, "");
  }
  EXPECT_THAT(RunLathe({"--help"}).out,
              AllOf(HasSubstr("submit"), HasSubstr("list"), HasSubstr("status"), HasSubstr("watch"),
                    HasSubstr("cancel"), HasSubstr("workers")));
}

}  // namespace
}  // namespace lathe
