// The coordinator's persistent state: every acknowledged job (its whole JobStatus, attempts
// included), the request ids that created them, and the registered workers. The coordinator
// keeps its working state in memory and writes changes in batches (one transaction each),
// each change before it is acknowledged; on start it loads everything back.
//
// Records are the API's proto messages: the store is a table of them, keyed as below.
//
// Thread-safety: implementations are thread-safe.
#ifndef LATHE_COORDINATOR_STORE_STORE_H_
#define LATHE_COORDINATOR_STORE_STORE_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "lathe/v1/coordinator.pb.h"
#include "lathe/v1/job.pb.h"

namespace lathe {

// Changes written together: replaced jobs (each must exist), inserted or replaced workers,
// forgotten workers (absent is fine). Applied in that order.
struct StoreBatch {
  std::vector<v1::JobStatus> jobs;
  std::vector<v1::WorkerStatus> workers;
  std::vector<std::string> deleted_workers;

  bool empty() const { return jobs.empty() && workers.empty() && deleted_workers.empty(); }
};

class Store {
 public:
  virtual ~Store() = default;

  // Inserts `job` (keyed by job.job_id()) and, when `request_id` is not empty, records that
  // it created the job; both or neither, durably, before returning. ALREADY_EXISTS when the
  // job id or the request id is already present (nothing is written then).
  virtual absl::Status CreateJob(const v1::JobStatus& job, absl::string_view request_id) = 0;

  // The job created by `request_id`, or nullopt.
  virtual absl::StatusOr<std::optional<v1::JobStatus>> FindJobByRequestId(
      absl::string_view request_id) = 0;

  // Every job, in creation order.
  virtual absl::StatusOr<std::vector<v1::JobStatus>> LoadJobs() = 0;

  // Applies `batch` in one transaction, durably (one fsync however many records): all of it
  // or, on an error, none of it. NOT_FOUND when a job in it is absent; INVALID_ARGUMENT for
  // an empty job or worker id.
  virtual absl::Status Write(const StoreBatch& batch) = 0;

  // A batch of one.
  absl::Status UpdateJob(const v1::JobStatus& job);
  absl::Status PutWorker(const v1::WorkerStatus& worker);
  absl::Status DeleteWorker(absl::string_view worker_id);

  // Every worker, ordered by worker_id.
  virtual absl::StatusOr<std::vector<v1::WorkerStatus>> LoadWorkers() = 0;
};

// An in-memory store, for tests and for `--db :memory:`.
std::unique_ptr<Store> NewMemoryStore();

// A SQLite store at `path` (created with its tables when missing), WAL journal,
// synchronous=FULL so that an acknowledged write survives a crash. Errors name the path:
// INTERNAL / UNAVAILABLE (database locked by another process) / DATA_LOSS (a record that
// does not parse).
absl::StatusOr<std::unique_ptr<Store>> OpenSqliteStore(const std::string& path);

}  // namespace lathe

#endif  // LATHE_COORDINATOR_STORE_STORE_H_
