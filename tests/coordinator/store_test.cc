#include "coordinator/store/store.h"

#include <gmock/gmock.h>
#include <google/protobuf/unknown_field_set.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "coordinator/store/database_lock.h"
#include "lathe/v1/coordinator.pb.h"
#include "lathe/v1/job.pb.h"
#include "tests/testing/temp_dir.h"

namespace lathe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Optional;

MATCHER_P(EqualsProto, expected, "") {
  return google::protobuf::util::MessageDifferencer::Equals(arg, expected);
}

MATCHER_P(HasJobId, job_id, "") { return arg.job_id() == job_id; }
MATCHER_P(HasWorkerId, worker_id, "") { return arg.worker_id() == worker_id; }

std::string Message(const absl::Status& status) { return std::string(status.message()); }

v1::JobStatus MakeJob(const std::string& job_id, v1::JobState state = v1::JOB_STATE_QUEUED) {
  v1::JobStatus job;
  job.set_job_id(job_id);
  job.set_state(state);
  job.mutable_spec()->set_name(absl::StrCat("name-", job_id));
  job.mutable_spec()->mutable_train()->set_steps(10);
  job.set_reason("waiting for 2 free cpu slots");
  job.set_submitted_unix_ms(1700000000000);
  return job;
}

v1::WorkerStatus MakeWorker(const std::string& worker_id, int64_t slots) {
  v1::WorkerStatus worker;
  worker.set_worker_id(worker_id);
  worker.set_state(v1::WORKER_STATE_READY);
  worker.set_device(v1::DEVICE_CPU);
  worker.set_slots(slots);
  return worker;
}

// ---------------------------------------------------------------------------------------
// The Store contract, run against every implementation.

struct MemoryStoreMaker {
  static absl::StatusOr<std::unique_ptr<Store>> Open(const std::string& /*dir*/) {
    return NewMemoryStore();
  }
};

struct SqliteStoreMaker {
  static absl::StatusOr<std::unique_ptr<Store>> Open(const std::string& dir) {
    return OpenSqliteStore(dir + "/lathe.db");
  }
};

template <typename Maker>
class StoreContractTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    absl::StatusOr<std::unique_ptr<Store>> store = Maker::Open(dir_.path());
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }

  testing::TempDir dir_;
  std::unique_ptr<Store> store_;
};

struct StoreName {
  template <typename Maker>
  static std::string GetName(int) {
    return std::is_same_v<Maker, MemoryStoreMaker> ? "Memory" : "Sqlite";
  }
};

using StoreMakers = ::testing::Types<MemoryStoreMaker, SqliteStoreMaker>;
TYPED_TEST_SUITE(StoreContractTest, StoreMakers, StoreName);

TYPED_TEST(StoreContractTest, EmptyStoreLoadsNothing) {
  absl::StatusOr<std::vector<v1::JobStatus>> jobs = this->store_->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_TRUE(jobs->empty());
  absl::StatusOr<std::vector<v1::WorkerStatus>> workers = this->store_->LoadWorkers();
  ASSERT_TRUE(workers.ok()) << workers.status();
  EXPECT_TRUE(workers->empty());
}

TYPED_TEST(StoreContractTest, LoadsJobsInCreationOrderWithTheirUpdates) {
  // Ids out of alphabetical order, so that order by id would show.
  ASSERT_TRUE(this->store_->CreateJob(MakeJob("job-c"), "req-c").ok());
  ASSERT_TRUE(this->store_->CreateJob(MakeJob("job-a"), "").ok());
  ASSERT_TRUE(this->store_->CreateJob(MakeJob("job-b"), "req-b").ok());

  v1::JobStatus running = MakeJob("job-a", v1::JOB_STATE_RUNNING);
  v1::Attempt* attempt = running.add_attempts();
  attempt->set_generation(1);
  attempt->add_placements()->set_worker_id("worker-0");
  ASSERT_TRUE(this->store_->UpdateJob(running).ok());

  absl::StatusOr<std::vector<v1::JobStatus>> jobs = this->store_->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_THAT(*jobs, ElementsAre(EqualsProto(MakeJob("job-c")), EqualsProto(running),
                                 EqualsProto(MakeJob("job-b"))));
}

TYPED_TEST(StoreContractTest, FindsJobByRequestId) {
  ASSERT_TRUE(this->store_->CreateJob(MakeJob("job-1"), "req-1").ok());
  ASSERT_TRUE(this->store_->CreateJob(MakeJob("job-2"), "req-2").ok());
  const v1::JobStatus updated = MakeJob("job-2", v1::JOB_STATE_SUCCEEDED);
  ASSERT_TRUE(this->store_->UpdateJob(updated).ok());

  absl::StatusOr<std::optional<v1::JobStatus>> found = this->store_->FindJobByRequestId("req-1");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_THAT(*found, Optional(EqualsProto(MakeJob("job-1"))));

  found = this->store_->FindJobByRequestId("req-2");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_THAT(*found, Optional(EqualsProto(updated)));

  found = this->store_->FindJobByRequestId("req-unknown");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, std::nullopt);

  found = this->store_->FindJobByRequestId("");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, std::nullopt);
}

TYPED_TEST(StoreContractTest, ManyJobsMayHaveNoRequestId) {
  ASSERT_TRUE(this->store_->CreateJob(MakeJob("job-1"), "").ok());
  ASSERT_TRUE(this->store_->CreateJob(MakeJob("job-2"), "").ok());
  absl::StatusOr<std::vector<v1::JobStatus>> jobs = this->store_->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_THAT(*jobs, ElementsAre(HasJobId("job-1"), HasJobId("job-2")));
}

TYPED_TEST(StoreContractTest, DuplicateJobIdIsAlreadyExistsAndWritesNothing) {
  ASSERT_TRUE(this->store_->CreateJob(MakeJob("job-1"), "req-1").ok());
  const absl::Status status =
      this->store_->CreateJob(MakeJob("job-1", v1::JOB_STATE_FAILED), "req-2");
  EXPECT_EQ(status.code(), absl::StatusCode::kAlreadyExists) << status;
  EXPECT_THAT(Message(status), HasSubstr("job job-1 already exists"));

  // Neither the record nor the second request id was written.
  absl::StatusOr<std::vector<v1::JobStatus>> jobs = this->store_->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_THAT(*jobs, ElementsAre(EqualsProto(MakeJob("job-1"))));
  absl::StatusOr<std::optional<v1::JobStatus>> found = this->store_->FindJobByRequestId("req-2");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, std::nullopt);
}

TYPED_TEST(StoreContractTest, DuplicateRequestIdIsAlreadyExistsAndWritesNothing) {
  ASSERT_TRUE(this->store_->CreateJob(MakeJob("job-1"), "req-1").ok());
  const absl::Status status = this->store_->CreateJob(MakeJob("job-2"), "req-1");
  EXPECT_EQ(status.code(), absl::StatusCode::kAlreadyExists) << status;
  EXPECT_THAT(Message(status), HasSubstr("request id req-1 already created job job-1"));

  absl::StatusOr<std::vector<v1::JobStatus>> jobs = this->store_->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_THAT(*jobs, ElementsAre(HasJobId("job-1")));
  absl::StatusOr<std::optional<v1::JobStatus>> found = this->store_->FindJobByRequestId("req-1");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_THAT(*found, Optional(HasJobId("job-1")));
  // job-2 can still be created under a fresh request id.
  EXPECT_TRUE(this->store_->CreateJob(MakeJob("job-2"), "req-2").ok());
}

TYPED_TEST(StoreContractTest, UpdatingAnUnknownJobIsNotFound) {
  ASSERT_TRUE(this->store_->CreateJob(MakeJob("job-1"), "").ok());
  const absl::Status status = this->store_->UpdateJob(MakeJob("job-x"));
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(Message(status), HasSubstr("job job-x not found"));
  absl::StatusOr<std::vector<v1::JobStatus>> jobs = this->store_->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_THAT(*jobs, ElementsAre(HasJobId("job-1")));
}

TYPED_TEST(StoreContractTest, ABatchIsWrittenWholeOrNotAtAll) {
  ASSERT_TRUE(this->store_->CreateJob(MakeJob("job-1"), "").ok());
  ASSERT_TRUE(this->store_->CreateJob(MakeJob("job-2"), "").ok());
  ASSERT_TRUE(this->store_->PutWorker(MakeWorker("worker-old", 1)).ok());

  // A job that does not exist fails the batch, and nothing of it is written.
  StoreBatch bad;
  bad.jobs = {MakeJob("job-1", v1::JOB_STATE_RUNNING), MakeJob("job-x")};
  bad.workers = {MakeWorker("worker-a", 2)};
  bad.deleted_workers = {"worker-old"};
  absl::Status status = this->store_->Write(bad);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  absl::StatusOr<std::vector<v1::JobStatus>> jobs = this->store_->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_THAT(*jobs, ElementsAre(EqualsProto(MakeJob("job-1")), EqualsProto(MakeJob("job-2"))));
  absl::StatusOr<std::vector<v1::WorkerStatus>> workers = this->store_->LoadWorkers();
  ASSERT_TRUE(workers.ok()) << workers.status();
  EXPECT_THAT(*workers, ElementsAre(HasWorkerId("worker-old")));

  StoreBatch good;
  good.jobs = {MakeJob("job-1", v1::JOB_STATE_RUNNING), MakeJob("job-2", v1::JOB_STATE_FAILED)};
  good.workers = {MakeWorker("worker-a", 2)};
  good.deleted_workers = {"worker-old"};
  ASSERT_TRUE(this->store_->Write(good).ok());
  jobs = this->store_->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_THAT(*jobs, ElementsAre(EqualsProto(MakeJob("job-1", v1::JOB_STATE_RUNNING)),
                                 EqualsProto(MakeJob("job-2", v1::JOB_STATE_FAILED))));
  workers = this->store_->LoadWorkers();
  ASSERT_TRUE(workers.ok()) << workers.status();
  EXPECT_THAT(*workers, ElementsAre(EqualsProto(MakeWorker("worker-a", 2))));
}

TYPED_TEST(StoreContractTest, EmptyIdsAreInvalidArgument) {
  absl::Status status = this->store_->CreateJob(MakeJob(""), "req-1");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(Message(status), HasSubstr("job_id is empty"));
  status = this->store_->PutWorker(MakeWorker("", 1));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(Message(status), HasSubstr("worker_id is empty"));
}

TYPED_TEST(StoreContractTest, PutWorkerUpsertsAndLoadsByWorkerId) {
  ASSERT_TRUE(this->store_->PutWorker(MakeWorker("worker-b", 1)).ok());
  ASSERT_TRUE(this->store_->PutWorker(MakeWorker("worker-c", 1)).ok());
  ASSERT_TRUE(this->store_->PutWorker(MakeWorker("worker-a", 1)).ok());
  v1::WorkerStatus lost = MakeWorker("worker-b", 4);
  lost.set_state(v1::WORKER_STATE_LOST);
  ASSERT_TRUE(this->store_->PutWorker(lost).ok());

  absl::StatusOr<std::vector<v1::WorkerStatus>> workers = this->store_->LoadWorkers();
  ASSERT_TRUE(workers.ok()) << workers.status();
  EXPECT_THAT(*workers, ElementsAre(EqualsProto(MakeWorker("worker-a", 1)), EqualsProto(lost),
                                    EqualsProto(MakeWorker("worker-c", 1))));
}

TYPED_TEST(StoreContractTest, DeleteWorkerForgetsIt) {
  ASSERT_TRUE(this->store_->PutWorker(MakeWorker("worker-a", 1)).ok());
  ASSERT_TRUE(this->store_->PutWorker(MakeWorker("worker-b", 1)).ok());
  ASSERT_TRUE(this->store_->DeleteWorker("worker-a").ok());
  ASSERT_TRUE(this->store_->DeleteWorker("never-there").ok());
  absl::StatusOr<std::vector<v1::WorkerStatus>> workers = this->store_->LoadWorkers();
  ASSERT_TRUE(workers.ok()) << workers.status();
  EXPECT_THAT(*workers, ElementsAre(EqualsProto(MakeWorker("worker-b", 1))));
}

TYPED_TEST(StoreContractTest, ConcurrentCreatesAreAllStored) {
  constexpr int kThreads = 4;
  constexpr int kJobsPerThread = 5;
  std::vector<std::thread> threads;
  std::vector<absl::Status> statuses(kThreads * kJobsPerThread);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t, &statuses] {
      for (int i = 0; i < kJobsPerThread; ++i) {
        const std::string id = absl::StrCat(t, "-", i);
        statuses[t * kJobsPerThread + i] =
            this->store_->CreateJob(MakeJob(absl::StrCat("job-", id)), absl::StrCat("req-", id));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const absl::Status& status : statuses) EXPECT_TRUE(status.ok()) << status;
  absl::StatusOr<std::vector<v1::JobStatus>> jobs = this->store_->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_EQ(jobs->size(), static_cast<size_t>(kThreads * kJobsPerThread));
}

// ---------------------------------------------------------------------------------------
// SQLite only: the file.

// Runs `sql` on its own connection to `path`, as another process (or an operator) would.
void RawExec(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE, nullptr), SQLITE_OK);
  char* error = nullptr;
  const int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &error);
  EXPECT_EQ(rc, SQLITE_OK) << (error != nullptr ? error : "");
  sqlite3_free(error);
  sqlite3_close(db);
}

// The first column of the first row of `sql`, as text.
std::string RawQuery(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  std::string out;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) == SQLITE_OK) {
    sqlite3_stmt* statement = nullptr;
    if (sqlite3_prepare_v2(db, sql.c_str(), -1, &statement, nullptr) == SQLITE_OK &&
        sqlite3_step(statement) == SQLITE_ROW) {
      out = reinterpret_cast<const char*>(sqlite3_column_text(statement, 0));
    }
    sqlite3_finalize(statement);
  }
  sqlite3_close(db);
  return out;
}

class SqliteStoreTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(dir_.path().empty()); }

  testing::TempDir dir_;
  const std::string path_ = dir_.Path("lathe.db");
};

TEST_F(SqliteStoreTest, ReopeningTheFileSeesEveryJobAndWorker) {
  v1::JobStatus running = MakeJob("job-2", v1::JOB_STATE_RUNNING);
  running.add_attempts()->set_generation(3);
  {
    absl::StatusOr<std::unique_ptr<Store>> store = OpenSqliteStore(path_);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->CreateJob(MakeJob("job-3"), "req-3").ok());
    ASSERT_TRUE((*store)->CreateJob(MakeJob("job-2"), "req-2").ok());
    ASSERT_TRUE((*store)->CreateJob(MakeJob("job-1"), "").ok());
    ASSERT_TRUE((*store)->UpdateJob(running).ok());
    ASSERT_TRUE((*store)->PutWorker(MakeWorker("worker-1", 2)).ok());
  }
  EXPECT_EQ(RawQuery(path_, "PRAGMA journal_mode"), "wal");
  EXPECT_EQ(RawQuery(path_, "PRAGMA user_version"), "2");

  absl::StatusOr<std::unique_ptr<Store>> store = OpenSqliteStore(path_);
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<std::vector<v1::JobStatus>> jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_THAT(*jobs, ElementsAre(EqualsProto(MakeJob("job-3")), EqualsProto(running),
                                 EqualsProto(MakeJob("job-1"))));
  absl::StatusOr<std::optional<v1::JobStatus>> found = (*store)->FindJobByRequestId("req-2");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_THAT(*found, Optional(EqualsProto(running)));
  absl::StatusOr<std::vector<v1::WorkerStatus>> workers = (*store)->LoadWorkers();
  ASSERT_TRUE(workers.ok()) << workers.status();
  EXPECT_THAT(*workers, ElementsAre(EqualsProto(MakeWorker("worker-1", 2))));
  // The reopened store still refuses what the first one created.
  EXPECT_EQ((*store)->CreateJob(MakeJob("job-9"), "req-3").code(),
            absl::StatusCode::kAlreadyExists);
}

TEST_F(SqliteStoreTest, TwoConnectionsShareTheFile) {
  absl::StatusOr<std::unique_ptr<Store>> first = OpenSqliteStore(path_);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<Store>> second = OpenSqliteStore(path_);
  ASSERT_TRUE(second.ok()) << second.status();

  ASSERT_TRUE((*first)->CreateJob(MakeJob("job-1"), "req-1").ok());
  absl::StatusOr<std::vector<v1::JobStatus>> jobs = (*second)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_THAT(*jobs, ElementsAre(HasJobId("job-1")));

  const absl::Status duplicate = (*second)->CreateJob(MakeJob("job-2"), "req-1");
  EXPECT_EQ(duplicate.code(), absl::StatusCode::kAlreadyExists) << duplicate;
  ASSERT_TRUE((*second)->CreateJob(MakeJob("job-2"), "req-2").ok());
  jobs = (*first)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_THAT(*jobs, ElementsAre(HasJobId("job-1"), HasJobId("job-2")));
}

// One coordinator per database (issue #27): the lock is exclusive within a process and across
// processes, names the holder's pid, and is free again once released.
TEST_F(SqliteStoreTest, OneLockPerDatabaseNamingItsHolder) {
  bool empty = false;
  absl::StatusOr<DatabaseLock> first = DatabaseLock::Acquire(path_, &empty);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(empty);
  const std::string held_by =
      absl::StrCat(path_, " is in use by another coordinator (pid ", getpid(), ")");
  absl::StatusOr<DatabaseLock> second = DatabaseLock::Acquire(path_, nullptr);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(), HasSubstr(held_by));
  // Another process: exit 0 when refused with the parent named as the holder.
  const pid_t pid = fork();
  ASSERT_NE(pid, -1);
  if (pid == 0) {
    absl::StatusOr<DatabaseLock> child = DatabaseLock::Acquire(path_, nullptr);
    _exit(!child.ok() && absl::StrContains(child.status().message(), held_by) ? 0 : 1);
  }
  int wait_status = 0;
  ASSERT_EQ(waitpid(pid, &wait_status, 0), pid);
  EXPECT_TRUE(WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0);
  // The store opens under the lock; released, the lock is free again, and the file no
  // longer new.
  {
    absl::StatusOr<std::unique_ptr<Store>> store = OpenSqliteStore(path_);
    ASSERT_TRUE(store.ok()) << store.status();
  }
  { const DatabaseLock released = *std::move(first); }
  absl::StatusOr<DatabaseLock> again = DatabaseLock::Acquire(path_, &empty);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(empty);
}

TEST_F(SqliteStoreTest, AnotherProcessSharesTheOpenFile) {
  absl::StatusOr<std::unique_ptr<Store>> store = OpenSqliteStore(path_);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->CreateJob(MakeJob("job-1"), "req-1").ok());

  // The child opens its own connection (it never touches the parent's) and reports by exit
  // code: 0 ok, 1 open failed, 2 did not see job-1, 3 create failed.
  const pid_t pid = fork();
  ASSERT_NE(pid, -1);
  if (pid == 0) {
    absl::StatusOr<std::unique_ptr<Store>> child = OpenSqliteStore(path_);
    if (!child.ok()) _exit(1);
    absl::StatusOr<std::vector<v1::JobStatus>> jobs = (*child)->LoadJobs();
    if (!jobs.ok() || jobs->size() != 1 || (*jobs)[0].job_id() != "job-1") _exit(2);
    if (!(*child)->CreateJob(MakeJob("job-2"), "req-2").ok()) _exit(3);
    child->reset();
    _exit(0);
  }
  int wait_status = 0;
  ASSERT_EQ(waitpid(pid, &wait_status, 0), pid);
  ASSERT_TRUE(WIFEXITED(wait_status));
  EXPECT_EQ(WEXITSTATUS(wait_status), 0);

  absl::StatusOr<std::vector<v1::JobStatus>> jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_THAT(*jobs, ElementsAre(HasJobId("job-1"), HasJobId("job-2")));
}

TEST_F(SqliteStoreTest, RefusesANewerSchemaVersion) {
  ASSERT_TRUE(OpenSqliteStore(path_).ok());
  RawExec(path_, "PRAGMA user_version = 3");
  absl::StatusOr<std::unique_ptr<Store>> store = OpenSqliteStore(path_);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition) << store.status();
  EXPECT_THAT(Message(store.status()), HasSubstr(path_));
  EXPECT_THAT(Message(store.status()), HasSubstr("schema version 3 is newer than this build's 2"));
}

// A schema 1 job, as that build wrote it: the strategy in JobSpec field 8 (automatic 1, the
// fields 2-7, auto_fields 8), the micro-batch in TrainSpec field 4, the plan's strategy in
// Plan fields 3-8 and 14. Those numbers are reserved now, so they are set as unknown fields.
v1::JobStatus Schema1Job(const std::string& id) {
  v1::JobStatus job = MakeJob(id, v1::JOB_STATE_RUNNING);
  job.mutable_spec()->set_name(id);
  google::protobuf::UnknownFieldSet old_strategy;
  old_strategy.AddVarint(1, 0);  // automatic: false
  old_strategy.AddVarint(2, 3);  // zero_stage 3
  old_strategy.AddVarint(4, 1);  // offload_params
  old_strategy.AddVarint(7, 0);  // fused_kernels false
  old_strategy.AddLengthDelimited(8, "activation_checkpointing");
  std::string bytes;
  old_strategy.SerializeToString(&bytes);
  v1::JobSpec* spec = job.mutable_spec();
  spec->GetReflection()->MutableUnknownFields(spec)->AddLengthDelimited(8, bytes);
  v1::TrainSpec* train = spec->mutable_train();
  train->GetReflection()->MutableUnknownFields(train)->AddVarint(4, 2);
  v1::Plan* plan = job.mutable_plan();
  plan->set_ranks(2);
  google::protobuf::UnknownFieldSet* old_plan = plan->GetReflection()->MutableUnknownFields(plan);
  old_plan->AddVarint(3, 3);  // zero_stage
  old_plan->AddVarint(5, 1);  // offload_params
  old_plan->AddVarint(6, 1);  // activation_checkpointing
  old_plan->AddVarint(7, 1);  // chunked_loss
  old_plan->AddVarint(8, 2);  // micro_batch
  return job;                 // fused_kernels (14) absent: false
}

TEST_F(SqliteStoreTest, MigratesSchema1JobsOnOpen) {
  {
    absl::StatusOr<std::unique_ptr<Store>> store = OpenSqliteStore(path_);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->CreateJob(Schema1Job("old"), "req-old").ok());
    v1::JobStatus automatic = MakeJob("auto");
    google::protobuf::UnknownFieldSet old_strategy;
    old_strategy.AddVarint(1, 1);  // automatic: the other fields do not count
    old_strategy.AddVarint(2, 2);
    std::string bytes;
    old_strategy.SerializeToString(&bytes);
    v1::JobSpec* spec = automatic.mutable_spec();
    spec->GetReflection()->MutableUnknownFields(spec)->AddLengthDelimited(8, bytes);
    ASSERT_TRUE((*store)->CreateJob(automatic, "").ok());
  }
  RawExec(path_, "PRAGMA user_version = 1");

  absl::StatusOr<std::unique_ptr<Store>> store = OpenSqliteStore(path_);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(RawQuery(path_, "PRAGMA user_version"), "2");
  absl::StatusOr<std::vector<v1::JobStatus>> jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 2u);

  const v1::JobStatus& old = (*jobs)[0];
  const v1::Strategy& spec = old.spec().strategy();
  EXPECT_EQ(spec.zero_stage(), 3);
  EXPECT_TRUE(spec.offload_params());
  EXPECT_TRUE(spec.has_offload_optimizer());  // fixed at its default
  EXPECT_FALSE(spec.offload_optimizer());
  EXPECT_FALSE(spec.has_activation_checkpointing());  // was auto
  EXPECT_FALSE(spec.fused_kernels());
  EXPECT_EQ(spec.micro_batch(), 2);
  const v1::Strategy& plan = old.plan().strategy();
  EXPECT_EQ(old.plan().ranks(), 2);
  EXPECT_EQ(plan.zero_stage(), 3);
  EXPECT_FALSE(plan.offload_optimizer());
  EXPECT_TRUE(plan.offload_params());
  EXPECT_TRUE(plan.activation_checkpointing());
  EXPECT_TRUE(plan.chunked_loss());
  EXPECT_EQ(plan.micro_batch(), 2);
  EXPECT_TRUE(plan.has_fused_kernels());
  EXPECT_FALSE(plan.fused_kernels());
  // Nothing of schema 1 is left behind.
  EXPECT_EQ(old.spec().GetReflection()->GetUnknownFields(old.spec()).field_count(), 0);
  EXPECT_EQ(old.plan().GetReflection()->GetUnknownFields(old.plan()).field_count(), 0);

  const v1::Strategy& automatic = (*jobs)[1].spec().strategy();
  EXPECT_FALSE(automatic.has_zero_stage());
  EXPECT_FALSE(automatic.has_micro_batch());

  // Opening it again changes nothing.
  store->reset();
  store = OpenSqliteStore(path_);
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<std::vector<v1::JobStatus>> again = (*store)->LoadJobs();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_THAT(*again, ElementsAre(EqualsProto((*jobs)[0]), EqualsProto((*jobs)[1])));
}

TEST_F(SqliteStoreTest, CorruptedJobRecordIsDataLossNamingTheJob) {
  {
    absl::StatusOr<std::unique_ptr<Store>> store = OpenSqliteStore(path_);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->CreateJob(MakeJob("job-ok"), "req-ok").ok());
    ASSERT_TRUE((*store)->CreateJob(MakeJob("job-bad"), "req-bad").ok());
  }
  // Field 1 (job_id) claims 5 bytes and has 2.
  RawExec(path_, "UPDATE jobs SET record = X'0A056162' WHERE job_id = 'job-bad'");

  absl::StatusOr<std::unique_ptr<Store>> store = OpenSqliteStore(path_);
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<std::vector<v1::JobStatus>> jobs = (*store)->LoadJobs();
  ASSERT_FALSE(jobs.ok());
  EXPECT_EQ(jobs.status().code(), absl::StatusCode::kDataLoss) << jobs.status();
  EXPECT_THAT(Message(jobs.status()), HasSubstr(path_));
  EXPECT_THAT(Message(jobs.status()), HasSubstr("job job-bad: stored record does not parse"));

  absl::StatusOr<std::optional<v1::JobStatus>> found = (*store)->FindJobByRequestId("req-bad");
  ASSERT_FALSE(found.ok());
  EXPECT_EQ(found.status().code(), absl::StatusCode::kDataLoss) << found.status();
  found = (*store)->FindJobByRequestId("req-ok");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_THAT(*found, Optional(HasJobId("job-ok")));
}

TEST_F(SqliteStoreTest, CorruptedWorkerRecordIsDataLossNamingTheWorker) {
  {
    absl::StatusOr<std::unique_ptr<Store>> store = OpenSqliteStore(path_);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->PutWorker(MakeWorker("worker-bad", 1)).ok());
  }
  RawExec(path_, "UPDATE workers SET record = X'0A056162' WHERE worker_id = 'worker-bad'");
  absl::StatusOr<std::unique_ptr<Store>> store = OpenSqliteStore(path_);
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<std::vector<v1::WorkerStatus>> workers = (*store)->LoadWorkers();
  ASSERT_FALSE(workers.ok());
  EXPECT_EQ(workers.status().code(), absl::StatusCode::kDataLoss) << workers.status();
  EXPECT_THAT(Message(workers.status()), HasSubstr("worker worker-bad: stored record"));
}

TEST_F(SqliteStoreTest, PathInAMissingDirectoryIsAnErrorNamingThePath) {
  const std::string path = dir_.Path("no-such-dir/lathe.db");
  absl::StatusOr<std::unique_ptr<Store>> store = OpenSqliteStore(path);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition) << store.status();
  EXPECT_THAT(Message(store.status()), HasSubstr(path));
  EXPECT_THAT(Message(store.status()), HasSubstr("unable to open database file"));
}

TEST_F(SqliteStoreTest, AFileThatIsNotADatabaseIsAnErrorNamingThePath) {
  const std::string path =
      dir_.Write("notes.db", "this is a text file and not a SQLite database, long enough\n");
  absl::StatusOr<std::unique_ptr<Store>> store = OpenSqliteStore(path);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition) << store.status();
  EXPECT_THAT(Message(store.status()), HasSubstr(path));
  EXPECT_THAT(Message(store.status()), HasSubstr("not a database"));
}

}  // namespace
}  // namespace lathe
