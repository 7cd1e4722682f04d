// The in-memory Store: the same contract as the SQLite store, without the file.

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/store/store.h"

namespace lathe {
namespace {

class MemoryStore : public Store {
 public:
  absl::Status CreateJob(const v1::JobStatus& job, absl::string_view request_id) override {
    if (job.job_id().empty()) return absl::InvalidArgumentError("CreateJob: job_id is empty");
    absl::MutexLock lock(&mu_);
    if (index_.count(job.job_id()) > 0) {
      return absl::AlreadyExistsError(absl::StrCat("job ", job.job_id(), " already exists"));
    }
    if (!request_id.empty() && request_ids_.count(std::string(request_id)) > 0) {
      return absl::AlreadyExistsError(absl::StrCat("request id ", request_id,
                                                   " already created job ",
                                                   request_ids_[std::string(request_id)]));
    }
    index_[job.job_id()] = jobs_.size();
    jobs_.push_back(job);
    if (!request_id.empty()) request_ids_[std::string(request_id)] = job.job_id();
    return absl::OkStatus();
  }

  absl::Status Write(const StoreBatch& batch) override {
    absl::MutexLock lock(&mu_);
    // Checked in full first: all of the batch or none of it.
    for (const v1::JobStatus& job : batch.jobs) {
      if (index_.count(job.job_id()) == 0) {
        return absl::NotFoundError(absl::StrCat("job ", job.job_id(), " not found"));
      }
    }
    for (const v1::WorkerStatus& worker : batch.workers) {
      if (worker.worker_id().empty()) {
        return absl::InvalidArgumentError("PutWorker: worker_id is empty");
      }
    }
    for (const v1::JobStatus& job : batch.jobs) jobs_[index_.at(job.job_id())] = job;
    for (const v1::WorkerStatus& worker : batch.workers) workers_[worker.worker_id()] = worker;
    for (const std::string& id : batch.deleted_workers) workers_.erase(id);
    return absl::OkStatus();
  }

  absl::StatusOr<std::optional<v1::JobStatus>> FindJobByRequestId(
      absl::string_view request_id) override {
    if (request_id.empty()) return std::nullopt;
    absl::MutexLock lock(&mu_);
    auto it = request_ids_.find(std::string(request_id));
    if (it == request_ids_.end()) return std::nullopt;
    return jobs_[index_.at(it->second)];
  }

  absl::StatusOr<std::vector<v1::JobStatus>> LoadJobs() override {
    absl::MutexLock lock(&mu_);
    return jobs_;
  }

  absl::StatusOr<std::vector<v1::WorkerStatus>> LoadWorkers() override {
    absl::MutexLock lock(&mu_);
    std::vector<v1::WorkerStatus> out;
    out.reserve(workers_.size());
    for (const auto& [id, worker] : workers_) out.push_back(worker);
    return out;
  }

 private:
  absl::Mutex mu_;
  std::vector<v1::JobStatus> jobs_ ABSL_GUARDED_BY(mu_);                  // creation order
  std::map<std::string, size_t> index_ ABSL_GUARDED_BY(mu_);              // job id -> jobs_ index
  std::map<std::string, std::string> request_ids_ ABSL_GUARDED_BY(mu_);   // -> job id
  std::map<std::string, v1::WorkerStatus> workers_ ABSL_GUARDED_BY(mu_);  // by worker id
};

}  // namespace

std::unique_ptr<Store> NewMemoryStore() { return std::make_unique<MemoryStore>(); }

}  // namespace lathe
