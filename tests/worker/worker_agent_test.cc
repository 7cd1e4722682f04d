#include "worker/agent/worker_agent.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "common/plan.h"
#include "common/proto/job_spec_proto.h"
#include "common/proto/trainer_io.h"
#include "gmock/gmock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "lathe/v1/coordinator.grpc.pb.h"
#include "tests/testing/default_plan.h"
#include "tests/testing/temp_dir.h"
#include "tests/worker/agent_test_util.h"
#include "worker/agent/agent_main.h"
#include "worker/agent/process_launcher.h"
#include "zlib.h"

namespace lathe {
namespace {

using testing::DoneLine;
using ::testing::HasSubstr;
using testing::kWaitLimit;
using testing::StartLine;
using testing::StepLine;
using testing::WriteScript;

// A coordinator's WorkerService that records what the agent sends and answers heartbeats
// with whatever the test queued.
class FakeWorkerService final : public v1::WorkerService::Service {
 public:
  grpc::Status RegisterWorker(grpc::ServerContext*, const v1::RegisterWorkerRequest* request,
                              v1::RegisterWorkerResponse* response) override {
    absl::MutexLock lock(&mu_);
    ++registration_attempts_;
    if (failing_registrations_ > 0) {
      --failing_registrations_;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator starting");
    }
    registrations_.push_back(*request);
    session_ = absl::StrCat("session-", registrations_.size());
    response->set_worker_id(request->worker_id());
    response->set_session_id(session_);
    response->set_heartbeat_interval_ms(20);
    response->set_heartbeat_timeout_ms(heartbeat_timeout_ms_);
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<v1::HeartbeatResponse, v1::HeartbeatRequest>* stream) override {
    v1::HeartbeatRequest request;
    while (stream->Read(&request)) {
      v1::HeartbeatResponse response;
      {
        absl::MutexLock lock(&mu_);
        heartbeats_.push_back(request);
        if (request.session_id() != session_) {
          return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                              "unknown or expired session; register again");
        }
        if (silent_) continue;  // a hung coordinator: reads, never answers
        for (v1::Assignment& a : assignments_) *response.add_assignments() = std::move(a);
        assignments_.clear();
        for (v1::Cancellation& c : cancellations_) *response.add_cancellations() = std::move(c);
        cancellations_.clear();
        for (v1::ProfileOrder& o : profile_orders_) *response.add_profiles() = std::move(o);
        profile_orders_.clear();
      }
      if (!stream->Write(response)) break;
    }
    return grpc::Status::OK;
  }

  grpc::Status ReportProgress(grpc::ServerContext*, const v1::ReportProgressRequest* request,
                              v1::ReportProgressResponse*) override {
    absl::MutexLock lock(&mu_);
    if (failing_reports_ > 0) {
      --failing_reports_;
      return grpc::Status(report_failure_, "report refused");
    }
    reports_.push_back(*request);
    calls_.push_back(absl::StrCat("progress ", v1::RankEvent_Name(request->event())));
    return grpc::Status::OK;
  }

  grpc::Status UploadProfile(grpc::ServerContext*, const v1::UploadProfileRequest* request,
                             v1::UploadProfileResponse* response) override {
    absl::MutexLock lock(&mu_);
    uploads_.push_back(*request);
    std::string& file = uploaded_[request->name()];
    if (request->offset() != static_cast<int64_t>(file.size())) {
      return grpc::Status(grpc::StatusCode::OUT_OF_RANGE, "not contiguous");
    }
    file += request->data();
    response->set_size(static_cast<int64_t>(file.size()));
    return grpc::Status::OK;
  }

  grpc::Status ReportProfile(grpc::ServerContext*, const v1::ReportProfileRequest* request,
                             v1::ReportProfileResponse*) override {
    absl::MutexLock lock(&mu_);
    profile_reports_.push_back(*request);
    calls_.push_back("profile");
    return grpc::Status::OK;
  }

  // --- what the test does ---------------------------------------------------------------

  void Assign(v1::Assignment assignment) {
    absl::MutexLock lock(&mu_);
    assignments_.push_back(std::move(assignment));
  }
  void Cancel(const std::string& job_id, int64_t generation) {
    absl::MutexLock lock(&mu_);
    v1::Cancellation& c = cancellations_.emplace_back();
    c.set_job_id(job_id);
    c.set_generation(generation);
    c.set_reason("cancelled by the test");
  }
  void Profile(v1::ProfileOrder order) {
    absl::MutexLock lock(&mu_);
    profile_orders_.push_back(std::move(order));
  }
  std::vector<v1::UploadProfileRequest> Uploads() {
    absl::MutexLock lock(&mu_);
    return uploads_;
  }
  std::map<std::string, std::string> Uploaded() {
    absl::MutexLock lock(&mu_);
    return uploaded_;
  }
  std::vector<v1::ReportProfileRequest> ProfileReports() {
    absl::MutexLock lock(&mu_);
    return profile_reports_;
  }
  // "profile" and "progress <event>", in the order they arrived.
  std::vector<std::string> Calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  size_t profile_report_count() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return profile_reports_.size();
  }
  // As if the coordinator restarted: the current session is unknown from now on.
  void ForgetSessions() {
    absl::MutexLock lock(&mu_);
    session_.clear();
  }
  // Heartbeats go unanswered while `silent`; the agent should give up on the stream after
  // the heartbeat timeout it was told at registration.
  void SetSilent(bool silent, int64_t heartbeat_timeout_ms) {
    absl::MutexLock lock(&mu_);
    silent_ = silent;
    heartbeat_timeout_ms_ = heartbeat_timeout_ms;
  }
  void FailRegistrations(int count) {
    absl::MutexLock lock(&mu_);
    failing_registrations_ = count;
  }
  void FailReports(int count, grpc::StatusCode code) {
    absl::MutexLock lock(&mu_);
    failing_reports_ = count;
    report_failure_ = code;
  }

  // Waits until `predicate` holds over the recorded calls; false after kWaitLimit.
  bool WaitUntil(const std::function<bool(const FakeWorkerService&)>& predicate) {
    absl::MutexLock lock(&mu_);
    auto holds = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return predicate(*this); };
    return mu_.AwaitWithTimeout(absl::Condition(&holds), kWaitLimit);
  }

  // The recorded calls; read them in WaitUntil predicates or through the copies below.
  const std::vector<v1::RegisterWorkerRequest>& registrations() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return registrations_;
  }
  const std::vector<v1::HeartbeatRequest>& heartbeats() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return heartbeats_;
  }
  const std::vector<v1::ReportProgressRequest>& reports() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return reports_;
  }
  int registration_attempts() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return registration_attempts_;
  }
  const std::string& session() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return session_; }

  std::vector<v1::ReportProgressRequest> ReportsFor(const std::string& job_id) {
    absl::MutexLock lock(&mu_);
    std::vector<v1::ReportProgressRequest> found;
    for (const auto& r : reports_) {
      if (r.job_id() == job_id) found.push_back(r);
    }
    return found;
  }
  std::vector<v1::RegisterWorkerRequest> Registrations() {
    absl::MutexLock lock(&mu_);
    return registrations_;
  }
  size_t HeartbeatCount() {
    absl::MutexLock lock(&mu_);
    return heartbeats_.size();
  }

 private:
  mutable absl::Mutex mu_;
  std::string session_ ABSL_GUARDED_BY(mu_);
  int registration_attempts_ ABSL_GUARDED_BY(mu_) = 0;
  bool silent_ ABSL_GUARDED_BY(mu_) = false;
  int64_t heartbeat_timeout_ms_ ABSL_GUARDED_BY(mu_) = 30000;
  int failing_registrations_ ABSL_GUARDED_BY(mu_) = 0;
  int failing_reports_ ABSL_GUARDED_BY(mu_) = 0;
  grpc::StatusCode report_failure_ ABSL_GUARDED_BY(mu_) = grpc::StatusCode::UNAVAILABLE;
  std::vector<v1::RegisterWorkerRequest> registrations_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::HeartbeatRequest> heartbeats_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ReportProgressRequest> reports_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::Assignment> assignments_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::Cancellation> cancellations_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ProfileOrder> profile_orders_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::UploadProfileRequest> uploads_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> uploaded_ ABSL_GUARDED_BY(mu_);  // name -> bytes
  std::vector<v1::ReportProfileRequest> profile_reports_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> calls_ ABSL_GUARDED_BY(mu_);
};

// True when `reports` hold an event of `kind`.
bool Has(const std::vector<v1::ReportProgressRequest>& reports, v1::RankEvent kind) {
  for (const auto& r : reports) {
    if (r.event() == kind) return true;
  }
  return false;
}

// A report for `job_id` with `kind` has arrived.
std::function<bool(const FakeWorkerService&)> Reported(const std::string& job_id,
                                                       v1::RankEvent kind) {
  return [job_id, kind](const FakeWorkerService& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (const auto& r : s.reports()) {
      if (r.job_id() == job_id && r.event() == kind) return true;
    }
    return false;
  };
}

// A heartbeat after the first `after` ones shows `job_id` in `slot` (or the slot idle, for
// an empty job id).
std::function<bool(const FakeWorkerService&)> HeartbeatShows(int64_t slot,
                                                             const std::string& job_id,
                                                             size_t after = 0) {
  return [=](const FakeWorkerService& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (size_t i = after; i < s.heartbeats().size(); ++i) {
      for (const v1::SlotStatus& status : s.heartbeats()[i].slots()) {
        if (status.slot() == slot && status.job_id() == job_id) return true;
      }
    }
    return false;
  };
}

// The trainer for every test here: what it does depends on its job id's prefix.
constexpr char kTrainerScript[] = R"sh(
# The run directory <job>-g<generation>-r<rank> holds the task.
job=""
while [ $# -gt 0 ]; do
  case "$1" in --task) job=$(basename "$(dirname "$2")"); run=$(dirname "$2"); shift;; esac
  shift
done
echo 'START'
case "$job" in
  ok*)
    echo 'STEP1'
    echo 'STEP2'
    echo 'DONE'
    exit 0;;
  profile*)
    # As the real trainer does: waits for the request, writes the capture where it is told,
    # removes the request and answers with a "profile" event.
    while [ ! -f "$run/profile/request.json" ]; do sleep 0.05; done
    id=$(sed -n 's/.*"capture_id": *"\([^"]*\)".*/\1/p' "$run/profile/request.json")
    mkdir -p "$run/profile/$id"
    printf 'trace of %s' "$id" > "$run/profile/$id/trace.json"
    head -c 2500000 /dev/urandom > "$run/profile/$id/big.bin"
    rm "$run/profile/request.json"
    echo "{\"profile\": {\"capture_id\": \"$id\", \"first_step\": 3, \"last_step\": 5, \"files\": [\"$run/profile/$id/trace.json\", \"$run/profile/$id/big.bin\"]}}"
    echo 'PROFILED_END'
    exit 0;;
  killed*)
    echo 'about to be killed' >&2
    kill -9 $$;;
  *)
    while :; do sleep 1; done;;
esac
)sh";

std::string TrainerScriptBody() {
  std::string body = kTrainerScript;
  auto replace = [&](const std::string& from, const std::string& to) {
    body.replace(body.find(from), from.size(), to);
  };
  replace("START", StartLine(2));
  replace("STEP1", StepLine(1, 2, "2.5"));
  replace("STEP2", StepLine(2, 2, "2.3"));
  replace("DONE", DoneLine(2, "2.25", "/runs/out/adapter"));
  replace("PROFILED_END", DoneLine(2, "2.25", "/runs/out/adapter"));
  return body;
}

v1::Assignment MakeAssignment(const std::string& job_id, int64_t generation, int64_t rank,
                              int64_t slot) {
  v1::Assignment a;
  a.set_job_id(job_id);
  a.set_generation(generation);
  a.set_rank(rank);
  a.set_world_size(rank + 1);
  a.set_slot(slot);
  a.mutable_spec()->set_name(job_id);
  a.mutable_spec()->mutable_model()->set_path("/models/m");
  a.mutable_spec()->mutable_data()->set_train("/data/train.jsonl");
  a.mutable_spec()->set_output("/runs/out");
  return a;
}

class WorkerAgentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }

  void TearDown() override {
    StopAgent().IgnoreError();  // a test that cares checks it itself
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  WorkerAgentOptions Options() {
    WorkerAgentOptions options;
    options.worker_id = "host-cpu";
    options.device = v1::DEVICE_CPU;
    options.slots = 2;
    v1::DeviceInfo cpu;
    cpu.set_name("cpu");
    cpu.set_memory_bytes(1 << 30);
    options.devices = {cpu, cpu};
    options.host_memory_bytes = 2u << 30;
    options.version = "test";
    options.trainer.trainer_binary = WriteScript(dir_, "trainer.sh", TrainerScriptBody());
    options.trainer.work_dir = dir_.Path("work");
    options.trainer.coordinator_address = absl::StrCat("127.0.0.1:", port_);
    options.trainer.cancel_grace = absl::Seconds(10);
    options.reconnect.initial_backoff = absl::Milliseconds(10);
    options.reconnect.max_backoff = absl::Milliseconds(100);
    options.reporter.retry = options.reconnect;
    return options;
  }

  void StartAgent(WorkerAgentOptions options, const std::string& address = "") {
    channel_ = CoordinatorChannel(address.empty() ? absl::StrCat("127.0.0.1:", port_) : address);
    stub_ = v1::WorkerService::NewStub(channel_);
    agent_ = std::make_unique<WorkerAgent>(std::move(options), stub_.get(), &launcher_, &clock_);
    runner_ = std::thread([this] { run_status_ = agent_->Run(); });
  }

  // Shuts the agent down and returns what Run returned.
  absl::Status StopAgent() {
    if (agent_ == nullptr) return absl::OkStatus();
    agent_->Shutdown();
    runner_.join();
    agent_.reset();
    return run_status_;
  }

  testing::TempDir dir_;
  FakeWorkerService service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  PosixProcessLauncher launcher_;
  FakeClock clock_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::WorkerService::Stub> stub_;
  std::unique_ptr<WorkerAgent> agent_;
  std::thread runner_;
  absl::Status run_status_;
};

TEST_F(WorkerAgentTest, RegistersAndHeartbeatsItsSlots) {
  StartAgent(Options());
  ASSERT_TRUE(service_.WaitUntil([](const FakeWorkerService& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return s.heartbeats().size() >= 3;
  }));
  std::vector<v1::RegisterWorkerRequest> registrations = service_.Registrations();
  ASSERT_EQ(registrations.size(), 1u);
  const v1::RegisterWorkerRequest& r = registrations[0];
  EXPECT_EQ(r.worker_id(), "host-cpu");
  EXPECT_EQ(r.device(), v1::DEVICE_CPU);
  EXPECT_EQ(r.slots(), 2);
  EXPECT_EQ(r.devices_size(), 2);
  EXPECT_EQ(r.host_memory_bytes(), 2u << 30);
  EXPECT_EQ(r.version(), "test");
  ASSERT_TRUE(service_.WaitUntil([](const FakeWorkerService& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    const v1::HeartbeatRequest& h = s.heartbeats().back();
    return h.worker_id() == "host-cpu" && h.session_id() == "session-1" && h.slots_size() == 2 &&
           h.slots(0).slot() == 0 && h.slots(0).job_id().empty() && h.slots(1).slot() == 1 &&
           h.slots(1).job_id().empty();
  }));
  EXPECT_TRUE(StopAgent().ok());
}

TEST_F(WorkerAgentTest, RunsAnAssignmentAndReportsSuccess) {
  StartAgent(Options());
  service_.Assign(MakeAssignment("ok-1", /*generation=*/3, /*rank=*/1, /*slot=*/1));
  ASSERT_TRUE(service_.WaitUntil(Reported("ok-1", v1::RANK_EVENT_SUCCEEDED)));
  std::vector<v1::ReportProgressRequest> reports = service_.ReportsFor("ok-1");
  ASSERT_GE(reports.size(), 2u);
  EXPECT_EQ(reports.front().event(), v1::RANK_EVENT_STARTED);
  EXPECT_TRUE(Has(reports, v1::RANK_EVENT_PROGRESS));
  for (const auto& r : reports) {
    EXPECT_EQ(r.worker_id(), "host-cpu");
    EXPECT_EQ(r.generation(), 3);
    EXPECT_EQ(r.rank(), 1);
  }
  const v1::ReportProgressRequest& end = reports.back();
  EXPECT_EQ(end.event(), v1::RANK_EVENT_SUCCEEDED);
  EXPECT_EQ(end.adapter_path(), "/runs/out/adapter");
  EXPECT_EQ(end.progress().step(), 2);
  ASSERT_TRUE(end.progress().has_loss());
  EXPECT_DOUBLE_EQ(end.progress().loss(), 2.25);
  EXPECT_EQ(end.error(), "");
  // The slot is idle again once the end was reported.
  size_t seen = service_.HeartbeatCount();
  ASSERT_TRUE(service_.WaitUntil(HeartbeatShows(1, "", seen)));
  EXPECT_TRUE(StopAgent().ok());
}

TEST_F(WorkerAgentTest, HeartbeatsShowTheRunningRankAndCancellationStopsIt) {
  StartAgent(Options());
  service_.Assign(MakeAssignment("sleep-1", 2, 0, 0));
  ASSERT_TRUE(service_.WaitUntil(Reported("sleep-1", v1::RANK_EVENT_STARTED)));
  ASSERT_TRUE(service_.WaitUntil([](const FakeWorkerService& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (const auto& h : s.heartbeats()) {
      if (h.slots_size() == 2 && h.slots(0).job_id() == "sleep-1" && h.slots(0).generation() == 2 &&
          h.slots(0).rank() == 0 && h.slots(1).job_id().empty()) {
        return true;
      }
    }
    return false;
  }));
  service_.Cancel("sleep-1", 2);
  ASSERT_TRUE(service_.WaitUntil(Reported("sleep-1", v1::RANK_EVENT_CANCELLED)));
  v1::ReportProgressRequest end = service_.ReportsFor("sleep-1").back();
  EXPECT_EQ(end.event(), v1::RANK_EVENT_CANCELLED);
  EXPECT_EQ(end.generation(), 2);
  EXPECT_THAT(end.error(), HasSubstr("cancelled by the test"));
  size_t seen = service_.HeartbeatCount();
  ASSERT_TRUE(service_.WaitUntil(HeartbeatShows(0, "", seen)));
  EXPECT_TRUE(StopAgent().ok());
}

v1::ProfileOrder MakeOrder(const std::string& job_id, int64_t generation, int64_t rank,
                           const std::string& capture_id) {
  v1::ProfileOrder order;
  order.set_job_id(job_id);
  order.set_generation(generation);
  order.set_rank(rank);
  order.set_capture_id(capture_id);
  order.set_steps(3);
  return order;
}

// `gz`, gzip's format, decompressed; empty when it is not.
std::string Gunzip(const std::string& gz) {
  z_stream z{};
  if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) return "";
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(gz.data()));
  z.avail_in = static_cast<uInt>(gz.size());
  std::string out;
  char buffer[1 << 16];
  int status = Z_OK;
  while (status == Z_OK) {
    z.next_out = reinterpret_cast<Bytef*>(buffer);
    z.avail_out = sizeof(buffer);
    status = inflate(&z, Z_NO_FLUSH);
    out.append(buffer, sizeof(buffer) - z.avail_out);
  }
  inflateEnd(&z);
  return status == Z_STREAM_END ? out : "";
}

// `lathe profile` at the agent (issue #33): the order becomes the trainer's request file, the
// trainer's answer an upload of its files in chunks of at most 1 MiB and then the answer, all
// before the rank's end is reported.
TEST_F(WorkerAgentTest, AProfileOrderReachesTheTrainerAndItsFilesTheCoordinator) {
  StartAgent(Options());
  service_.Assign(MakeAssignment("profile-1", 2, 0, 0));
  ASSERT_TRUE(service_.WaitUntil(Reported("profile-1", v1::RANK_EVENT_STARTED)));
  service_.Profile(MakeOrder("profile-1", 2, 0, "prof-1"));
  ASSERT_TRUE(service_.WaitUntil(Reported("profile-1", v1::RANK_EVENT_SUCCEEDED)));

  const std::vector<v1::ReportProfileRequest> answers = service_.ProfileReports();
  ASSERT_EQ(answers.size(), 1u);
  const v1::ReportProfileRequest& answer = answers[0];
  EXPECT_EQ(answer.worker_id(), "host-cpu");
  EXPECT_EQ(answer.job_id(), "profile-1");
  EXPECT_EQ(answer.generation(), 2);
  EXPECT_EQ(answer.capture_id(), "prof-1");
  EXPECT_EQ(answer.first_step(), 3);
  EXPECT_EQ(answer.last_step(), 5);
  EXPECT_EQ(answer.error(), "");
  // Each file goes compressed, as <name>.gz: random bytes grow a little, text shrinks.
  ASSERT_EQ(answer.files_size(), 2);
  const std::map<std::string, std::string> uploaded = service_.Uploaded();
  EXPECT_EQ(answer.files(0).name(), "trace.json.gz");
  EXPECT_EQ(answer.files(0).size(), uploaded.at("trace.json.gz").size());
  EXPECT_EQ(Gunzip(uploaded.at("trace.json.gz")), "trace of prof-1");
  EXPECT_EQ(answer.files(1).name(), "big.bin.gz");
  EXPECT_EQ(answer.files(1).size(), uploaded.at("big.bin.gz").size());
  EXPECT_GT(answer.files(1).size(), 2500000u);
  EXPECT_EQ(Gunzip(uploaded.at("big.bin.gz")).size(), 2500000u);
  int big_chunks = 0;
  for (const v1::UploadProfileRequest& chunk : service_.Uploads()) {
    EXPECT_LE(chunk.data().size(), size_t{1} << 20);
    EXPECT_EQ(chunk.capture_id(), "prof-1");
    EXPECT_EQ(chunk.rank(), 0);
    big_chunks += chunk.name() == "big.bin.gz";
  }
  EXPECT_EQ(big_chunks, 3);
  // The answer went before the rank's end.
  const std::vector<std::string> calls = service_.Calls();
  auto at = [&](const std::string& call) {
    return std::find(calls.begin(), calls.end(), call) - calls.begin();
  };
  EXPECT_LT(at("profile"), at("progress RANK_EVENT_SUCCEEDED"));
  EXPECT_TRUE(StopAgent().ok());
}

TEST_F(WorkerAgentTest, AProfileOrderForARankNotHereOrPastTheBoundsIsAnsweredWithAnError) {
  WorkerAgentOptions options = Options();
  options.profiles.max_file_bytes = 1 << 20;
  StartAgent(options);
  service_.Profile(MakeOrder("absent", 1, 0, "prof-1"));
  ASSERT_TRUE(service_.WaitUntil([](const FakeWorkerService& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return s.profile_report_count() == 1;
  }));
  EXPECT_EQ(service_.ProfileReports()[0].error(),
            "rank 0 of attempt 1 does not run on worker host-cpu");

  service_.Assign(MakeAssignment("profile-2", 1, 0, 0));
  ASSERT_TRUE(service_.WaitUntil(Reported("profile-2", v1::RANK_EVENT_STARTED)));
  service_.Profile(MakeOrder("profile-2", 1, 0, "prof-1"));
  ASSERT_TRUE(service_.WaitUntil(Reported("profile-2", v1::RANK_EVENT_SUCCEEDED)));
  const std::vector<v1::ReportProfileRequest> answers = service_.ProfileReports();
  ASSERT_EQ(answers.size(), 2u);
  EXPECT_THAT(answers[1].error(),
              ::testing::MatchesRegex("file big\\.bin\\.gz is 25[0-9]{5} bytes, "
                                      "past the bound of 1 MiB a file"));
  EXPECT_EQ(answers[1].files_size(), 0);
  EXPECT_TRUE(service_.Uploads().empty()) << "nothing is uploaded";
  EXPECT_TRUE(StopAgent().ok());
}

TEST_F(WorkerAgentTest, KilledTrainerFailsAndTheAgentCarriesOn) {
  StartAgent(Options());
  service_.Assign(MakeAssignment("killed-1", 1, 0, 0));
  ASSERT_TRUE(service_.WaitUntil(Reported("killed-1", v1::RANK_EVENT_FAILED)));
  v1::ReportProgressRequest end = service_.ReportsFor("killed-1").back();
  EXPECT_EQ(end.event(), v1::RANK_EVENT_FAILED);
  EXPECT_EQ(end.generation(), 1);
  EXPECT_THAT(end.error(), HasSubstr("killed by signal 9 (SIGKILL)"));
  EXPECT_THAT(end.error(), HasSubstr("about to be killed"));

  // Still heartbeating, and the same slot takes the next rank.
  size_t seen = service_.HeartbeatCount();
  ASSERT_TRUE(service_.WaitUntil(HeartbeatShows(0, "", seen)));
  service_.Assign(MakeAssignment("ok-2", 1, 0, 0));
  ASSERT_TRUE(service_.WaitUntil(Reported("ok-2", v1::RANK_EVENT_SUCCEEDED)));
  EXPECT_EQ(service_.Registrations().size(), 1u);
  EXPECT_TRUE(StopAgent().ok());
}

TEST_F(WorkerAgentTest, RegistersAgainWhenTheSessionIsUnknown) {
  StartAgent(Options());
  service_.Assign(MakeAssignment("sleep-2", 1, 0, 1));
  ASSERT_TRUE(service_.WaitUntil(HeartbeatShows(1, "sleep-2")));
  service_.ForgetSessions();  // the coordinator restarted
  ASSERT_TRUE(service_.WaitUntil([](const FakeWorkerService& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (s.registrations().size() < 2) return false;
    // A heartbeat of the new session that still shows the running trainer.
    for (const auto& h : s.heartbeats()) {
      if (h.session_id() == s.session() && h.slots_size() == 2 &&
          h.slots(1).job_id() == "sleep-2") {
        return true;
      }
    }
    return false;
  }));
  EXPECT_FALSE(Has(service_.ReportsFor("sleep-2"), v1::RANK_EVENT_CANCELLED));
  EXPECT_FALSE(Has(service_.ReportsFor("sleep-2"), v1::RANK_EVENT_FAILED));
  // The trainer survived the re-registration and still obeys the coordinator.
  service_.Cancel("sleep-2", 0);  // generation 0: any
  ASSERT_TRUE(service_.WaitUntil(Reported("sleep-2", v1::RANK_EVENT_CANCELLED)));
  EXPECT_TRUE(StopAgent().ok());
}

TEST_F(WorkerAgentTest, SilentCoordinatorLeadsToANewSession) {
  service_.SetSilent(true, /*heartbeat_timeout_ms=*/100);
  StartAgent(Options());
  // Heartbeats flow but none is answered; on the agent's clock no time passes yet.
  ASSERT_TRUE(service_.WaitUntil([](const FakeWorkerService& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return s.heartbeats().size() >= 3;
  }));
  EXPECT_EQ(service_.Registrations().size(), 1u);
  clock_.Advance(absl::Milliseconds(101));  // past the heartbeat timeout
  ASSERT_TRUE(service_.WaitUntil([](const FakeWorkerService& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return s.registrations().size() >= 2;
  }));
  service_.SetSilent(false, 30000);
  size_t seen = service_.HeartbeatCount();
  service_.Assign(MakeAssignment("ok-10", 1, 0, 0));
  ASSERT_TRUE(service_.WaitUntil(Reported("ok-10", v1::RANK_EVENT_SUCCEEDED)));
  EXPECT_GT(service_.HeartbeatCount(), seen);
  EXPECT_TRUE(StopAgent().ok());
}

TEST_F(WorkerAgentTest, RetriesRegistrationUntilTheCoordinatorAnswers) {
  service_.FailRegistrations(3);
  StartAgent(Options());
  ASSERT_TRUE(service_.WaitUntil([](const FakeWorkerService& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return s.registration_attempts() >= 4 && !s.heartbeats().empty();
  }));
  EXPECT_EQ(service_.Registrations().size(), 1u);
  EXPECT_TRUE(StopAgent().ok());
}

TEST_F(WorkerAgentTest, UnreachableCoordinatorIsRetried) {
  // A port with nothing listening yet.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  socklen_t length = sizeof(address);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  close(fd);
  const std::string late_address = absl::StrCat("127.0.0.1:", ntohs(address.sin_port));
  StartAgent(Options(), late_address);
  // The agent's first registration fails: its channel saw the connection refused.
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(60);
  grpc_connectivity_state state = channel_->GetState(/*try_to_connect=*/false);
  while (state != GRPC_CHANNEL_TRANSIENT_FAILURE && channel_->WaitForStateChange(state, deadline)) {
    state = channel_->GetState(false);
  }
  ASSERT_EQ(state, GRPC_CHANNEL_TRANSIENT_FAILURE);
  // Then the coordinator comes up.
  FakeWorkerService late;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(late_address, grpc::InsecureServerCredentials());
  builder.RegisterService(&late);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(late.WaitUntil([](const FakeWorkerService& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return !s.heartbeats().empty();
  }));
  EXPECT_TRUE(StopAgent().ok());
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

TEST_F(WorkerAgentTest, ShutdownCancelsRunningTrainers) {
  StartAgent(Options());
  service_.Assign(MakeAssignment("sleep-3", 4, 0, 0));
  ASSERT_TRUE(service_.WaitUntil(Reported("sleep-3", v1::RANK_EVENT_STARTED)));
  EXPECT_TRUE(StopAgent().ok());
  std::vector<v1::ReportProgressRequest> reports = service_.ReportsFor("sleep-3");
  ASSERT_FALSE(reports.empty());
  EXPECT_EQ(reports.back().event(), v1::RANK_EVENT_CANCELLED);
  EXPECT_THAT(reports.back().error(), HasSubstr("shutting down"));
}

TEST_F(WorkerAgentTest, AssignmentToABusySlotReplacesItsTrainer) {
  StartAgent(Options());
  service_.Assign(MakeAssignment("sleep-4", 1, 0, 0));
  ASSERT_TRUE(service_.WaitUntil(Reported("sleep-4", v1::RANK_EVENT_STARTED)));
  service_.Assign(MakeAssignment("ok-4", 1, 0, 0));
  ASSERT_TRUE(service_.WaitUntil(Reported("ok-4", v1::RANK_EVENT_SUCCEEDED)));
  std::vector<v1::ReportProgressRequest> old = service_.ReportsFor("sleep-4");
  EXPECT_EQ(old.back().event(), v1::RANK_EVENT_CANCELLED);
  EXPECT_THAT(old.back().error(), HasSubstr("slot 0 was assigned to job ok-4"));
  EXPECT_TRUE(StopAgent().ok());
}

TEST_F(WorkerAgentTest, RepeatedAssignmentRunsOnce) {
  StartAgent(Options());
  v1::Assignment assignment = MakeAssignment("sleep-5", 1, 0, 0);
  service_.Assign(assignment);
  service_.Assign(assignment);
  ASSERT_TRUE(service_.WaitUntil(Reported("sleep-5", v1::RANK_EVENT_STARTED)));
  service_.Cancel("sleep-5", 1);
  ASSERT_TRUE(service_.WaitUntil(Reported("sleep-5", v1::RANK_EVENT_CANCELLED)));
  int started = 0;
  for (const auto& r : service_.ReportsFor("sleep-5"))
    started += r.event() == v1::RANK_EVENT_STARTED;
  EXPECT_EQ(started, 1);
  EXPECT_TRUE(StopAgent().ok());
}

TEST_F(WorkerAgentTest, AssignmentToAMissingSlotFails) {
  StartAgent(Options());
  service_.Assign(MakeAssignment("ok-6", 1, 0, /*slot=*/5));
  ASSERT_TRUE(service_.WaitUntil(Reported("ok-6", v1::RANK_EVENT_FAILED)));
  EXPECT_THAT(service_.ReportsFor("ok-6").back().error(), HasSubstr("slot 5 does not exist"));
  EXPECT_TRUE(StopAgent().ok());
}

TEST_F(WorkerAgentTest, TrainerThatCannotStartIsReportedFailed) {
  WorkerAgentOptions options = Options();
  options.trainer.trainer_binary = dir_.Path("missing-trainer");
  StartAgent(std::move(options));
  service_.Assign(MakeAssignment("ok-7", 1, 0, 0));
  ASSERT_TRUE(service_.WaitUntil(Reported("ok-7", v1::RANK_EVENT_FAILED)));
  EXPECT_THAT(service_.ReportsFor("ok-7").back().error(), HasSubstr("missing-trainer"));
  size_t seen = service_.HeartbeatCount();
  ASSERT_TRUE(service_.WaitUntil(HeartbeatShows(0, "", seen)));
  EXPECT_TRUE(StopAgent().ok());
}

TEST_F(WorkerAgentTest, EndOfARankIsRetriedUntilDelivered) {
  StartAgent(Options());
  service_.Assign(MakeAssignment("sleep-8", 1, 0, 0));
  ASSERT_TRUE(service_.WaitUntil(Reported("sleep-8", v1::RANK_EVENT_PROGRESS)));
  // The trainer prints nothing more; the coordinator says "try again" three times.
  service_.FailReports(3, grpc::StatusCode::UNAVAILABLE);
  service_.Cancel("sleep-8", 1);
  ASSERT_TRUE(service_.WaitUntil(Reported("sleep-8", v1::RANK_EVENT_CANCELLED)));
  EXPECT_TRUE(StopAgent().ok());
}

TEST_F(WorkerAgentTest, RefusedEndStillFreesTheSlot) {
  StartAgent(Options());
  service_.Assign(MakeAssignment("sleep-9", 1, 0, 0));
  ASSERT_TRUE(service_.WaitUntil(Reported("sleep-9", v1::RANK_EVENT_PROGRESS)));
  // A stale generation: the coordinator refuses the end for good.
  service_.FailReports(1, grpc::StatusCode::FAILED_PRECONDITION);
  service_.Cancel("sleep-9", 1);
  size_t seen = service_.HeartbeatCount();
  ASSERT_TRUE(service_.WaitUntil(HeartbeatShows(0, "", seen)));
  EXPECT_FALSE(Has(service_.ReportsFor("sleep-9"), v1::RANK_EVENT_CANCELLED));
  EXPECT_TRUE(StopAgent().ok());
}

// The agent with the real trainer (`lathe-worker train`) on a tiny synthetic model.
TEST_F(WorkerAgentTest, RunsTheRealTrainer) {
  const char* bin_dir = std::getenv("LATHE_BIN_DIR");
  if (bin_dir == nullptr) GTEST_SKIP() << "LATHE_BIN_DIR is not set (run under ctest)";
  const std::string worker = absl::StrCat(bin_dir, "/lathe-worker");
  const std::string synth = absl::StrCat(bin_dir, "/lathe-synth");
  const std::string model = dir_.Path("model");
  const std::string data = dir_.Path("train.jsonl");
  for (const std::string& command :
       {absl::StrCat(synth, " model --out ", model, " --max-pos 64 >/dev/null"),
        absl::StrCat(synth, " data --out ", data, " --records 16 >/dev/null")}) {
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
  }
  WorkerAgentOptions options = Options();
  options.trainer.trainer_binary = worker;
  options.trainer.trainer_threads = 1;
  StartAgent(std::move(options));

  v1::Assignment assignment = MakeAssignment("real-1", 1, 0, 0);
  v1::JobSpec& spec = *assignment.mutable_spec();
  spec.mutable_model()->set_path(model);
  spec.mutable_data()->set_train(data);
  spec.mutable_data()->set_seq_len(32);
  spec.mutable_lora()->set_rank(4);
  spec.mutable_lora()->set_alpha(8);
  spec.mutable_train()->set_steps(2);
  spec.mutable_train()->set_global_batch(2);
  spec.mutable_train()->set_lr(1e-3);
  spec.mutable_resources()->set_ranks(1);
  spec.set_output(dir_.Path("out"));
  // The coordinator's plan, with a micro-batch and checkpointing the spec does not ask for.
  absl::StatusOr<JobSpec> parsed = JobSpecFromProto(spec, "spec");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  Plan plan = testing::DefaultPlan(*parsed);
  plan.strategy.micro_batch = 1;
  plan.gradient_accumulation = 2;
  plan.strategy.activation_checkpointing = true;
  *assignment.mutable_plan() = PlanToProto(plan);
  service_.Assign(assignment);

  ASSERT_TRUE(service_.WaitUntil([](const FakeWorkerService& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (const auto& r : s.reports()) {
      if (r.job_id() == "real-1" &&
          (r.event() == v1::RANK_EVENT_SUCCEEDED || r.event() == v1::RANK_EVENT_FAILED)) {
        return true;
      }
    }
    return false;
  }));
  std::vector<v1::ReportProgressRequest> reports = service_.ReportsFor("real-1");
  const v1::ReportProgressRequest& end = reports.back();
  ASSERT_EQ(end.event(), v1::RANK_EVENT_SUCCEEDED) << end.error();
  EXPECT_EQ(end.adapter_path(), dir_.Path("out") + "/adapter");
  EXPECT_EQ(end.progress().step(), 2);
  EXPECT_TRUE(end.progress().has_loss());
  EXPECT_TRUE(Has(reports, v1::RANK_EVENT_PROGRESS));
  EXPECT_TRUE(std::filesystem::exists(dir_.Path("out") + "/adapter/adapter_model.safetensors"));
  // What the trainer says it ran is the plan it was given.
  absl::StatusOr<std::string> events = ReadFile(dir_.Path("work") + "/real-1-g1-r0/events.jsonl");
  ASSERT_TRUE(events.ok()) << events.status();
  std::vector<v1::TrainerEvent> parsed_events;
  for (absl::string_view line : absl::StrSplit(*events, '\n', absl::SkipEmpty())) {
    absl::StatusOr<v1::TrainerEvent> event = ParseTrainerEventLine(line);
    ASSERT_TRUE(event.ok()) << line;
    parsed_events.push_back(*event);
  }
  ASSERT_GE(parsed_events.size(), 4u);  // start, 2 steps, done
  ASSERT_TRUE(parsed_events.front().has_start());
  const v1::Plan& ran = parsed_events.front().start().plan();
  EXPECT_EQ(ran.strategy().micro_batch(), 1);
  EXPECT_EQ(ran.gradient_accumulation(), 2);
  EXPECT_TRUE(ran.strategy().activation_checkpointing());
  EXPECT_TRUE(parsed_events[1].has_step());
  EXPECT_GT(parsed_events[1].step().progress().mfu(), 0);
  EXPECT_TRUE(parsed_events.back().has_done());
  EXPECT_TRUE(StopAgent().ok());
}

// Issue #32: a finished rank's folder goes once its log is shipped and the retention has
// passed (0 here); a running rank's folder stays.
TEST_F(WorkerAgentTest, RemovesAFinishedRanksFolder) {
  WorkerAgentOptions options = Options();
  options.keep_attempt_dirs = absl::ZeroDuration();
  StartAgent(std::move(options));
  service_.Assign(MakeAssignment("sleep-5", 1, 0, 0));
  service_.Assign(MakeAssignment("ok-5", 2, 0, 1));
  ASSERT_TRUE(service_.WaitUntil(Reported("ok-5", v1::RANK_EVENT_SUCCEEDED)));
  const std::filesystem::path finished = dir_.Path("work/ok-5-g2-r0");
  const absl::Time limit = absl::Now() + testing::kWaitLimit;
  while (std::filesystem::exists(finished) && absl::Now() < limit) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_FALSE(std::filesystem::exists(finished));
  EXPECT_TRUE(std::filesystem::exists(dir_.Path("work/sleep-5-g1-r0/task.json")));
  EXPECT_TRUE(StopAgent().ok());
}

// With the default retention (24 h, and a clock that does not move) the folder stays; at
// start the agent removes the attempt folders an earlier run left more than 24 h ago.
TEST_F(WorkerAgentTest, KeepsFinishedFoldersForTheRetentionAndSweepsOldOnesAtStart) {
  const std::string old_dir = dir_.Path("work/old-1-g1-r0");
  const std::string recent_dir = dir_.Path("work/recent-1-g1-r0");
  for (const std::string& path : {old_dir, recent_dir}) {
    std::filesystem::create_directories(path);
    std::ofstream(path + "/trainer.log") << "step 1\n";
  }
  auto set_modified = [](const std::string& path, absl::Time when) {
    const timespec t = absl::ToTimespec(when);
    const timespec times[2] = {t, t};
    ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), times, AT_SYMLINK_NOFOLLOW), 0) << path;
  };
  set_modified(old_dir + "/trainer.log", clock_.Now() - absl::Hours(25));
  set_modified(old_dir, clock_.Now() - absl::Hours(25));
  set_modified(recent_dir + "/trainer.log", clock_.Now() - absl::Hours(1));
  set_modified(recent_dir, clock_.Now() - absl::Hours(1));
  const std::string foreign = dir_.Write("work/notes.txt", "mine");

  StartAgent(Options());
  service_.Assign(MakeAssignment("ok-6", 1, 0, 0));
  ASSERT_TRUE(service_.WaitUntil(Reported("ok-6", v1::RANK_EVENT_SUCCEEDED)));
  size_t seen = service_.HeartbeatCount();
  ASSERT_TRUE(service_.WaitUntil(HeartbeatShows(0, "", seen)));
  seen = service_.HeartbeatCount();
  ASSERT_TRUE(service_.WaitUntil([seen](const FakeWorkerService& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return s.heartbeats().size() >= seen + 3;
  }));
  EXPECT_TRUE(std::filesystem::exists(dir_.Path("work/ok-6-g1-r0/trainer.log")));
  EXPECT_FALSE(std::filesystem::exists(old_dir));
  EXPECT_TRUE(std::filesystem::exists(recent_dir));
  EXPECT_TRUE(std::filesystem::exists(foreign));
  EXPECT_TRUE(StopAgent().ok());
}

TEST_F(WorkerAgentTest, BadOptionsAreRefused) {
  WorkerAgentOptions options = Options();
  options.slots = 0;
  WorkerAgent agent(std::move(options), nullptr, &launcher_, &clock_);
  absl::Status status = agent.Run();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("slots"));

  options = Options();
  options.keep_attempt_dirs = absl::Seconds(-1);
  WorkerAgent negative(std::move(options), nullptr, &launcher_, &clock_);
  status = negative.Run();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("keep_attempt_dirs"));
}

}  // namespace
}  // namespace lathe
