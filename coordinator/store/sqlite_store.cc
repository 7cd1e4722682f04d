// The SQLite Store. One connection, serialized by a mutex; WAL so that another process (an
// operator's `sqlite3`, a second coordinator on the same file) can read and write meanwhile.
//
// Schema (PRAGMA user_version 2; a version 1 file is migrated on open, schema1_records.h):
//   jobs(seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT UNIQUE NOT NULL,
//        request_id TEXT UNIQUE, record BLOB NOT NULL)   -- request_id NULL when none
//   workers(worker_id TEXT PRIMARY KEY, record BLOB NOT NULL)
// Records are serialized lathe.v1 protos; creation order is seq.

#include <sqlite3.h>
#include <string.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "coordinator/store/schema1_records.h"
#include "coordinator/store/store.h"

namespace lathe {
namespace {

constexpr int kSchemaVersion = 2;
// How long a statement waits for another connection's lock before giving up (UNAVAILABLE).
constexpr int kBusyTimeoutMs = 5000;

constexpr char kCreateSchema[] = R"sql(
CREATE TABLE IF NOT EXISTS jobs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  job_id TEXT UNIQUE NOT NULL,
  request_id TEXT UNIQUE,
  record BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS workers (
  worker_id TEXT PRIMARY KEY,
  record BLOB NOT NULL
);
PRAGMA user_version = 2;
)sql";

// The code for a SQLite result, by what the caller should do.
absl::StatusCode CodeFor(int rc) {
  switch (rc & 0xff) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return absl::StatusCode::kUnavailable;  // another connection holds the lock: retry
    case SQLITE_CORRUPT:
      return absl::StatusCode::kDataLoss;
    case SQLITE_FULL:
      return absl::StatusCode::kResourceExhausted;
    case SQLITE_CONSTRAINT:
      // Only the unique keys can fail; CreateJob checks them first, so this is a backstop.
      return absl::StatusCode::kAlreadyExists;
    case SQLITE_CANTOPEN:
    case SQLITE_PERM:
    case SQLITE_READONLY:
    case SQLITE_NOTADB:
      return absl::StatusCode::kFailedPrecondition;  // the operator must fix the path
    default:
      return absl::StatusCode::kInternal;
  }
}

struct StatementDeleter {
  void operator()(sqlite3_stmt* statement) const { sqlite3_finalize(statement); }
};
using Statement = std::unique_ptr<sqlite3_stmt, StatementDeleter>;

struct DatabaseDeleter {
  void operator()(sqlite3* db) const { sqlite3_close_v2(db); }
};
using Database = std::unique_ptr<sqlite3, DatabaseDeleter>;

// "<path>: <what>: <sqlite's message>[ (<errno text>)]", with the code from CodeFor.
absl::Status SqliteError(sqlite3* db, int rc, absl::string_view path, absl::string_view what) {
  std::string message =
      absl::StrCat(path, ": ", what, ": ", db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc));
  const int system_errno = db != nullptr ? sqlite3_system_errno(db) : 0;
  if (system_errno != 0 && (rc & 0xff) == SQLITE_CANTOPEN) {
    absl::StrAppend(&message, " (", strerror(system_errno), ")");
  }
  return absl::Status(CodeFor(rc), message);
}

class SqliteStore : public Store {
 public:
  SqliteStore(std::string path, Database db) : path_(std::move(path)), db_(std::move(db)) {}

  // Sets the pragmas and creates or checks the schema.
  absl::Status Init() {
    absl::MutexLock lock(&mu_);
    sqlite3_extended_result_codes(db_.get(), 1);
    int rc = sqlite3_busy_timeout(db_.get(), kBusyTimeoutMs);
    if (rc != SQLITE_OK) return Error(rc, "setting busy_timeout");

    std::string mode;
    LATHE_RETURN_IF_ERROR(QueryText("PRAGMA journal_mode=WAL", "setting journal_mode", &mode));
    if (mode != "wal") {
      return absl::FailedPreconditionError(
          absl::StrCat(path_, ": cannot use the WAL journal (journal_mode is ", mode, ")"));
    }
    LATHE_RETURN_IF_ERROR(Exec("PRAGMA synchronous=FULL", "setting synchronous"));

    // IMMEDIATE: two coordinators starting on a new file must not both create the schema.
    LATHE_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE", "starting the schema transaction"));
    absl::Status status = InitSchemaInTransaction();
    if (!status.ok()) {
      Rollback();
      return status;
    }
    return Commit("committing the schema");
  }

  absl::Status CreateJob(const v1::JobStatus& job, absl::string_view request_id) override {
    if (job.job_id().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(path_, ": CreateJob: job_id is empty"));
    }
    const std::string record = job.SerializeAsString();
    absl::MutexLock lock(&mu_);
    // The lookups and the insert are one write transaction, so that the checks still hold
    // at the insert even with another process writing to the file.
    LATHE_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE", "starting a transaction"));
    absl::Status status = CreateJobInTransaction(job.job_id(), request_id, record);
    if (!status.ok()) {
      Rollback();
      return status;
    }
    return Commit(absl::StrCat("committing job ", job.job_id()));
  }

  absl::Status Write(const StoreBatch& batch) override {
    if (batch.empty()) return absl::OkStatus();
    absl::MutexLock lock(&mu_);
    LATHE_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE", "starting a transaction"));
    absl::Status status = WriteInTransaction(batch);
    if (!status.ok()) {
      Rollback();
      return status;
    }
    return Commit(absl::StrCat("committing ", batch.jobs.size(), " jobs and ",
                               batch.workers.size() + batch.deleted_workers.size(), " workers"));
  }

  absl::StatusOr<std::optional<v1::JobStatus>> FindJobByRequestId(
      absl::string_view request_id) override {
    if (request_id.empty()) return std::nullopt;
    absl::MutexLock lock(&mu_);
    const std::string what = absl::StrCat("looking up request id ", request_id);
    LATHE_ASSIGN_OR_RETURN(Statement statement,
                           Prepare("SELECT job_id, record FROM jobs WHERE request_id = ?", what));
    LATHE_RETURN_IF_ERROR(BindText(statement.get(), 1, request_id, what));
    const int rc = sqlite3_step(statement.get());
    if (rc == SQLITE_DONE) return std::nullopt;
    if (rc != SQLITE_ROW) return Error(rc, what);
    v1::JobStatus job;
    LATHE_RETURN_IF_ERROR(ParseJobRow(statement.get(), &job));
    return job;
  }

  absl::StatusOr<std::vector<v1::JobStatus>> LoadJobs() override {
    absl::MutexLock lock(&mu_);
    constexpr absl::string_view kWhat = "loading jobs";
    LATHE_ASSIGN_OR_RETURN(Statement statement,
                           Prepare("SELECT job_id, record FROM jobs ORDER BY seq", kWhat));
    std::vector<v1::JobStatus> jobs;
    int rc;
    while ((rc = sqlite3_step(statement.get())) == SQLITE_ROW) {
      LATHE_RETURN_IF_ERROR(ParseJobRow(statement.get(), &jobs.emplace_back()));
    }
    if (rc != SQLITE_DONE) return Error(rc, kWhat);
    return jobs;
  }

  absl::StatusOr<std::vector<v1::WorkerStatus>> LoadWorkers() override {
    absl::MutexLock lock(&mu_);
    constexpr absl::string_view kWhat = "loading workers";
    LATHE_ASSIGN_OR_RETURN(
        Statement statement,
        Prepare("SELECT worker_id, record FROM workers ORDER BY worker_id", kWhat));
    std::vector<v1::WorkerStatus> workers;
    int rc;
    while ((rc = sqlite3_step(statement.get())) == SQLITE_ROW) {
      const std::string worker_id = ColumnText(statement.get(), 0);
      if (!workers.emplace_back().ParseFromString(ColumnBlob(statement.get(), 1))) {
        return absl::DataLossError(
            absl::StrCat(path_, ": worker ", worker_id, ": stored record does not parse"));
      }
    }
    if (rc != SQLITE_DONE) return Error(rc, kWhat);
    return workers;
  }

 private:
  absl::Status Error(int rc, absl::string_view what) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return SqliteError(db_.get(), rc, path_, what);
  }

  absl::Status Exec(const char* sql, absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int rc = sqlite3_exec(db_.get(), sql, nullptr, nullptr, nullptr);
    if (rc != SQLITE_OK) return Error(rc, what);
    return absl::OkStatus();
  }

  // Commits the open transaction; rolls it back when the commit fails (e.g. SQLITE_BUSY), so
  // that the connection is never left inside a transaction.
  absl::Status Commit(absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::Status status = Exec("COMMIT", what);
    if (!status.ok()) Rollback();
    return status;
  }

  // Best effort: after a failed statement SQLite may already have rolled back.
  void Rollback() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!sqlite3_get_autocommit(db_.get())) {
      sqlite3_exec(db_.get(), "ROLLBACK", nullptr, nullptr, nullptr);
    }
  }

  absl::StatusOr<Statement> Prepare(absl::string_view sql, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    sqlite3_stmt* raw = nullptr;
    const int rc =
        sqlite3_prepare_v2(db_.get(), sql.data(), static_cast<int>(sql.size()), &raw, nullptr);
    Statement statement(raw);
    if (rc != SQLITE_OK) return Error(rc, what);
    return statement;
  }

  absl::Status BindText(sqlite3_stmt* statement, int index, absl::string_view text,
                        absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int rc = sqlite3_bind_text64(statement, index, text.data(), text.size(), SQLITE_TRANSIENT,
                                       SQLITE_UTF8);
    if (rc != SQLITE_OK) return Error(rc, what);
    return absl::OkStatus();
  }

  absl::Status BindBlob(sqlite3_stmt* statement, int index, absl::string_view blob,
                        absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // A zero-length blob still has to be a blob, not NULL (record is NOT NULL).
    const int rc = blob.empty() ? sqlite3_bind_zeroblob(statement, index, 0)
                                : sqlite3_bind_blob64(statement, index, blob.data(), blob.size(),
                                                      SQLITE_TRANSIENT);
    if (rc != SQLITE_OK) return Error(rc, what);
    return absl::OkStatus();
  }

  // Runs a statement that returns no rows.
  absl::Status StepDone(sqlite3_stmt* statement, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int rc = sqlite3_step(statement);
    if (rc != SQLITE_DONE) return Error(rc, what);
    return absl::OkStatus();
  }

  static std::string ColumnText(sqlite3_stmt* statement, int column) {
    const unsigned char* text = sqlite3_column_text(statement, column);
    return text == nullptr ? std::string()
                           : std::string(reinterpret_cast<const char*>(text),
                                         sqlite3_column_bytes(statement, column));
  }

  static std::string ColumnBlob(sqlite3_stmt* statement, int column) {
    const void* blob = sqlite3_column_blob(statement, column);
    return blob == nullptr ? std::string()
                           : std::string(static_cast<const char*>(blob),
                                         sqlite3_column_bytes(statement, column));
  }

  // Reads the first column of the first row as text.
  absl::Status QueryText(const char* sql, absl::string_view what, std::string* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    LATHE_ASSIGN_OR_RETURN(Statement statement, Prepare(sql, what));
    const int rc = sqlite3_step(statement.get());
    if (rc != SQLITE_ROW) return Error(rc, what);
    *out = ColumnText(statement.get(), 0);
    // Finish the statement so that it holds no read transaction open.
    const int done = sqlite3_step(statement.get());
    if (done != SQLITE_DONE && done != SQLITE_ROW) return Error(done, what);
    return absl::OkStatus();
  }

  // Reads (job_id, record) from the current row into `job`. DATA_LOSS naming the job when the
  // record does not parse.
  absl::Status ParseJobRow(sqlite3_stmt* statement, v1::JobStatus* job)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const std::string job_id = ColumnText(statement, 0);
    if (!job->ParseFromString(ColumnBlob(statement, 1))) {
      return absl::DataLossError(
          absl::StrCat(path_, ": job ", job_id, ": stored record does not parse"));
    }
    return absl::OkStatus();
  }

  absl::Status InitSchemaInTransaction() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::string version_text;
    LATHE_RETURN_IF_ERROR(
        QueryText("PRAGMA user_version", "reading the schema version", &version_text));
    int64_t version = 0;
    if (!absl::SimpleAtoi(version_text, &version)) {
      return absl::InternalError(
          absl::StrCat(path_, ": unreadable schema version \"", version_text, "\""));
    }
    if (version > kSchemaVersion) {
      return absl::FailedPreconditionError(
          absl::StrCat(path_, ": schema version ", version, " is newer than this build's ",
                       kSchemaVersion, "; use a newer lathe-coordinator"));
    }
    if (version == kSchemaVersion) return absl::OkStatus();
    if (version == 1) return MigrateFromSchema1InTransaction();
    return Exec(kCreateSchema, "creating the tables");
  }

  // Rewrites every job record as schema 2 holds the strategy. REQUIRES: a write transaction
  // is open.
  absl::Status MigrateFromSchema1InTransaction() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    constexpr absl::string_view kWhat = "migrating jobs from schema 1";
    std::vector<v1::JobStatus> jobs;
    {
      LATHE_ASSIGN_OR_RETURN(Statement statement,
                             Prepare("SELECT job_id, record FROM jobs ORDER BY seq", kWhat));
      int rc;
      while ((rc = sqlite3_step(statement.get())) == SQLITE_ROW) {
        LATHE_RETURN_IF_ERROR(ParseJobRow(statement.get(), &jobs.emplace_back()));
      }
      if (rc != SQLITE_DONE) return Error(rc, kWhat);
    }
    StoreBatch batch;
    for (v1::JobStatus& job : jobs) {
      MigrateSchema1Record(&job);
      batch.jobs.push_back(std::move(job));
    }
    LATHE_RETURN_IF_ERROR(WriteInTransaction(batch));
    return Exec("PRAGMA user_version = 2", kWhat);
  }

  // REQUIRES: a write transaction is open.
  absl::Status CreateJobInTransaction(const std::string& job_id, absl::string_view request_id,
                                      const std::string& record)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const std::string what = absl::StrCat("creating job ", job_id);
    {
      LATHE_ASSIGN_OR_RETURN(Statement statement,
                             Prepare("SELECT 1 FROM jobs WHERE job_id = ?", what));
      LATHE_RETURN_IF_ERROR(BindText(statement.get(), 1, job_id, what));
      const int rc = sqlite3_step(statement.get());
      if (rc == SQLITE_ROW) {
        return absl::AlreadyExistsError(absl::StrCat(path_, ": job ", job_id, " already exists"));
      }
      if (rc != SQLITE_DONE) return Error(rc, what);
    }
    if (!request_id.empty()) {
      LATHE_ASSIGN_OR_RETURN(Statement statement,
                             Prepare("SELECT job_id FROM jobs WHERE request_id = ?", what));
      LATHE_RETURN_IF_ERROR(BindText(statement.get(), 1, request_id, what));
      const int rc = sqlite3_step(statement.get());
      if (rc == SQLITE_ROW) {
        return absl::AlreadyExistsError(absl::StrCat(path_, ": request id ", request_id,
                                                     " already created job ",
                                                     ColumnText(statement.get(), 0)));
      }
      if (rc != SQLITE_DONE) return Error(rc, what);
    }
    LATHE_ASSIGN_OR_RETURN(
        Statement statement,
        Prepare("INSERT INTO jobs (job_id, request_id, record) VALUES (?, ?, ?)", what));
    LATHE_RETURN_IF_ERROR(BindText(statement.get(), 1, job_id, what));
    if (!request_id.empty()) {
      LATHE_RETURN_IF_ERROR(BindText(statement.get(), 2, request_id, what));
    }  // else left NULL: many jobs may have no request id
    LATHE_RETURN_IF_ERROR(BindBlob(statement.get(), 3, record, what));
    return StepDone(statement.get(), what);
  }

  // REQUIRES: a write transaction is open.
  absl::Status WriteInTransaction(const StoreBatch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // One prepared statement per kind, reset between rows.
    if (!batch.jobs.empty()) {
      constexpr absl::string_view kWhat = "updating jobs";
      LATHE_ASSIGN_OR_RETURN(Statement statement,
                             Prepare("UPDATE jobs SET record = ? WHERE job_id = ?", kWhat));
      for (const v1::JobStatus& job : batch.jobs) {
        const std::string what = absl::StrCat("updating job ", job.job_id());
        sqlite3_reset(statement.get());
        LATHE_RETURN_IF_ERROR(BindBlob(statement.get(), 1, job.SerializeAsString(), what));
        LATHE_RETURN_IF_ERROR(BindText(statement.get(), 2, job.job_id(), what));
        LATHE_RETURN_IF_ERROR(StepDone(statement.get(), what));
        if (sqlite3_changes(db_.get()) == 0) {
          return absl::NotFoundError(absl::StrCat(path_, ": job ", job.job_id(), " not found"));
        }
      }
    }
    if (!batch.workers.empty()) {
      constexpr absl::string_view kWhat = "storing workers";
      LATHE_ASSIGN_OR_RETURN(
          Statement statement,
          Prepare("INSERT INTO workers (worker_id, record) VALUES (?, ?) "
                  "ON CONFLICT (worker_id) DO UPDATE SET record = excluded.record",
                  kWhat));
      for (const v1::WorkerStatus& worker : batch.workers) {
        if (worker.worker_id().empty()) {
          return absl::InvalidArgumentError(absl::StrCat(path_, ": PutWorker: worker_id is empty"));
        }
        const std::string what = absl::StrCat("storing worker ", worker.worker_id());
        sqlite3_reset(statement.get());
        LATHE_RETURN_IF_ERROR(BindText(statement.get(), 1, worker.worker_id(), what));
        LATHE_RETURN_IF_ERROR(BindBlob(statement.get(), 2, worker.SerializeAsString(), what));
        LATHE_RETURN_IF_ERROR(StepDone(statement.get(), what));
      }
    }
    if (!batch.deleted_workers.empty()) {
      constexpr absl::string_view kWhat = "removing workers";
      LATHE_ASSIGN_OR_RETURN(Statement statement,
                             Prepare("DELETE FROM workers WHERE worker_id = ?", kWhat));
      for (const std::string& id : batch.deleted_workers) {
        const std::string what = absl::StrCat("removing worker ", id);
        sqlite3_reset(statement.get());
        LATHE_RETURN_IF_ERROR(BindText(statement.get(), 1, id, what));
        LATHE_RETURN_IF_ERROR(StepDone(statement.get(), what));
      }
    }
    return absl::OkStatus();
  }

  const std::string path_;
  absl::Mutex mu_;
  Database db_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Store>> OpenSqliteStore(const std::string& path) {
  sqlite3* raw = nullptr;
  // NOMUTEX: SqliteStore serializes every use of the connection itself.
  const int rc =
      sqlite3_open_v2(path.c_str(), &raw,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  Database db(raw);
  if (rc != SQLITE_OK) return SqliteError(db.get(), rc, path, "opening the database");
  auto store = std::make_unique<SqliteStore>(path, std::move(db));
  LATHE_RETURN_IF_ERROR(store->Init());
  return store;
}

}  // namespace lathe
